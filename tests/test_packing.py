"""Packed micro-batches equal the same documents run one by one: loss and gradients, fp32, to 1e-5."""

import torch
from helpers import write_model_config

from veomni.data import MainCollator
from veomni.models import build_foundation_model
from veomni.ops import IGNORE_INDEX, causal_lm_loss_sum, count_loss_tokens


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
        assert batch["labels"][0, s] == IGNORE_INDEX  # nothing predicts across a border
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

    total = 0.0
    for d in docs:
        ids = torch.tensor([d["input_ids"]])
        loss, _ = causal_lm_loss_sum(model(input_ids=ids).logits, ids)
        loss.backward()
        total += loss.item()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    batch = MainCollator()(docs)
    labels = batch.pop("labels")
    loss, n = causal_lm_loss_sum(model(**batch, use_cache=False).logits, labels)
    loss.backward()
    assert n.item() == sum(len(d["input_ids"]) - 1 for d in docs)
    assert abs(loss.item() - total) <= 1e-5 * abs(total)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
