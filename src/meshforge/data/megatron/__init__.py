"""Megatron-format pretraining data: indexed .bin/.idx files, GPT and blended datasets, preprocess.

Light package: import the submodules (`indexed`, `gpt_dataset`, `blended`, `preprocess`) you need.
"""
