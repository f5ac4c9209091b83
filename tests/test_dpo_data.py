"""Preference pairs as TRL and LLaMA-Factory write them, through the real Qwen3 tokenizer and its own chat template:
every form gives the same sample, only the final reply carries loss; bad pairs are named by file:line and refused,
or skipped with data.skip_bad_samples."""

import json

import pytest
from real_tokenizers import real_tokenizer_dir
from transformers import AutoTokenizer

from veomni.data.chat_template import build_chat_template
from veomni.data.data_transform import DataFormatError
from veomni.data.preference import process_preference_example, split_pair
from veomni.trainer.preview import marked_spans, render_sample

HISTORY = [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Who are you?")]
CHOSEN, REJECTED = "I am Vicuna.", "Goodbye!"


@pytest.fixture(scope="module")
def transform():
    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_dir("qwen3"))
    template = build_chat_template("auto", tokenizer, last_turn_only=True)

    def apply(record, max_seq_len=512):
        return process_preference_example(record, tokenizer, template, max_seq_len)[0]

    return apply, tokenizer


def _forms():
    openai = [{"role": r, "content": c} for r, c in HISTORY]
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}[r], "value": c} for r, c in HISTORY]
    return [
        {"prompt": openai, "chosen": [{"role": "assistant", "content": CHOSEN}],
         "rejected": [{"role": "assistant", "content": REJECTED}]},
        {"conversations": sharegpt, "chosen": {"from": "gpt", "value": CHOSEN},
         "rejected": {"from": "gpt", "value": REJECTED}},
        {"messages": openai, "chosen": CHOSEN, "rejected": REJECTED},
    ]  # fmt: skip


def test_every_form_gives_the_same_pair_and_scores_only_the_reply(transform):
    apply, tokenizer = transform
    samples = [apply(record) for record in _forms()]
    assert all(s == samples[0] for s in samples)
    chosen, rejected = split_pair(samples[0])
    assert chosen["input_ids"][:5].tolist() == rejected["input_ids"][:5].tolist()  # the same prompt
    for doc, reply in ((chosen, CHOSEN), (rejected, REJECTED)):
        text = render_sample(tokenizer, doc["input_ids"].tolist(), doc["labels"].tolist())
        assert marked_spans(text) == [f"<think>\n\n</think>\n\n{reply}<|im_end|>"]  # the final reply alone
        assert "Hello! How can I help?" in text  # the earlier assistant turn is context, not scored


def test_bad_pairs_are_refused_naming_the_reason(transform):
    apply, _ = transform
    good = _forms()[2]
    with pytest.raises(DataFormatError, match="empty 'chosen' response"):
        apply({"prompt_ids": [1, 2, 3], "chosen_ids": [], "rejected_ids": [4]})
    with pytest.raises(DataFormatError, match="identical"):
        apply(dict(good, rejected=CHOSEN))
    with pytest.raises(DataFormatError, match=r"more than max_seq_len=40 \(chosen and rejected pack"):
        apply(good, max_seq_len=40)
    with pytest.raises(DataFormatError, match="lacks \\['rejected'\\]"):
        apply({"prompt": "x", "chosen": "y"})


@pytest.mark.parametrize("skip", [False, True])
def test_bad_pairs_are_named_by_file_and_line_or_skipped(tmp_path, transform, one_process_group, skip):
    from functools import partial

    from veomni.data import build_dataset

    apply, tokenizer = transform
    good = _forms()[2]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, dict(good, rejected=CHOSEN), good]) + "\n")
    template = build_chat_template("auto", tokenizer, last_turn_only=True)
    dataset = build_dataset(
        train_path=str(path), datasets_type="mapping", skip_bad_samples=skip, cache_dir=str(tmp_path / "cache"),
        transform=partial(process_preference_example, tokenizer=tokenizer, chat_template=template, max_seq_len=512),
    )  # fmt: skip
    if skip:
        assert dataset.prepare().num_samples == 2
    else:
        with pytest.raises(DataFormatError, match=r"pairs.jsonl:2.*identical"):
            dataset.prepare()


def test_token_logps_of_vocab_sharded_logits_equal_the_plain_ones(one_process_group):
    """The per-token log-probs of a tensor-parallel head (vocab-sharded DTensor logits) and their gradient equal
    log_softmax's; the summed loss SFT uses is their negated sum."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from veomni.ops.loss import lm_loss_sum
    from veomni.ops.preference_loss import token_logps

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 32, generator=g)
    targets = torch.tensor([3, -100, 31, 0, 7, -100])
    plain = logits.clone().requires_grad_(True)
    expected = torch.log_softmax(plain, -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1) * (targets >= 0)
    expected.sum().backward()
    sharded = distribute_tensor(logits.clone(), init_device_mesh("cpu", (1,)), [Shard(1)]).requires_grad_(True)
    got = token_logps(sharded, targets)
    got.sum().backward()
    torch.testing.assert_close(got, expected.detach())
    torch.testing.assert_close(sharded.grad.full_tensor(), plain.grad)
    total = lm_loss_sum(sharded.detach(), targets)[0]
    torch.testing.assert_close(total, -expected.detach().sum())
