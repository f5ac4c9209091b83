"""Packed micro-batches equal the same documents run one by one: loss and gradients, fp32, to 1e-5."""

import pytest
import torch

from helpers import one_by_one, write_model_config
from veomni.data import MainCollator
from veomni.models import build_foundation_model
from veomni.ops import IGNORE_INDEX, count_loss_tokens, lm_loss_sum, shift_labels


def _docs():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (17, 40, 5, 63)]


def test_collator_packs_with_positions_and_masked_borders():
    docs = [dict(d, labels=list(d["input_ids"]), attention_mask=[1] * len(d["input_ids"])) for d in _docs()]
    batch = MainCollator()(docs)
    lengths = [17, 40, 5, 63]
    assert batch["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in batch
    assert batch["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    assert batch["cu_seq_lens_q"].tolist() == [0, 17, 57, 62, 125] and batch["max_length_q"] == 63
    starts = [0, 17, 57, 62]
    for s in starts[1:]:
        assert batch["labels"][0, s - 1] == IGNORE_INDEX  # nothing predicts across a border
    # labels arrive shifted: each document's own next tokens, its last token predicting nothing
    expected = [t for d in docs for t in d["input_ids"][1:] + [IGNORE_INDEX]]
    assert batch["labels"][0].tolist() == expected
    assert batch["shift_labels"] is batch["labels"]  # transformers' name for them: model(**batch).loss agrees
    assert count_loss_tokens(batch["labels"]) == sum(n - 1 for n in lengths)


def test_pad_to_length_adds_a_lossless_document():
    docs = [dict(d, labels=list(d["input_ids"])) for d in _docs()]
    batch = MainCollator(pad_to_length=True, max_seq_len=160)(docs)
    assert batch["input_ids"].shape == (1, 160)
    assert batch["position_ids"][0, 125:].tolist() == list(range(35))
    assert count_loss_tokens(batch["labels"]) == sum(n - 1 for n in (17, 40, 5, 63))


def test_packed_equals_one_by_one_loss_and_grads(tmp_path):
    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32", attn_implementation="sdpa")
    docs = [dict(d, labels=list(d["input_ids"])) for d in _docs()]

    total, ref_grads = one_by_one(model, docs)

    batch = MainCollator()(docs)
    labels = batch.pop("labels")
    loss, n = lm_loss_sum(model(**batch, use_cache=False).logits, labels)
    loss.backward()
    assert n.item() == sum(len(d["input_ids"]) - 1 for d in docs)
    assert abs(loss.item() - total) <= 1e-5 * abs(total)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_sequence_parallel_slices_reassemble_the_shifted_padded_row():
    docs = [
        dict(d, labels=list(d["input_ids"])) for d in _docs()
    ]  # 125 tokens: padded to 126 for sp=2... and 128 for 4
    full = MainCollator(sp_size=1)(docs)
    for sp in (2, 4):
        parts = [MainCollator(sp_size=sp, sp_rank=r)(docs) for r in range(sp)]
        ids = torch.cat([p["input_ids"] for p in parts], dim=-1)
        labels = torch.cat([p["labels"] for p in parts], dim=-1)
        total = 125 + (-125 % sp)
        assert ids.shape[-1] == total and all(p["input_ids"].shape[-1] == total // sp for p in parts)
        assert torch.equal(ids[0, :125], full["input_ids"][0])
        # labels arrive shifted (position i holds the target of position i), with and without sequence parallel:
        # the slices reassemble the one-process row
        assert torch.equal(labels[0, :125], full["labels"][0])
        assert (labels[0, 124:] == IGNORE_INDEX).all()
        assert parts[0]["cu_seq_lens_q"].tolist()[-1] == total  # attention metadata spans the full row


def test_real_text_packed_batch_equals_documents_one_by_one(tmp_path):
    """Shakespeare documents through the repo-built tokenizer, packed by the real loader, vs one by one."""
    from functools import partial

    from helpers import REPO
    from veomni.data import build_dataloader, build_dataset
    from veomni.data.data_transform import process_pretrain_example
    from veomni.models import build_tokenizer
    from veomni.utils.demo_assets import ensure_demo_assets

    root = ensure_demo_assets(f"{REPO}/.assets", quiet=True)
    tokenizer = build_tokenizer(f"{root}/tokenizer")
    transform = partial(process_pretrain_example, tokenizer=tokenizer, max_seq_len=256)
    dataset = build_dataset(train_path=f"{root}/shakespeare/valid.jsonl", transform=transform)
    loader = build_dataloader(dataset=dataset, micro_batch_size=2, max_seq_len=256, dyn_bsz=True, dp_rank=0, dp_size=1)
    loader.set_epoch(0)
    batch = next(iter(loader))[0]
    starts = torch.nonzero(batch["position_ids"][0] == 0).flatten().tolist() + [batch["input_ids"].shape[-1]]
    assert len(starts) >= 3  # a real multi-document micro-batch

    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path), vocab_size=4096), torch_dtype="float32")
    total = 0.0
    for a, b in zip(starts, starts[1:]):
        ids = batch["input_ids"][:, a:b]
        loss, _ = lm_loss_sum(model(input_ids=ids).logits, shift_labels(ids))
        loss.backward()
        total += loss.item()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    labels = batch.pop("labels")
    loss, _ = lm_loss_sum(model(**batch, use_cache=False).logits, labels)
    loss.backward()
    assert abs(loss.item() - total) <= 1e-5 * total
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["demo", "qwen3", "llama3_1", "gemma3"])
def test_batched_encoding_equals_the_tokenizer_call(family):
    """The cache build's direct backend call (no offsets) gives the ids `tokenizer(texts)` gives; a tokenizer.json
    that turns truncation on takes transformers' call, which turns it off for us."""
    import json

    from real_tokenizers import real_tokenizer_dir

    from helpers import REPO
    from veomni.data.data_transform import encode_many
    from veomni.models import build_tokenizer
    from veomni.utils.demo_assets import ensure_demo_assets

    root = ensure_demo_assets(f"{REPO}/.assets", quiet=True)
    tokenizer = build_tokenizer(f"{root}/tokenizer" if family == "demo" else real_tokenizer_dir(family))
    with open(f"{root}/shakespeare/valid.jsonl") as f:
        texts = [json.loads(line)["text"] for line in f][:40] + ["", " naïve café — 東京 🙂\n\n\tend", "<|endoftext|>"]
    expected = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    assert encode_many(tokenizer, texts) == expected
    tokenizer.backend_tokenizer.enable_truncation(8)
    assert encode_many(tokenizer, texts) == expected
    assert max(map(len, expected)) > 8
