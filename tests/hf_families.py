"""Tiny models of every family the project builds, written by transformers' own `save_pretrained` (the hub key
layout), and a real sample for each: Shakespeare through the family's tokenizer, and for VL / Omni models a real
photo (and real speech) through the real Qwen processors and the project's own sample transforms.

Text vocabularies are real (151,936 for Qwen, 128,256 for Llama, the demo's 4,096 for the demo configs) and the
multimodal token ids are the real Qwen tokenizer's, so the samples are what a user's data would give.
"""

import copy
import json
import os
from functools import partial
from typing import Dict, Optional

import torch
import transformers as tf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("qwen2", "qwen3", "llama", "qwen3_moe")
VISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
OMNI = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
FULL_OMNI = ("qwen2_5_omni", "qwen3_omni_moe")  # thinker + talker + vocoder in one checkpoint
FAMILIES = TEXT + VISION + OMNI
MOE = ("qwen3_moe", "qwen3_vl_moe", "qwen3_omni_moe_thinker")
QWEN_VOCAB = 151936
# the real Qwen tokenizer's ids of the multimodal placeholders
QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
OMNI_IDS = dict(
    image_token_index=151655,
    video_token_index=151656,
    audio_token_index=151646,
    audio_start_token_id=151647,
    audio_end_token_id=151648,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
TINY_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_TEXT.update(intermediate_size=128, vocab_size=QWEN_VOCAB, tie_word_embeddings=False)
_TOKENIZER = {"qwen2": "demo", "qwen3_moe": "demo", "qwen3": "qwen3", "llama": "llama3_1"}
_PROCESSOR = {"qwen2_vl": "qwen2_5_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl"}
# Qwen3-Omni: no Qwen3-Omni processor is built here (its audio placeholders differ from Qwen2.5-Omni's), so its
# sample is a real photo through the processor with its patch size (Qwen3-VL's), without audio
_PROCESSOR.update(qwen2_5_omni_thinker="qwen2_5_omni", qwen3_omni_moe_thinker="qwen3_vl")


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _tiny_multimodal(name: str) -> dict:
    """The repo's tiny config of `name` with the real vocabulary and the real tokenizer's placeholder ids."""
    config = _json(os.path.join(REPO, "configs", "multimodal", "tiny", name, "config.json"))
    config["text_config"]["vocab_size"] = QWEN_VOCAB
    for key in [k for k in config if k.endswith(("_token_id", "_token_index"))]:
        del config[key]
    config.update(OMNI_IDS if "omni" in name else QWEN_IDS)
    if name == "qwen3_omni_moe_thinker":
        config.update(audio_token_id=151646, image_token_id=151655, video_token_id=151656)
    return config


def family_config(name: str) -> tf.PretrainedConfig:
    if name in ("qwen2", "qwen3_moe"):
        folder = {"qwen2": "demo_qwen2", "qwen3_moe": "demo_qwen3_moe"}[name]
        config = _json(os.path.join(REPO, "configs", "model", folder, "config.json"))
        if name == "qwen3_moe":  # 12 experts: experts 10 and 11 must stack after 9, not after 1
            config.update(num_experts=12, mlp_only_layers=[0])  # and a dense first layer
        return tf.AutoConfig.for_model(**config)
    if name == "qwen3":
        return tf.Qwen3Config(**dict(TINY_TEXT, tie_word_embeddings=True))
    if name == "llama":
        return tf.LlamaConfig(**dict(TINY_TEXT, vocab_size=128256))
    if name == "qwen2_vl":
        text = dict(TINY_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, **QWEN_IDS)
    if name in VISION + OMNI:
        return tf.AutoConfig.for_model(**_tiny_multimodal(name))
    if name == "qwen2_5_omni":
        return full_omni_config(name)
    if name == "qwen3_omni_moe":
        return full_omni_config(name)
    raise ValueError(name)


def full_omni_config(name: str) -> tf.PretrainedConfig:
    """A full Omni config (thinker + speech talker + vocoder), tiny everywhere."""
    thinker = _tiny_multimodal(f"{name}_thinker")
    small = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    small.update(head_dim=16)
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if name == "qwen2_5_omni":
        talker = dict(small, vocab_size=256, embedding_size=64, thinker_hidden_size=64, rope_parameters=mrope)
        talker.update(tts_codec_start_token_id=250, tts_codec_end_token_id=251, tts_codec_pad_token_id=252)
        talker.update(tts_codec_mask_token_id=253)
        dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, emb_dim=16, num_embeds=64)
        dit.update(enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8)
        dit.update(enc_se_channels=8, look_ahead_layers=[1], look_backward_layers=[0])
        token2wav = {"dit_config": dit, "bigvgan_config": dict(upsample_initial_channel=32)}
        return tf.Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav)
    talker_text = dict(small, vocab_size=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    talker_text.update(shared_expert_intermediate_size=32, rope_parameters=mrope)
    talker = dict(num_code_groups=4, thinker_hidden_size=64, accept_hidden_layer=0, spatial_merge_size=2)
    talker.update(code_predictor_config=dict(small, vocab_size=64, num_code_groups=4), text_config=talker_text)
    talker.update(codec_eos_token_id=250, codec_nothink_id=251, codec_think_bos_id=252, codec_think_eos_id=253)
    talker.update(codec_pad_id=254, codec_bos_id=255)
    code2wav = dict(codebook_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_quantizers=4)
    code2wav.update(intermediate_size=64, num_hidden_layers=1, decoder_dim=32, sliding_window=8)
    return tf.Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav)


