"""Multimodal chat templates: normalised conversations (preprocess.py) -> `input_ids` and `labels`.

A template renders the model's HF jinja template (`hf_chat_templates.py`), then expands the placeholders as the HF
processor does: the placeholder token of each image / video / audio part becomes its replacement, the processor's
expanded placeholder (e.g. `<|image_pad|>` repeated once per merged patch, given by the data transform). The whole
text is tokenised once, so ids equal the HF processor's on the same conversation; labels keep each assistant turn's
content and its `<|im_end|>`, everything else is IGNORE_INDEX.
"""

import re
from typing import Dict, List, Optional, Sequence

from ..chat_template import ChatTemplate, TokenizerTemplate, build_chat_template, require_tokens
from ..data_transform import DataFormatError
from ..dataset import Registry
from . import hf_chat_templates

MULTIMODAL_CHAT_TEMPLATE_REGISTRY = Registry("multimodal chat template")


class MultimodalChatTemplate(TokenizerTemplate):
    """The model's own jinja (`jinja`, rendered as `apply_chat_template` does, assistant turns aligned with the
    messages as TokenizerTemplate aligns them) with each media placeholder expanded; subclasses set the jinja and
    the placeholder token of each media type."""

    placeholders: Dict[str, str] = {}  # media type -> the single placeholder token the jinja writes

    def __init__(self, tokenizer):
        needed = sorted(set(re.findall(r"<\|\w+\|>", self.jinja)))  # the special tokens the jinja writes
        require_tokens(tokenizer, needed, type(self).__name__, "use the model's own processor (build_processor)")
        super().__init__(tokenizer)
        self._placeholder = re.compile("|".join(re.escape(t) for t in self.placeholders.values()))

    def encode_messages(
        self, messages: Sequence[Dict], max_seq_len: int = 8192, replacements: Optional[Dict[str, List[str]]] = None
    ) -> Dict[str, List[int]]:
        """`input_ids`, `attention_mask`, `labels` of the conversation; `replacements[type][i]` is the expanded
        placeholder of the i-th part of that media type (omitted: the single placeholder token)."""
        messages = [_text_only(i, m, self) for i, m in enumerate(messages)]
        kinds = {token: kind for kind, token in self.placeholders.items()}
        pending = {kind: iter(items) for kind, items in (replacements or {}).items()}
        text = self._placeholder.sub(  # media sit in user turns only: the assistant spans are found after this
            lambda found: next(pending.get(kinds[found.group(0)], iter(())), found.group(0)), self._render(messages)
        )
        return self._encode_rendered(text, messages, max_seq_len)


def _text_only(i: int, message: Dict, template: MultimodalChatTemplate) -> Dict:
    """A turn whose parts are all text, with its text as a string (rendered alike, and aligned by it); a media part
    is checked against the template and the turn's role."""
    content = message["content"]
    if isinstance(content, str):
        return message
    media = [part["type"] for part in content if part["type"] != "text"]
    for kind in media:
        if kind not in template.placeholders:
            raise DataFormatError(f"chat template {type(template).__name__} has no {kind!r} parts")
        if message["role"] != "user":
            raise DataFormatError(f"{message['role']} turn {i} holds a {kind}; media go in user turns")
    return message if media else {**message, "content": "".join(part["text"] for part in content)}


@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen2_vl")
@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen2_5_vl")
class Qwen2VLTemplate(MultimodalChatTemplate):
    """Qwen2-VL / Qwen2.5-VL: a default system prompt, `<|vision_start|><|image_pad|>...<|vision_end|>`."""

    placeholders = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    jinja = hf_chat_templates.QWEN2_VL


@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen3_vl")
@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen3_vl_moe")
class Qwen3VLTemplate(Qwen2VLTemplate):
    """Qwen3-VL (dense and MoE): as Qwen2.5-VL without a default system prompt (tool turns are not supported)."""

    jinja = hf_chat_templates.QWEN3_VL


@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen2_5_omni")
@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen_omni")
class Qwen2_5OmniTemplate(MultimodalChatTemplate):
    """Qwen2.5-Omni thinker: `<|vision_bos|><|IMAGE|>...<|vision_eos|>`, `<|audio_bos|><|AUDIO|>...<|audio_eos|>`."""

    placeholders = {"image": "<|IMAGE|>", "video": "<|VIDEO|>", "audio": "<|AUDIO|>"}
    jinja = hf_chat_templates.QWEN2_5_OMNI


def build_multimodal_chat_template(name: str, tokenizer, **kwargs) -> ChatTemplate:
    """A multimodal template by name (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen2_5_omni), or a text
    template of `veomni.data.build_chat_template` (for text conversations: the `process_sample_*` transforms take
    a multimodal one only, as they hand it the expanded media placeholders)."""
    if name in MULTIMODAL_CHAT_TEMPLATE_REGISTRY:
        return MULTIMODAL_CHAT_TEMPLATE_REGISTRY.get(name)(tokenizer, **kwargs)
    return build_chat_template(name, tokenizer, **kwargs)
