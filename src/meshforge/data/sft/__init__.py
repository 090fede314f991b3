"""LLaMA-Factory-compatible SFT data: dataset_info, converters, templates, processor, packing, loader."""
