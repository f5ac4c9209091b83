"""Chat templates: conversations -> `input_ids` and `labels` that train only on assistant tokens.

Every template renders a conversation as text segments marked trainable or not, tokenises the whole text once
(so ids equal what `tokenizer.apply_chat_template` gives for the same jinja), and labels a token only when it
starts inside a trainable segment. `get_jinja_template()` returns the same format as HF jinja.
"""

from abc import ABC, abstractmethod
from typing import Dict, List, Sequence, Tuple

from .data_transform import IGNORE_INDEX, DataFormatError
from .dataset import Registry

CHAT_TEMPLATE_REGISTRY = Registry("chat template")

Segment = Tuple[str, bool]  # (text, trainable)


class ChatTemplate(ABC):
    """Base class for custom templates: implement `encode_messages` and `get_jinja_template`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @abstractmethod
    def encode_messages(self, messages: Sequence[Dict[str, str]], max_seq_len: int = 8192) -> Dict[str, List[int]]:
        """Return `input_ids`, `attention_mask` and `labels` (IGNORE_INDEX outside assistant turns)."""

    @abstractmethod
    def get_jinja_template(self) -> str:
        """The equivalent HF jinja template, for inference servers and `apply_chat_template`."""


class SegmentChatTemplate(ChatTemplate):
    """A template defined by `render_segments`; tokenisation and labelling are shared."""

    @abstractmethod
    def render_segments(self, messages: Sequence[Dict[str, str]]) -> List[Segment]: ...

    def encode_messages(self, messages, max_seq_len: int = 8192) -> Dict[str, List[int]]:
        segments = self.render_segments(messages)
        text, spans, pos = "", [], 0
        for piece, trainable in segments:
            if trainable and piece:
                spans.append((pos, pos + len(piece)))
            text += piece
            pos += len(piece)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if len(ids) > max_seq_len:
            raise DataFormatError(f"conversation has {len(ids)} tokens, more than max_seq_len={max_seq_len}")
        labels, k = [], 0
        for token, (start, _) in zip(ids, offsets):
            while k < len(spans) and spans[k][1] <= start:
                k += 1
            inside = k < len(spans) and spans[k][0] <= start < spans[k][1]
            labels.append(token if inside else IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def _check_roles(messages, allowed=("system", "user", "assistant", "tool")):
    for i, m in enumerate(messages):
        if m.get("role") not in allowed:
            raise DataFormatError(f"message {i} has role {m.get('role')!r}; expected one of {allowed}")


@CHAT_TEMPLATE_REGISTRY.register("chatml")
class ChatmlTemplate(SegmentChatTemplate):
    """`<|im_start|>role\\ncontent<|im_end|>\\n`; an assistant turn trains on its content and `<|im_end|>`."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in vocab]
        if missing:
            raise ValueError(f"chat template 'chatml' needs tokens {missing} in the tokenizer")

    def render_segments(self, messages):
        _check_roles(messages)
        out: List[Segment] = []
        for m in messages:
            trainable = m["role"] == "assistant"
            out += [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>", trainable), ("\n", False)]
        return out

    def get_jinja_template(self) -> str:
        return (
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        )


@CHAT_TEMPLATE_REGISTRY.register("default")
class DefaultTemplate(SegmentChatTemplate):
    """Plain-text roles, for any tokenizer: `Role:\\ncontent` blocks; assistant content ends with EOS."""

    def render_segments(self, messages):
        _check_roles(messages)
        eos = self.tokenizer.eos_token or ""
        out: List[Segment] = []
        for m in messages:
            role = m["role"].capitalize()
            if m["role"] == "assistant":
                out += [(f"{role}:\n", False), (m["content"] + eos, True), ("\n\n", False)]
            else:
                out += [(f"{role}:\n{m['content']}\n\n", False)]
        return out

    def get_jinja_template(self) -> str:
        return (
            "{% for message in messages %}{{ message['role'] | capitalize + ':\\n' + message['content'] }}"
            "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant:\\n' }}{% endif %}"
        )


@CHAT_TEMPLATE_REGISTRY.register("tokenizer")
class TokenizerTemplate(SegmentChatTemplate):
    """The tokenizer's own HF jinja template; ids equal `apply_chat_template`, labels cover assistant replies.

    Turn boundaries come from rendering growing prefixes of the conversation, which needs a template whose
    rendering of a prefix is a prefix of the whole (true of ChatML, Llama-3 and most others).
    """

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat template 'tokenizer' needs a tokenizer with a chat_template")

    def _render(self, messages, generation_prompt=False) -> str:
        if not messages and not generation_prompt:
            return ""
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )

    def render_segments(self, messages):
        out: List[Segment] = []
        done = ""
        for i, m in enumerate(messages):
            whole = self._render(messages[: i + 1])
            if not whole.startswith(done):
                raise DataFormatError("the tokenizer's chat template does not render conversations prefix-stably")
            if m["role"] == "assistant":
                header = self._render(messages[:i], generation_prompt=True)
                if not (header.startswith(done) and whole.startswith(header)):
                    raise DataFormatError("the tokenizer's chat template has no stable generation prompt")
                reply = whole[len(header) :]
                body = reply.rstrip()
                out += [(header[len(done) :], False), (body, True), (reply[len(body) :], False)]
            else:
                out.append((whole[len(done) :], False))
            done = whole
        return out

    def get_jinja_template(self) -> str:
        return self.tokenizer.chat_template


def build_chat_template(name: str, tokenizer) -> ChatTemplate:
    """A registered template by name: `chatml`, `default`, `tokenizer`, or one added with
    `@CHAT_TEMPLATE_REGISTRY.register(name)`."""
    return CHAT_TEMPLATE_REGISTRY.get(name)(tokenizer)
