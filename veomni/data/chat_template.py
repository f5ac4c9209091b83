"""Chat templates: conversations -> `input_ids` and `labels` that train only on assistant tokens, labelled on the
one tokenisation of one rendering (so ids equal `tokenizer.apply_chat_template`'s; TokenizerTemplate says how).

`build_chat_template("auto", tokenizer)` (the default of `data.chat_template`) is the tokenizer's own template when it
ships one, else the plain `default` format. Two options apply to every built-in template: `last_turn_only` (loss on
the last assistant turn only) and `think_loss` (whether `<think>...</think>` blocks in assistant turns carry loss:
`train` all of them, `mask` none, `mask_empty` only the empty ones a template writes for a turn without reasoning).
"""

import json
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from jinja2 import TemplateError

from .data_transform import IGNORE_INDEX, DataFormatError
from .dataset import Registry


class ChatTemplateError(ValueError):
    """A chat template that cannot be used for training (said in one line, at start-up)."""


CHAT_TEMPLATE_REGISTRY = Registry("chat template")


THINK_LOSS = ("train", "mask", "mask_empty")
# a reasoning block and the whitespace after it (the answer starts after it); `<think>` may sit in the generation
# prompt (outside the assistant span): only its part inside the span is masked
_THINK_BLOCK = re.compile(r"<think>(.*?)</think>\s*", re.S)


class ChatTemplate(ABC):
    """Base class for custom templates: implement `encode_messages` and `get_jinja_template`.

    `last_turn_only` and `think_loss` are honoured by the built-in templates (and by subclasses of
    TokenizerTemplate); a custom template that handles them itself sets `supports_label_options = True`.
    """

    supports_label_options = False

    def __init__(self, tokenizer, last_turn_only: bool = False, think_loss: str = "train"):
        if think_loss not in THINK_LOSS:
            raise ChatTemplateError(f"think_loss={think_loss!r}; expected one of {list(THINK_LOSS)}")
        self.tokenizer, self.last_turn_only, self.think_loss = tokenizer, last_turn_only, think_loss

    @abstractmethod
    def encode_messages(self, messages: Sequence[Dict[str, str]], max_seq_len: int = 8192) -> Dict[str, List[int]]:
        """Return `input_ids`, `attention_mask` and `labels` (IGNORE_INDEX outside assistant turns); a template
        that supports tools also takes `tools=` (OpenAI function schemas)."""

    @abstractmethod
    def get_jinja_template(self) -> str:
        """The equivalent HF jinja template, for inference servers and `apply_chat_template`."""


def _marked_runs(offsets, mask) -> List[Tuple[int, int]]:
    """Runs of marked tokens (HF's assistant mask) as character spans, one per run."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])))  # first, past-last
    return [(offsets[first][0], offsets[last - 1][1]) for first, last in zip(edges[::2], edges[1::2])]


def _in_spans(positions: np.ndarray, spans: List[Tuple[int, int]]) -> np.ndarray:
    """Whether each position lies inside one of the sorted, disjoint [start, end) spans: past an odd number of
    their boundaries."""
    return np.searchsorted(np.ravel(spans), positions, side="right") % 2 == 1


def require_tokens(tokenizer, tokens: Sequence[str], template: str, hint: str) -> None:
    """A template's special tokens must be single tokens of the tokenizer, else ChatTemplateError."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ChatTemplateError(
            f"chat template {template!r} needs the special tokens {missing}, which the tokenizer lacks (they would be "
            f"split into pieces): {hint}"
        )


