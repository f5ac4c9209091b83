"""Models: HF models built from a config or safetensors weights (any init device), their tokenizers and multimodal processors."""

from .auto import build_config, build_foundation_model, build_tokenizer
from .loader import iter_safetensors, load_weights
from .model_weights import save_model_weights
from .multimodal import get_position_id_func
from .processor import build_processor

__all__ = [
    "build_config",
    "build_foundation_model",
    "build_processor",
    "build_tokenizer",
    "get_position_id_func",
    "iter_safetensors",
    "load_weights",
    "save_model_weights",
]
