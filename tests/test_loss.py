"""Chunked loss at the output head: same loss and gradients as the plain loss on full logits (fp32, 1e-6), with
at most `chunk_size` tokens of logits alive; tied and untied heads, MoE aux loss, FSDP2."""

import pytest
import torch
import torch.distributed as dist

from helpers import write_model_config, write_moe_config
from veomni.data import MainCollator
from veomni.models import build_foundation_model
from veomni.ops import causal_lm_loss_sum, chunked_lm_head_loss

LENGTHS = (17, 40, 5, 63)


def _batch():
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]
    batch = MainCollator()([{"input_ids": d, "labels": list(d)} for d in docs])
    return batch, batch.pop("labels")


def _plain(model, batch, labels):
    loss, tokens = causal_lm_loss_sum(model(**batch).logits, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), tokens, grads


def _chunked(model, batch, labels, chunk):
    with chunked_lm_head_loss(model, labels, chunk) as head_loss:
        out = model(**batch)
    assert out.logits.dim() == 0  # the summed loss comes back in place of the logits
    out.logits.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.logits.detach(), head_loss["tokens"], grads


def _assert_same(a, b):
    (loss_a, tok_a, grads_a), (loss_b, tok_b, grads_b) = a, b
    assert tok_a.item() == tok_b.item() == sum(n - 1 for n in LENGTHS)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        # 1e-6 of the gradient's scale: chunks sum the head's gradient in a different order
        scale = grads_b[name].abs().max().item()
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-6, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_plain_loss_and_grads(tmp_path, tied):
    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path), tie_word_embeddings=tied), torch_dtype="float32")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    batch, labels = _batch()
    plain = _plain(model, batch, labels)
    for chunk in (7, 64, 4096):  # ragged last chunk, several chunks, one chunk
        _assert_same(_chunked(model, batch, labels, chunk), plain)


def test_only_one_chunk_of_logits_exists(tmp_path):
    """The head never sees more than chunk_size tokens (forward or recompute), and nothing vocab-sized of the full
    row is kept for backward."""
    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32")
    batch, labels = _batch()
    vocab, total = model.config.vocab_size, sum(LENGTHS)
    rows = []
    model.lm_head.register_forward_hook(lambda mod, args, out: rows.append(out.numel() // vocab))
    saved = []

    def pack(t):
        saved.append(t.numel() if t.shape and t.shape[-1] == vocab else 0)
        return t

    for chunk in (16, 0):
        rows.clear(), saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with chunked_lm_head_loss(model, labels, chunk) as head_loss:
                out = model(**batch)
            loss = out.logits if head_loss is not None else causal_lm_loss_sum(out.logits, labels)[0]
        loss.backward()
        if chunk:
            chunk_calls = [r for r in rows if r]  # the outer call returns the 0-dim loss
            assert max(rows) == chunk and len(chunk_calls) == 2 * -(-total // chunk)  # forward + recompute
            assert max(saved) <= chunk * vocab
        else:
            assert rows == [total] and max(saved) >= (total - 1) * vocab  # plain: the full logits are kept
        model.zero_grad()


def test_moe_aux_loss_still_flows_with_the_chunked_loss(tmp_path):
    torch.manual_seed(0)
    model = build_foundation_model(write_moe_config(str(tmp_path)), torch_dtype="float32")
    batch, labels = _batch()
    coef = model.config.router_aux_loss_coef

    def total_loss(chunk):
        with chunked_lm_head_loss(model, labels, chunk) as head_loss:
            out = model(**batch)
        if head_loss is not None:
            loss, tokens = out.logits, head_loss["tokens"]
        else:
            loss, tokens = causal_lm_loss_sum(out.logits, labels)
        assert out.aux_loss is not None
        loss = loss + coef * out.aux_loss * tokens
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return loss.detach(), grads

    (a, ga), (b, gb) = total_loss(0), total_loss(32)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert "model.layers.0.mlp.gate.weight" in ga
    for name in ga:
        scale = ga[name].abs().max().item()
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-6, atol=1e-6 * scale, msg=name)


def test_chunked_loss_under_fsdp2_matches_plain(tmp_path, monkeypatch):
    """The head runs inside the FSDP root's forward and its recompute in backward: grads equal the plain loss."""
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        raise AssertionError("a process group leaked from an earlier test")
    # restored after the test: a MASTER_PORT left in the pytest process would reach every later child launch
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for tied in (False, True):
            torch.manual_seed(0)
            config = write_model_config(str(tmp_path / str(tied)), tie_word_embeddings=tied)
            model = build_foundation_model(config, torch_dtype="float32")
            for layer in model.model.layers:  # as the trainer shards: the root reshards after forward too
                fully_shard(layer, reshard_after_forward=True)
            fully_shard(model, reshard_after_forward=True)
            batch, labels = _batch()
            plain = _plain(model, batch, labels)
            chunked = _chunked(model, batch, labels, 16)
            _assert_same(
                (chunked[0], chunked[1], {k: v.full_tensor() for k, v in chunked[2].items()}),
                (plain[0], plain[1], {k: v.full_tensor() for k, v in plain[2].items()}),
            )
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