@CHAT_TEMPLATE_REGISTRY.register("tokenizer")
class TokenizerTemplate(ChatTemplate):
    """The tokenizer's own HF jinja template, rendered once per conversation (as `apply_chat_template` does).

    Ids are the tokens of that one rendering, so they equal `tokenizer.apply_chat_template(messages, tools=...)`
    token for token, whatever the template does to earlier turns (drop their reasoning, add a default system
    prompt, change a turn's end when another follows). Labels cover each assistant turn as the template renders it
    -- its reasoning if rendered, its content, its tool calls -- and the end-of-turn token; everything else is
    IGNORE_INDEX. Earlier turns' reasoning is trained on exactly when the template renders it (Qwen3's drops it for
    every turn before the last user query); `last_turn_only=True` trains on the last assistant turn alone.

    How the assistant spans are found in the rendered text (character offsets -> tokens by offset mapping):
    - a template with `{% generation %}` blocks marks them itself: HF's assistant mask is used as is;
    - otherwise the messages are aligned in order with the rendering. Each non-assistant message's content must
      appear (stripped) after the previous match; each assistant turn starts right after the next occurrence of the
      template's generation prompt (the text `add_generation_prompt=True` appends, e.g. `<|im_start|>assistant\\n`),
      contains its visible answer (or its tool-call names), and ends with the next end-of-turn marker (the first
      special token the template writes after an assistant reply). Every piece is matched in order and the spans
      cannot overlap another message's content, so a template this cannot align raises DataFormatError (skippable
      with data.skip_bad_samples) instead of mis-labelling a sample.
    """

    supports_label_options = True
    jinja: Optional[str] = None  # a template of the class's own (chatml, default, multimodal); None: the tokenizer's
    renders_tools = True  # whether the jinja writes `tools=` (OpenAI function schemas)

    def __init__(self, tokenizer, last_turn_only: bool = False, think_loss: str = "train"):
        super().__init__(tokenizer, last_turn_only=last_turn_only, think_loss=think_loss)
        self.jinja = self.jinja or getattr(tokenizer, "chat_template", None)
        if not self.jinja:
            raise ChatTemplateError("chat template 'tokenizer' needs a tokenizer with a chat_template")
        self.uses_generation_tags = re.search(r"\{%-?\s*generation\s*-?%\}", self.jinja) is not None
        self.generation_prompt, self.end_of_turn = self._turn_markers()

    def _render(self, messages, tools=None, tokenize=False, **options):
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=tokenize, chat_template=self.jinja, **options
        )

    def _turn_markers(self) -> Tuple[str, str]:
        """The generation prompt and the end-of-turn marker, read off a one-exchange probe rendering."""
        user, reply = "VEOMNI_PROBE_QUESTION", "VEOMNI_PROBE_ANSWER"
        asked = [{"role": "user", "content": user}]
        before, prompted = self._render(asked), self._render(asked, add_generation_prompt=True)
        other = "; use data.chat_template chatml or default, or a tokenizer whose template renders assistant turns"
        if not prompted.startswith(before) or prompted == before:
            raise ChatTemplateError(
                "the tokenizer's chat template has no generation prompt to find assistant turns by" + other
            )
        whole = self._render(asked + [{"role": "assistant", "content": reply}])
        if reply not in whole:  # a prompt-only template: there would be nothing to train on
            raise ChatTemplateError("the tokenizer's chat template does not render the assistant's reply" + other)
        after = whole[whole.rindex(reply) + len(reply) :]
        specials = sorted((t for t in self.tokenizer.get_added_vocab() if t and t in after), key=after.index)
        if not specials:
            raise ChatTemplateError(
                "the tokenizer's chat template writes no special end-of-turn token after a reply" + other
            )
        return prompted[len(before) :], specials[0]

    def get_jinja_template(self) -> str:
        return self.jinja

    def encode_messages(self, messages, max_seq_len: int = 8192, tools=None) -> Dict[str, List[int]]:
        if tools and not self.renders_tools:
            raise DataFormatError(f"chat template {type(self).__name__} has no tool format; use 'tokenizer'")
        messages = list(messages)
        try:
            if not self.uses_generation_tags:
                return self._encode_rendered(self._render(messages, tools), messages, max_seq_len)
            enc = self._render(  # one tokenisation: HF's, with its assistant mask and the offsets
                messages,
                tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                tokenizer_kwargs={"return_offsets_mapping": True},
            )
            text = self._render(messages, tools) if self.think_loss != "train" else ""  # for its think blocks
        except TemplateError as err:  # a conversation this template cannot render is bad data (skippable), not a crash
            raise DataFormatError(f"the chat template cannot render this conversation: {err}") from err
        spans = _marked_runs(enc["offset_mapping"], enc["assistant_masks"])
        return self._labelled(list(enc["input_ids"]), enc["offset_mapping"], spans, text, max_seq_len)

    def _encode_rendered(self, text: str, messages, max_seq_len: int) -> Dict[str, List[int]]:
        """Tokenise the rendered `text` once; labels on the assistant spans aligned with `messages`."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = self._assistant_spans(text, messages)
        return self._labelled(list(enc["input_ids"]), enc["offset_mapping"], spans, text, max_seq_len)

    def _labelled(self, ids: List[int], offsets, spans, text: str, max_seq_len: int) -> Dict[str, List[int]]:
        """Labels on the tokens that start inside `spans` (after `last_turn_only`) and outside the think blocks
        `think_loss` masks in `text`."""
        if self.last_turn_only:
            spans = spans[-1:]
        holes = [  # the think blocks that carry no loss (mask_empty: only those with no reasoning)
            m.span()
            for m in _THINK_BLOCK.finditer(text)
            if self.think_loss == "mask" or (self.think_loss == "mask_empty" and not m.group(1).strip())
        ]
        starts = np.array([start for start, _ in offsets], dtype=np.int64)
        keep = _in_spans(starts, spans) & ~_in_spans(starts, holes)
        if len(ids) > max_seq_len:
            raise DataFormatError(f"conversation has {len(ids)} tokens, more than max_seq_len={max_seq_len}")
        if not keep.any():
            raise DataFormatError("no assistant tokens to train on")
        labels = np.where(keep, ids, IGNORE_INDEX).tolist()
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    def _assistant_spans(self, text: str, messages) -> List[Tuple[int, int]]:
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                content = m.get("content")
                anchor = content.strip() if isinstance(content, str) else ""
                if anchor:
                    found = text.find(anchor, cursor)
                    if found < 0:
                        raise DataFormatError(f"message {i} ({m.get('role')}) is not rendered where expected")
                    cursor = found + len(anchor)
                continue
            start = text.find(self.generation_prompt, cursor)
            if start < 0:
                raise DataFormatError(f"assistant message {i}: no generation prompt in the rendered text")
            start += len(self.generation_prompt)
            end = start
            for anchor in _assistant_anchors(m):
                found = text.find(anchor, end)
                if found < 0:
                    raise DataFormatError(f"assistant message {i}: its content is not rendered after its header")
                end = found + len(anchor)
            marker = text.find(self.end_of_turn, end)
            if marker < 0:
                raise DataFormatError(f"assistant message {i}: no end-of-turn {self.end_of_turn!r} after it")
            cursor = marker + len(self.end_of_turn)
            spans.append((start, cursor))
        return spans


def _assistant_anchors(message) -> List[str]:
    """Texts every template renders verbatim (up to surrounding whitespace) for an assistant message, in order."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise DataFormatError("assistant content must be a string (or null with tool_calls)")
    if "reasoning_content" not in message and "</think>" in content:
        content = content.split("</think>")[-1]  # the answer; the reasoning may be dropped by the template
    names = [(call.get("function") or call).get("name") for call in message.get("tool_calls") or []]
    anchors = [anchor for anchor in (content.strip(), *names) if anchor]
    if not anchors:
        raise DataFormatError("assistant message has neither content nor tool calls: nothing to train on")
    return anchors


