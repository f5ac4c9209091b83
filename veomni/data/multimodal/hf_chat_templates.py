"""The models' own HF (jinja) chat templates, verbatim, for processors built without a model hub.

Sources (the templates shipped beside the released checkpoints):
- QWEN2_VL: `chat_template.json` of Qwen/Qwen2-VL-*-Instruct and Qwen/Qwen2.5-VL-*-Instruct (identical), as
  quoted in public code that pins the "official" template (e.g. `processor.chat_template = official_chat_template`).
- QWEN3_VL: `chat_template.json` of Qwen/Qwen3-VL-*-Instruct (system / user / assistant / tool turns, tools).
- QWEN2_5_OMNI: the Qwen2.5-Omni processor template used in transformers' own test suite
  (tests/models/qwen2_5_omni/test_processing_qwen2_5_omni.py), `<|vision_bos|><|IMAGE|><|vision_eos|>` etc.
`multimodal_chat_template.py` renders these for training; tests/test_multimodal_data.py checks its ids against
`processor.apply_chat_template` with them.

Each template is assembled from the pieces it repeats (Qwen2-VL and Qwen2.5-Omni differ only in their media
branches; Qwen3-VL's user and tool turns share one content loop), and the result is the released text byte for byte.
"""

import string


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
