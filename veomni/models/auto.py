"""`build_foundation_model` and `build_tokenizer`: HF-format configs, tokenizers and safetensors weights."""

import copy
import json
import os
from typing import Any, Dict, Optional, Union

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ..compat.transformers import set_config_experts_implementation
from ..ops.attention import VARLEN, resolve_attn_implementation
from ..ops.moe import experts_implementation
from ..utils.demo_assets import missing_asset_hint
from ..utils.hub import download
from ..utils.logging import get_logger
from .loader import init_empty_weights, load_weights, num_experts_of
from .multimodal import (
    adapt_multimodal_model,
    attn_implementation_for,
    is_multimodal,
    model_class_for,
    thinker_config,
)

logger = get_logger(__name__)

_DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16")}
_DTYPES.update(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)


def to_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class CustomCodeError(ValueError):
    """A model or tokenizer folder that names its own Python code (`auto_map`), without model.trust_remote_code."""


def _refuse_custom_code(path: str, file_name: str, trust_remote_code: bool) -> None:
    """A folder whose config names custom code is refused, not quietly trained as the stock class (transformers
    would build the built-in class of a known model_type and ignore the folder's code, which may differ)."""
    config_file = os.path.join(path, file_name) if os.path.isdir(path) else path
    if trust_remote_code or not os.path.isfile(config_file) or not config_file.endswith(".json"):
        return
    with open(config_file) as f:
        auto_map = json.load(f).get("auto_map")
    if auto_map:
        raise CustomCodeError(
            f"{config_file} names custom code (auto_map: {auto_map}): set model.trust_remote_code true to run that "
            "code, or remove auto_map from the file to train transformers' built-in class"
        )


def build_config(config_path: str, trust_remote_code: bool = False, **config_kwargs) -> PretrainedConfig:
    """An HF config from a local folder or file, or a hub name (veomni.utils.hub). `trust_remote_code` (model.trust_remote_code) stays False unless the
    user asks: a folder whose config names custom Python code (`auto_map`) is refused instead of imported."""
    if config_path is None:
        raise ValueError("build_foundation_model needs config_path or weights_path")
    config_path = download(config_path, "model.config_path")  # a hub name: its folder in the hub cache
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"model config not found: {config_path}{missing_asset_hint(config_path)}")
    _refuse_custom_code(config_path, "config.json", trust_remote_code)
    return AutoConfig.from_pretrained(config_path, trust_remote_code=trust_remote_code, **config_kwargs)


def build_tokenizer(tokenizer_path: str, trust_remote_code: bool = False, **kwargs):
    """An HF fast tokenizer from a local folder (tokenizer.json + tokenizer_config.json) or a hub name; custom tokenizer code
    only with `trust_remote_code=True` (a folder naming it is refused otherwise)."""
    tokenizer_path = download(tokenizer_path, "model.tokenizer_path")  # a hub name: its folder in the hub cache
    if tokenizer_path is None or not os.path.exists(tokenizer_path):
        raise FileNotFoundError(f"tokenizer not found: {tokenizer_path}{missing_asset_hint(tokenizer_path or '')}")
    _refuse_custom_code(tokenizer_path, "tokenizer_config.json", trust_remote_code)
    return AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code, **kwargs)


def _kernels_of(ops_implementation, attn_implementation: Optional[str], moe_implementation: Optional[str]):
    """(attention, experts) implementations: from `ops_implementation` (an `OpsImplementationConfig`, VeOmni's way
    of passing them) where the keywords were left at their defaults; a keyword that disagrees with it is refused."""
    if ops_implementation is None:
        return attn_implementation, moe_implementation
    chosen = []
    for key, given, default in (
        ("attn_implementation", attn_implementation, VARLEN),
        ("moe_implementation", moe_implementation, None),
    ):
        from_ops = getattr(ops_implementation, key, None)
        if given != default and from_ops is not None and given != from_ops:
            raise ValueError(f"build_foundation_model: {key}={given!r} but ops_implementation.{key}={from_ops!r}")
        chosen.append(given if given != default or from_ops is None else from_ops)
    return tuple(chosen)