@CHAT_TEMPLATE_REGISTRY.register("chatml")
class ChatmlTemplate(TokenizerTemplate):
    """`<|im_start|>role\\ncontent<|im_end|>\\n`; an assistant turn trains on its content and `<|im_end|>`."""

    jinja = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    renders_tools = False

    def __init__(self, tokenizer, **options):
        hint = "use data.chat_template auto for the tokenizer's own template, or another tokenizer"
        require_tokens(tokenizer, ("<|im_start|>", "<|im_end|>"), "chatml", hint)
        super().__init__(tokenizer, **options)

    def _turn_markers(self) -> Tuple[str, str]:
        return "<|im_start|>assistant\n", "<|im_end|>"


@CHAT_TEMPLATE_REGISTRY.register("default")
class DefaultTemplate(TokenizerTemplate):
    """Plain-text roles, for any tokenizer: `Role:\\ncontent` blocks; assistant content ends with EOS."""

    jinja = (
        "{% for message in messages %}{{ message['role'] | capitalize + ':\\n' + message['content'] }}"
        "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant:\\n' }}{% endif %}"
    )
    renders_tools = False

    def __init__(self, tokenizer, **options):
        if not tokenizer.eos_token:  # replies would end nowhere: the model never learns to stop
            raise ChatTemplateError(
                "chat template 'default' ends each assistant reply with the tokenizer's eos_token, and the tokenizer "
                "has none: set eos_token in its tokenizer_config.json, or use a template of its own"
            )
        super().__init__(tokenizer, **options)

    def _turn_markers(self) -> Tuple[str, str]:
        return "Assistant:\n", self.tokenizer.eos_token


