"""Shared by the multimodal data tests: tiny Qwen-VL sizes, and model classes built on meta for get_rope_index."""

import torch

TINY_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
TINY_TEXT.update(intermediate_size=64, vocab_size=151936)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32)


def meta_model(cls, config):
    """The model class itself (for its own get_rope_index), built without allocating weights."""
    with torch.device("meta"):
        return cls(config)
