"""Chat templates and SFT encoding: token-identical to apply_chat_template; loss on assistant tokens only."""

import pytest

from helpers import write_tokenizer
from veomni.data.chat_template import CHAT_TEMPLATE_REGISTRY, ChatTemplate, build_chat_template
from veomni.data.data_transform import IGNORE_INDEX, DataFormatError, process_sft_example
from veomni.models import build_tokenizer

CHATML_JINJA = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "the quick brown fox?"}, {"role": "assistant", "content": "jumps over the lazy dog"}],
    [
        {"role": "system", "content": "to be brief"},
        {"role": "user", "content": "to be or not"},
        {"role": "assistant", "content": "that is the question"},
        {"role": "user", "content": "the fox"},
        {"role": "assistant", "content": "quick, brown.\n\nover"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = build_tokenizer(write_tokenizer(str(tmp_path_factory.mktemp("tok"))))
    tok.chat_template = CHATML_JINJA
    return tok


def _assistant_text(tokenizer, enc):
    return tokenizer.decode([t for t, lab in zip(enc["input_ids"], enc["labels"]) if lab != IGNORE_INDEX])


@pytest.mark.parametrize("name", ["tokenizer", "chatml", "default"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_ids_equal_apply_chat_template_and_labels_cover_assistant_only(tokenizer, name, conversation):
    template = build_chat_template(name, tokenizer)
    enc = template.encode_messages(conversation)
    tokenizer_with_jinja = tokenizer
    saved = tokenizer.chat_template
    tokenizer_with_jinja.chat_template = template.get_jinja_template()
    try:
        expected = tokenizer.apply_chat_template(conversation, tokenize=True)["input_ids"]
    finally:
        tokenizer.chat_template = saved
    assert enc["input_ids"] == expected
    assert len(enc["labels"]) == len(enc["input_ids"])
    replies = [m["content"] for m in conversation if m["role"] == "assistant"]
    trained = _assistant_text(tokenizer, enc)
    end = "<|im_end|>" if name != "default" else tokenizer.eos_token
    assert trained == "".join(r + end for r in replies)
    for m in conversation:
        if m["role"] != "assistant":
            assert m["content"] not in trained


def test_process_sft_example_sharegpt_and_errors(tokenizer):
    template = build_chat_template("chatml", tokenizer)
    sharegpt = {"conversations": [{"from": "human", "value": "the fox"}, {"from": "gpt", "value": "the dog"}]}
    [sample] = process_sft_example(sharegpt, chat_template=template, max_seq_len=512)
    assert _assistant_text(tokenizer, sample) == "the dog<|im_end|>"
    with pytest.raises(DataFormatError, match="empty conversation"):
        process_sft_example({"messages": []}, chat_template=template, max_seq_len=512)
    with pytest.raises(DataFormatError, match="no assistant message"):
        process_sft_example({"messages": [{"role": "user", "content": "hi"}]}, chat_template=template, max_seq_len=512)
    with pytest.raises(DataFormatError, match="more than max_seq_len=4"):
        process_sft_example(sharegpt, chat_template=template, max_seq_len=4)
    with pytest.raises(DataFormatError, match="no conversation under"):
        process_sft_example({"text": "x"}, chat_template=template, max_seq_len=512)


def test_custom_template_subclass(tokenizer):
    class Echo(ChatTemplate):
        def encode_messages(self, messages, max_seq_len=8192):
            ids = self.tokenizer.encode(messages[-1]["content"])
            return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids}

        def get_jinja_template(self) -> str:
            return ""

    CHAT_TEMPLATE_REGISTRY.register("echo")(Echo)
    enc = build_chat_template("echo", tokenizer).encode_messages([{"role": "assistant", "content": "the fox"}])
    assert tokenizer.decode(enc["input_ids"]) == "the fox"
    with pytest.raises(KeyError, match="unknown chat template 'nope'"):
        build_chat_template("nope", tokenizer)
