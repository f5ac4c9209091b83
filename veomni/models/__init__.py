"""Models: HF models built from a config or safetensors weights (any init device), and their tokenizers."""

from .auto import build_config, build_foundation_model, build_tokenizer
from .loader import iter_safetensors, load_weights

__all__ = ["build_config", "build_foundation_model", "build_tokenizer", "iter_safetensors", "load_weights"]
