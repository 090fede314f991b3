"""meshforge: train language models from one YAML file with PyTorch's own distributed stack.

Kept light on purpose: importing the package must not import torch, so that
`meshforge config ...` answers in well under a second.
"""

__version__ = "0.1.0"