def build_foundation_model(
    config_path: Union[None, str, PretrainedConfig] = None,
    weights_path: Optional[str] = None,
    init_device: str = "cpu",
    torch_dtype: Union[str, torch.dtype] = "bfloat16",
    attn_implementation: Optional[str] = VARLEN,
    moe_implementation: Optional[str] = None,
    config_kwargs: Optional[Dict[str, Any]] = None,
    trust_remote_code: bool = False,
    ops_implementation: Optional[Any] = None,
) -> PreTrainedModel:
    """Build a causal LM, or a vision/audio-language model (Qwen2.5-VL, Qwen3-VL(-MoE), Qwen2.5-Omni / Qwen3-Omni-MoE
    thinker; a full Omni config builds its thinker), from an HF config, loading `weights_path` unless the model is
    built on `meta`. Multimodal ones get the packing/FSDP adapter of veomni/models/multimodal.py (and their samples'
    M-RoPE ids from `get_position_id_func(model)`).

    Weights load exactly as transformers' `from_pretrained` loads them: its own key renames and conversions (hub
    layouts of VL / Omni models, per-expert MoE keys fused, a full Omni checkpoint into its thinker), checked
    against the model before anything is read (veomni/models/loader.py).

    `torch_dtype` defaults to "bfloat16", the usual training dtype on GPUs: a model loaded that way differs from an
    fp32 `from_pretrained` by bf16 rounding (~2e-4 relative). Pass "float32" for fp32 master weights (the trainer
    does, per `model.torch_dtype`) and every tensor equals transformers' fp32 load bit for bit.

    `init_device="meta"` allocates no parameter memory: `build_parallelize_model` materialises the shards and
    loads the weights (from rank 0, broadcast) afterwards. Without weights the model is initialised from the
    current torch seed, identically on every rank. `trust_remote_code` (also accepted in `config_kwargs`) lets a
    config's `auto_map` import Python from the model folder; off by default.

    VeOmni's calling convention works too: `config_path` may be a `PretrainedConfig` object (copied, never changed),
    whose `architectures` may name a `*ForTokenClassification` / `*ForSequenceClassification` head (a critic or reward
    model); `ops_implementation` (an `OpsImplementationConfig`) supplies `attn_implementation` and
    `moe_implementation` (an explicit keyword that disagrees with it is an error).
    """
    config_kwargs = dict(config_kwargs or {})
    trust_remote_code = bool(config_kwargs.pop("trust_remote_code", trust_remote_code))
    attn_implementation, moe_implementation = _kernels_of(ops_implementation, attn_implementation, moe_implementation)
    if isinstance(config_path, PretrainedConfig):  # verl's critic passes one it rewrote: copied, never changed
        config = copy.deepcopy(config_path)
        config.update(config_kwargs)
    else:
        config = build_config(config_path or weights_path, trust_remote_code=trust_remote_code, **config_kwargs)
    config = thinker_config(config)
    is_moe = bool(num_experts_of(config))
    for sub in (config, getattr(config, "text_config", None)):  # the (text) sub-config is what the decoder reads
        if sub is not None:
            sub.use_cache = False  # with a cache, transformers ignores packed position_ids and attends across documents
            if is_moe:
                set_config_experts_implementation(sub, experts_implementation(moe_implementation))
    # veomni_varlen (default): packed documents attend only within themselves, with no (S x S) mask
    attn = attn_implementation_for(config, resolve_attn_implementation(attn_implementation))
    with init_empty_weights() if init_device == "meta" else torch.device(init_device):
        model = model_class_for(config).from_config(
            config, attn_implementation=attn, dtype=to_dtype(torch_dtype), trust_remote_code=trust_remote_code
        )
    if init_device != "meta" and weights_path is not None:
        weights_path = download(weights_path)
        load_weights(model, weights_path)
        logger.info(f"loaded weights from {weights_path}")
    if is_multimodal(config):
        adapt_multimodal_model(model)
    return model