def hf_class(config: tf.PretrainedConfig):
    """The class transformers uses for this config (the checkpoint's own architecture)."""
    from veomni.models.multimodal import model_class_for

    full = {
        "qwen2_5_omni": tf.Qwen2_5OmniForConditionalGeneration,
        "qwen3_omni_moe": tf.Qwen3OmniMoeForConditionalGeneration,
    }
    return full.get(config.model_type) or model_class_for(config)


def write_checkpoint(name: str, folder: str, max_shard_size: Optional[str] = None, seed: int = 0) -> str:
    """A random tiny model of `name`, written by transformers' `save_pretrained` (sharded when `max_shard_size`)."""
    torch.manual_seed(seed)
    config = family_config(name)
    cls = hf_class(config)
    model = (cls(config) if name in FULL_OMNI else cls.from_config(config)).to(torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def thinker_of(name: str) -> str:
    return f"{name}_thinker" if name in FULL_OMNI else name


def transformers_load(name: str, folder: str):
    """What a user gets from transformers for the part the project trains (a full Omni checkpoint's thinker)."""
    thinkers = {
        "qwen2_5_omni": tf.Qwen2_5OmniThinkerForConditionalGeneration,
        "qwen3_omni_moe": tf.Qwen3OmniMoeThinkerForConditionalGeneration,
    }
    cls = thinkers.get(name) or hf_class(family_config(name))
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------------ real samples
def shakespeare(n_chars: int = 600) -> str:
    from veomni.utils.demo_assets import ensure_demo_assets

    root = ensure_demo_assets(os.path.join(REPO, ".assets"), quiet=True)
    with open(os.path.join(root, "shakespeare", "valid.jsonl")) as f:
        return json.loads(f.readline())["text"][:n_chars]


def _text_batch(name: str) -> Dict[str, torch.Tensor]:
    from real_tokenizers import real_tokenizer_dir

    kind, text = _TOKENIZER[name], shakespeare()  # (builds the demo tokenizer on first use)
    folder = os.path.join(REPO, ".assets", "tokenizer") if kind == "demo" else real_tokenizer_dir(kind)
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(text)["input_ids"]
    return {"input_ids": torch.tensor([ids])}


def _multimodal_batch(name: str, config, processors, assets) -> Dict[str, torch.Tensor]:
    from vlm_inputs import one_sample_batch

    from veomni.data import build_multimodal_chat_template
    from veomni.data.multimodal import process_sample_qwen2_5_vl, process_sample_qwen3_vl, process_sample_qwen_omni
    from veomni.models.position_ids import build_position_id_func

    kind = _PROCESSOR[name]
    processor = processors[kind]
    transform = {"qwen2_5_vl": process_sample_qwen2_5_vl, "qwen3_vl": process_sample_qwen3_vl}.get(kind)
    image = assets["images"]["astronaut"]
    content = [{"type": "image", "image": image["path"]}, {"type": "text", "text": "What is in this photo?"}]
    if "omni" in name:
        transform = process_sample_qwen_omni
    if kind == "qwen2_5_omni":
        content.insert(1, {"type": "audio", "audio": assets["wav"]})
    sample = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": image["caption"]}]}
    template = build_multimodal_chat_template(kind, processor.tokenizer)
    process = partial(
        transform, processor=processor, chat_template=template, position_id_func=build_position_id_func(config)
    )
    processed = process(copy.deepcopy(sample))
    batch = one_sample_batch(processed)
    return {k: v for k, v in batch.items() if not k.endswith("_mask") or k == "feature_attention_mask"}


def real_batch(name: str, config, processors=None, assets=None) -> Dict[str, torch.Tensor]:
    """A real sample for `name` as a batch of one, in transformers' own input format."""
    if name in TEXT:
        return _text_batch(name)
    return _multimodal_batch(name, config, processors, assets)
