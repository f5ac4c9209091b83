"""Shared by the multimodal data tests: tiny Qwen-VL sizes, model classes built on meta for get_rope_index, and the
Qwen2.5-VL sample transform most of them use."""

from functools import partial

import torch
import transformers as tf

from veomni.data import build_multimodal_chat_template
from veomni.data.multimodal import process_sample_qwen2_5_vl
from veomni.models.position_ids import build_position_id_func

TINY_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
TINY_TEXT.update(intermediate_size=64, vocab_size=151936)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32)


def meta_model(cls, config):
    """The model class itself (for its own get_rope_index), built without allocating weights."""
    with torch.device("meta"):
        return cls(config)


def qwen2_5_vl_transform(processor):
    """The Qwen2.5-VL sample transform with `processor`, its chat template and a tiny config's M-RoPE positions."""
    config = tf.Qwen2_5_VLConfig(text_config=TINY_TEXT, vision_config=TINY_VISION)
    return partial(
        process_sample_qwen2_5_vl,
        processor=processor,
        chat_template=build_multimodal_chat_template("qwen2_5_vl", processor.tokenizer),
        position_id_func=build_position_id_func(config),
    )
