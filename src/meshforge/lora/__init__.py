"""Low-rank adapters (`lora_config:`): selection and attachment (`apply.py`), the adapted linear
(`layer.py`), PEFT adapter folders and merged exports (`peft_io.py`), the LoRA step rebuilt
offline (`offline.py`); the checkpoint's base reference is `checkpoint/lora_base.py`. Light: submodules import torch when imported."""
