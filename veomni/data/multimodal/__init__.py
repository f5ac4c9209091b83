"""Multimodal data: conversations with images, videos and audio -> Qwen-VL / Qwen-Omni training tensors."""

from .collate import multimodal_collate_infos
from .data_transform import process_sample_qwen2_5_vl, process_sample_qwen3_vl, process_sample_qwen_omni
from .multimodal_chat_template import (
    MULTIMODAL_CHAT_TEMPLATE_REGISTRY,
    MultimodalChatTemplate,
    build_multimodal_chat_template,
)
from .preprocess import conversation_from_sample

__all__ = [
    "MULTIMODAL_CHAT_TEMPLATE_REGISTRY",
    "MultimodalChatTemplate",
    "build_multimodal_chat_template",
    "conversation_from_sample",
    "multimodal_collate_infos",
    "process_sample_qwen2_5_vl",
    "process_sample_qwen3_vl",
    "process_sample_qwen_omni",
]
