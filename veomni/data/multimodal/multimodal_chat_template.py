"""Multimodal chat templates: normalised conversations (preprocess.py) -> `input_ids` and `labels`.

A template renders the same text as the model's HF jinja template (`hf_chat_templates.py`) followed by the HF
processor's placeholder expansion: each image / video / audio part becomes `start + replacement + end`, where the
replacement is the processor's expanded placeholder (e.g. `<|image_pad|>` repeated once per merged patch, given by
the data transform). The whole text is tokenised once, so ids equal the HF processor's on the same conversation;
labels keep each assistant turn's content and its `<|im_end|>`, everything else is IGNORE_INDEX.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from ..chat_template import CHAT_TEMPLATE_REGISTRY, ChatTemplate, Segment, _checked, label_tokens_in_spans
from ..data_transform import DataFormatError
from ..dataset import Registry
from . import hf_chat_templates

MULTIMODAL_CHAT_TEMPLATE_REGISTRY = Registry("multimodal chat template")


class MultimodalChatTemplate(ChatTemplate):
    """ChatML turns with media parts; subclasses set the markers, the default system prompt and the jinja."""

    default_system: Optional[str] = None  # written first when the conversation has no system turn
    markers: Dict[str, Tuple[str, str]] = {}  # media type -> (start token, end token) around its placeholder
    placeholders: Dict[str, str] = {}  # media type -> the single placeholder token the jinja writes
    jinja: str = ""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        needed = {"<|im_start|>", "<|im_end|>", *self.placeholders.values()}
        needed |= {t for pair in self.markers.values() for t in pair}
        missing = sorted(t for t in needed if t not in vocab)
        if missing:
            raise ValueError(f"chat template {type(self).__name__} needs tokens {missing} in the tokenizer")

    def render_segments(self, messages, replacements: Optional[Dict[str, List[str]]] = None) -> List[Segment]:
        replacements = {kind: iter(items) for kind, items in (replacements or {}).items()}
        out: List[Segment] = []
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            out.append((f"<|im_start|>system\n{self.default_system}<|im_end|>\n", False))
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant"):
                raise DataFormatError(f"message {i} has role {m['role']!r}; expected system, user or assistant")
            trainable = m["role"] == "assistant"
            body = ""
            for part in [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]:
                kind = part["type"]
                if kind == "text":
                    body += part["text"]
                elif kind in self.markers:
                    if trainable or m["role"] == "system":
                        raise DataFormatError(f"{m['role']} turn {i} holds a {kind}; media go in user turns")
                    start, end = self.markers[kind]
                    try:
                        body += start + next(replacements[kind]) + end
                    except (KeyError, StopIteration):
                        body += start + self.placeholders[kind] + end  # unexpanded, as the jinja writes it
                else:
                    raise DataFormatError(f"chat template {type(self).__name__} has no {kind!r} parts")
            out += [(f"<|im_start|>{m['role']}\n", False), (body + "<|im_end|>", trainable), ("\n", False)]
        return out

    def encode_messages(
        self, messages: Sequence[Dict], max_seq_len: int = 8192, replacements: Optional[Dict[str, List[str]]] = None
    ) -> Dict[str, List[int]]:
        """`input_ids`, `attention_mask`, `labels` of the conversation; `replacements[type][i]` is the expanded
        placeholder of the i-th part of that media type (omitted: the single placeholder token)."""
        text, spans = "", []
        for piece, trainable in self.render_segments(messages, replacements):
            if trainable:
                spans.append((len(text), len(text) + len(piece)))
            text += piece
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        return _checked(ids, label_tokens_in_spans(ids, enc["offset_mapping"], spans), max_seq_len)

    def get_jinja_template(self) -> str:
        return self.jinja


def _register(*names):
    def wrap(cls):
        for name in names:
            MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register(name)(cls)
        return cls

    return wrap


_QWEN_VISION = {"image": ("<|vision_start|>", "<|vision_end|>"), "video": ("<|vision_start|>", "<|vision_end|>")}


@_register("qwen2_vl", "qwen2_5_vl")
class Qwen2VLTemplate(MultimodalChatTemplate):
    """Qwen2-VL / Qwen2.5-VL: a default system prompt, `<|vision_start|><|image_pad|>...<|vision_end|>`."""

    default_system = "You are a helpful assistant."
    markers = _QWEN_VISION
    placeholders = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    jinja = hf_chat_templates.QWEN2_VL


@_register("qwen3_vl", "qwen3_vl_moe")
class Qwen3VLTemplate(Qwen2VLTemplate):
    """Qwen3-VL (dense and MoE): as Qwen2.5-VL without a default system prompt (tool turns are not supported)."""

    default_system = None
    jinja = hf_chat_templates.QWEN3_VL


@_register("qwen2_5_omni", "qwen_omni")
class Qwen2_5OmniTemplate(MultimodalChatTemplate):
    """Qwen2.5-Omni thinker: `<|vision_bos|><|IMAGE|>...<|vision_eos|>`, `<|audio_bos|><|AUDIO|>...<|audio_eos|>`."""

    default_system = "You are a helpful assistant."
    markers = {
        "image": ("<|vision_bos|>", "<|vision_eos|>"),
        "video": ("<|vision_bos|>", "<|vision_eos|>"),
        "audio": ("<|audio_bos|>", "<|audio_eos|>"),
    }
    placeholders = {"image": "<|IMAGE|>", "video": "<|VIDEO|>", "audio": "<|AUDIO|>"}
    jinja = hf_chat_templates.QWEN2_5_OMNI


def build_multimodal_chat_template(name: str, tokenizer, **kwargs) -> ChatTemplate:
    """A multimodal template by name (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen2_5_omni), or a text
    template of `veomni.data.build_chat_template` (for text-only data through the multimodal pipeline)."""
    if name in MULTIMODAL_CHAT_TEMPLATE_REGISTRY:
        return MULTIMODAL_CHAT_TEMPLATE_REGISTRY.get(name)(tokenizer, **kwargs)
    return CHAT_TEMPLATE_REGISTRY.get(name)(tokenizer, **kwargs)