def build_chat_template(
    name: str, tokenizer, last_turn_only: bool = False, think_loss: str = "train", **kwargs
) -> ChatTemplate:
    """A template by name: `auto` (the tokenizer's own if it has one, else `default`), `tokenizer`, `chatml`,
    `default`, one added with `@CHAT_TEMPLATE_REGISTRY.register(name)`, or a custom jinja template (the text itself
    or a `.jinja` file: it becomes the tokenizer's chat_template and is used as `tokenizer`). `last_turn_only`
    and `think_loss` (see the module doc) apply to every built-in template; other keywords go to the constructor."""
    if "{%" in name or "{{" in name:
        tokenizer.chat_template, name = name, "tokenizer"
    elif name.endswith((".jinja", ".j2")):
        if not os.path.isfile(name):
            raise ChatTemplateError(f"data.chat_template: {name} does not exist")
        tokenizer.chat_template, name = Path(name).read_text(encoding="utf-8"), "tokenizer"
    if name == "auto":
        name = "tokenizer" if getattr(tokenizer, "chat_template", None) else "default"
    cls = CHAT_TEMPLATE_REGISTRY.get(name)
    options = {"last_turn_only": True} if last_turn_only else {}
    if think_loss != "train":
        options["think_loss"] = think_loss
    if options and not getattr(cls, "supports_label_options", False):
        raise ChatTemplateError(
            f"chat template {name!r} does not implement {sorted(options)} (set supports_label_options and take them "
            "in its constructor, or use a built-in template)"
        )
    return cls(tokenizer, **options, **kwargs)


def training_template_note(template: ChatTemplate, requested: str, own: Optional[str]) -> Tuple[str, Optional[str]]:
    """(an info line saying which template trains, a warning or None): the warning when the model would be served
    with another template than it was trained on -- the tokenizer's own (`own`, which the HF export carries)."""
    jinja = template.get_jinja_template() or None
    if type(template) is TokenizerTemplate:
        which = "the tokenizer's own" if jinja == own else "a custom jinja template"
    else:
        which = repr(requested if requested != "auto" else "default")
    info = f"chat template: {which} ({type(template).__name__}"
    if requested == "auto":
        info += ", data.chat_template auto: " + ("the tokenizer ships one" if own else "the tokenizer ships none")
    info += f"; think_loss={template.think_loss}, last_turn_only={template.last_turn_only})"
    if jinja == own:
        return info, None
    exported = "the HF export carries the training template" if jinja else "the HF export cannot carry it (no jinja)"
    if not own:
        return info, f"the tokenizer ships no chat template; training with {which} ({exported})"
    return info, (
        f"training with chat template {which}, not the tokenizer's own chat template: a model served with the "
        f"tokenizer's template sees a format it was not trained on ({exported}). Use data.chat_template auto to "
        "train on the tokenizer's own"
    )


def export_chat_template(folder: str, jinja: Optional[str]) -> None:
    """Write the training template into a saved tokenizer folder (`tokenizer_config.json`'s `chat_template`; a
    separate `chat_template.jinja`, which transformers prefers, is rewritten too)."""
    if not jinja:
        return
    path, separate = Path(folder, "tokenizer_config.json"), Path(folder, "chat_template.jinja")
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if separate.is_file():
        separate.write_text(jinja, encoding="utf-8")
        config.pop("chat_template", None)
    else:
        config["chat_template"] = jinja
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
