"""Multimodal chat templates: normalised conversations (preprocess.py) -> `input_ids` and `labels`.

A template renders the model's own HF jinja template, then expands the placeholders as the HF processor does: the
placeholder token of each image / video / audio part becomes its replacement, the processor's expanded placeholder
(e.g. `<|image_pad|>` repeated once per merged patch, given by the data transform). The whole text is tokenised once,
so ids equal the HF processor's on the same conversation; labels keep each assistant turn's content and its
`<|im_end|>`, everything else is IGNORE_INDEX. processor_builder.py writes the same jinja into the processors it
builds without a model hub.

The jinja, verbatim, from the templates shipped beside the released checkpoints:
- QWEN2_VL: `chat_template.json` of Qwen/Qwen2-VL-*-Instruct and Qwen/Qwen2.5-VL-*-Instruct (identical), as
  quoted in public code that pins the "official" template (e.g. `processor.chat_template = official_chat_template`).
- QWEN3_VL: `chat_template.json` of Qwen/Qwen3-VL-*-Instruct (system / user / assistant / tool turns, tools).
- QWEN2_5_OMNI: the Qwen2.5-Omni processor template used in transformers' own test suite
  (tests/models/qwen2_5_omni/test_processing_qwen2_5_omni.py), `<|vision_bos|><|IMAGE|><|vision_eos|>` etc.
Each is assembled from the pieces it repeats (Qwen2-VL and Qwen2.5-Omni differ only in their media branches;
Qwen3-VL's user and tool turns share one content loop, its system and assistant turns one text loop), and the
result is the released text byte for byte.
"""

import re
import string
from typing import Dict, List, Optional, Sequence

from ..chat_template import ChatTemplate, TokenizerTemplate, build_chat_template, require_tokens
from ..data_transform import DataFormatError
from ..dataset import Registry


def _media_branch(kind: str, keys: str, id_flag: str, label: str, placeholder: str) -> str:
    """One media branch of a Qwen2-style content loop (`test %}body`): count the item, say its number if asked,
    put its placeholder tokens. `keys`: the content keys that mark the item (besides its `type`)."""
    test = " or ".join([f"content['type'] == '{kind}'"] + [f"'{key}' in content" for key in keys.split()])
    return (
        f"{test} %}}{{% set {kind}_count.value = {kind}_count.value + 1 %}}{{% if {id_flag} %}}{label} "
        f"{{{{ {kind}_count.value }}}}: {{% endif %}}{placeholder}"
    )


def _qwen2_template(*branches: str, counters: str) -> str:
    """A Qwen2-style template (one line, no whitespace control): a default system turn, each turn's text and its
    media placeholders (`branches`, tested in this order; `counters` names the per-kind counters)."""
    return (
        "".join(f"{{% set {kind}_count = namespace(value=0) %}}" for kind in counters.split())
        + "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
        "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
        + "{% elif ".join([*branches, "'text' in content %}{{ content['text'] }}"])
        + "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


_IMAGE = ("image", "image image_url", "add_vision_id", "Picture")
_VIDEO = ("video", "video", "add_vision_id", "Video")

QWEN2_VL = _qwen2_template(
    _media_branch(*_IMAGE, "<|vision_start|><|image_pad|><|vision_end|>"),
    _media_branch(*_VIDEO, "<|vision_start|><|video_pad|><|vision_end|>"),
    counters="image video",
)

QWEN2_5_OMNI = _qwen2_template(
    _media_branch(*_IMAGE, "<|vision_bos|><|IMAGE|><|vision_eos|>"),
    _media_branch("audio", "audio audio_url", "add_audio_id", "Audio", "<|audio_bos|><|AUDIO|><|audio_eos|>"),
    _media_branch(*_VIDEO, "<|vision_bos|><|VIDEO|><|vision_eos|>"),
    counters="audio image video",
)

# Qwen3-VL's template has whitespace control and indentation: its repeated pieces are cut out verbatim.
# The text of a content given as a string or a list of content items (the system message's, said with and without
# tools, and each assistant message's): `$content` names the content, `$item` each of its items.
_QWEN3_TEXT = string.Template("""        {%- if $content is string %}
            {{- $content }}
        {%- else %}
            {%- for $item in $content %}
                {%- if 'text' in $item %}
                    {{- $item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
""")
_QWEN3_SYSTEM_TEXT = _QWEN3_TEXT.substitute(content="messages[0].content", item="content")

# A user or tool message's content: text, and image/video placeholders numbered across the conversation.
_QWEN3_CONTENT = """        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
"""

QWEN3_VL = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
"""
    + _QWEN3_SYSTEM_TEXT
    + """        {{- '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' }}
"""
    + _QWEN3_SYSTEM_TEXT
    + """        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
"""
    + _QWEN3_CONTENT
    + """        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
"""
    + _QWEN3_TEXT.substitute(content="message.content", item="content_item")
    + """        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
"""
    + _QWEN3_CONTENT
    + """        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)


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
    jinja = QWEN2_VL


@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen3_vl")
@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen3_vl_moe")
class Qwen3VLTemplate(Qwen2VLTemplate):
    """Qwen3-VL (dense and MoE): as Qwen2.5-VL without a default system prompt (tool turns are not supported)."""

    jinja = QWEN3_VL


@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen2_5_omni")
@MULTIMODAL_CHAT_TEMPLATE_REGISTRY.register("qwen_omni")
class Qwen2_5OmniTemplate(MultimodalChatTemplate):
    """Qwen2.5-Omni thinker: `<|vision_bos|><|IMAGE|>...<|vision_eos|>`, `<|audio_bos|><|AUDIO|>...<|audio_eos|>`."""

    placeholders = {"image": "<|IMAGE|>", "video": "<|VIDEO|>", "audio": "<|AUDIO|>"}
    jinja = QWEN2_5_OMNI


def build_multimodal_chat_template(name: str, tokenizer, **kwargs) -> ChatTemplate:
    """A multimodal template by name (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen2_5_omni), or a text
    template of `veomni.data.build_chat_template` (for text conversations: the `process_sample_*` transforms take
    a multimodal one only, as they hand it the expanded media placeholders)."""
    if name in MULTIMODAL_CHAT_TEMPLATE_REGISTRY:
        return MULTIMODAL_CHAT_TEMPLATE_REGISTRY.get(name)(tokenizer, **kwargs)
    return build_chat_template(name, tokenizer, **kwargs)
