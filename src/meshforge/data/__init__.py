"""meshforge.data: see docs/architecture.md for what lives here.

The loader registry (`specs`, pydantic only) is imported with the package: it hands
`data/config.py` the parser of each loader's options, so a `TrainDatasetConfig` is never
validated without it while `data/config.py` itself imports no other data module.
"""

from meshforge.data import specs as _specs  # noqa: F401
