"""Chunked loss at the output head (CausalLMLoss): same loss and gradients as the plain loss on full logits (fp32,
1e-6), with at most `chunk_size` tokens of logits alive; tied and untied heads, MoE aux loss, FSDP2."""

import pytest
import torch
import torch.distributed as dist

from helpers import write_model_config, write_moe_config
from veomni.data import MainCollator
from veomni.models import build_foundation_model
from veomni.ops import CausalLMLoss, lm_loss_sum, shift_labels

LENGTHS = (17, 40, 5, 63)
GRAD_ACCUMULATION = 3.0


def _batch():
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]
    batch = MainCollator()([{"input_ids": d, "labels": list(d)} for d in docs])
    batch.pop("shift_labels")
    return batch, batch.pop("labels")


def _plain(model, batch, labels):
    loss, tokens = lm_loss_sum(model(**batch).logits, labels)
    (loss / GRAD_ACCUMULATION).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), tokens, grads


def _chunked(model, batch, labels, chunk):
    out = CausalLMLoss(model, chunk)(labels, **batch)
    assert out.outputs.logits.numel() == 0  # the model's own forward computed no logits
    (out.loss_sum / GRAD_ACCUMULATION).backward()  # the trainer's normalisation reaches the loss's backward
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.loss_sum.detach(), out.tokens, grads


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


def test_only_one_chunk_of_logits_exists(tmp_path, monkeypatch):
    """Logits are computed for at most chunk_size tokens at a time, once per chunk (training computes each
    chunk's gradient in forward: nothing is recomputed), and nothing vocab-sized of the full row is kept for
    backward."""
    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32")
    batch, labels = _batch()
    vocab, total = model.config.vocab_size, sum(LENGTHS)
    assert model.config.hidden_size != vocab  # so that only logits have a vocab-sized last dimension
    rows = []
    linear = torch.nn.functional.linear

    def counting_linear(*args, **kwargs):
        out = linear(*args, **kwargs)
        if out.shape[-1] == vocab and out.numel():  # (the model's own call of the head is given no rows)
            rows.append(out.numel() // vocab)
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", counting_linear)
    saved = []

    def pack(t):
        saved.append(t.numel() if t.shape and t.shape[-1] == vocab else 0)
        return t

    for chunk in (16, 0):
        rows.clear(), saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = CausalLMLoss(model, chunk)(labels, **batch).loss_sum
        loss.backward()
        if chunk:
            loss_tokens = total - len(LENGTHS)  # only positions with a target reach the head
            assert max(rows) == chunk and len(rows) == -(-loss_tokens // chunk)  # once per chunk, no recompute
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
        result = CausalLMLoss(model, chunk)(labels, **batch)
        loss, tokens, out = result.loss_sum, result.tokens, result.outputs
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
    """The head runs after the FSDP root's forward, which resharded the root: the root is gathered again before the
    chunks (and resharded by its post-backward), so grads equal the plain loss, tied head included."""
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


def test_fused_head_loss_with_bias_and_ignored_targets():
    """A biased head, ignored labels mid-row, ragged chunks: loss and all three gradients as autograd gives them."""
    from veomni.ops import chunked_head_loss_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(24, 97, bias=True)
    hidden = torch.randn(2, 30, 24, requires_grad=True)
    labels = torch.randint(0, 97, (2, 30))
    labels[0, 5:12] = -100
    labels = shift_labels(labels)
    reference = lm_loss_sum(head(hidden), labels)[0]
    expected = torch.autograd.grad(reference / 3, (hidden, head.weight, head.bias))
    loss, tokens = chunked_head_loss_sum(head, hidden, labels, chunk_size=11)
    got = torch.autograd.grad(loss / 3, (hidden, head.weight, head.bias))
    assert tokens.item() == 2 * 29 - 7
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_head_loss_bf16_gradients_are_not_scaled_off():
    """bf16 head and hidden states: the gradients equal fp64 autograd on the same (bf16) values up to bf16 noise, with
    no systematic scale. The incoming gradient (1 / loss tokens) used to be rounded to bf16 first: every gradient
    came out up to 0.4% off (+0.21% for 1/3, -0.27% for 1/1021), where the plain loss scales in fp32."""
    from veomni.ops import chunked_head_loss_sum

    torch.manual_seed(0)
    weight, hidden = (torch.randn(500, 64) * 0.05).bfloat16(), torch.randn(4, 256, 64).bfloat16()
    labels = shift_labels(torch.randint(0, 500, (4, 256)))

    def grads(dtype, norm, loss_fn):
        head = torch.nn.Linear(64, 500, bias=False).to(dtype)
        head.weight.data.copy_(weight)
        h = hidden.to(dtype).requires_grad_()
        return torch.autograd.grad(loss_fn(head, h) / norm, (h, head.weight))

    for norm in (3.0, 1021.0):
        expected = grads(torch.float64, norm, lambda head, h: lm_loss_sum(head(h), labels)[0])
        got = grads(torch.bfloat16, norm, lambda head, h: chunked_head_loss_sum(head, h, labels, 128)[0])
        for g, e in zip(got, expected):
            bias = ((g.double() * e).sum() / (e * e).sum() - 1).item()  # least-squares scale of g against e, minus 1
            assert abs(bias) < 7e-4, (norm, bias)
            assert ((g.double() - e).norm() / e.norm()).item() < 5e-3  # bf16 noise

    # the fp32 product off the CPU (where a 0-dim fp32 operand would be cast to bf16 first), run here on the CPU
    from veomni.ops.loss import _scaled_in_fp32

    scale = torch.tensor(1 / 300.0)
    g = torch.randn(1000, 8).bfloat16()
    assert torch.equal(_scaled_in_fp32(g, scale, rows=333), (g.float() * scale).bfloat16())
    assert torch.equal(_scaled_in_fp32(g, scale), g * scale)  # what CPU's kernel gives (the path taken above)


def test_fused_head_loss_with_a_frozen_head_keeps_no_weight_gradient():
    """A frozen head (or frozen hidden states): the other gradient is as autograd gives it, and no head-sized
    gradient is computed or kept for backward."""
    from veomni.ops import chunked_head_loss_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(24, 97, bias=False)
    head.weight.requires_grad_(False)
    hidden = torch.randn(2, 30, 24, requires_grad=True)
    labels = shift_labels(torch.randint(0, 97, (2, 30)))
    expected = torch.autograd.grad(lm_loss_sum(head(hidden), labels)[0], hidden)[0]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss, _ = chunked_head_loss_sum(head, hidden, labels, chunk_size=11)
    assert (97, 24) not in saved and saved  # the hidden gradient only
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0], expected, rtol=1e-6, atol=1e-7)

    head.weight.requires_grad_(True)
    frozen_hidden = hidden.detach()
    expected = torch.autograd.grad(lm_loss_sum(head(frozen_hidden), labels)[0], head.weight)[0]
    loss, _ = chunked_head_loss_sum(head, frozen_hidden, labels, chunk_size=11)
    got = torch.autograd.grad(loss, head.weight)[0]  # summed over chunks: 1e-6 of the gradient's scale
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_fused_head_loss_refuses_a_second_order_gradient():
    """Its gradients are computed in forward and carry no graph: a gradient penalty (create_graph) must raise, not
    get a silent constant (set loss_chunk_size 0 for the plain loss, which has second-order gradients)."""
    from veomni.ops.loss import chunked_head_loss_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11).double()
    hidden = torch.randn(1, 7, 8, dtype=torch.float64, requires_grad=True)
    loss, _ = chunked_head_loss_sum(head, hidden, torch.randint(0, 11, (1, 7)), 3)
    with pytest.raises(RuntimeError, match="no second-order gradient.*loss_chunk_size 0"):
        torch.autograd.grad(loss, hidden, create_graph=True)
    (grad,) = torch.autograd.grad(loss, hidden)  # first order, as training takes it
    assert grad.abs().sum() > 0


def test_a_registered_head_loss_backend_runs_in_the_module(tmp_path):
    """Another kernel plugs in as a backend of CausalLMLoss (the contract a GPU fused linear + cross-entropy meets):
    it is handed the head and only the rows that have a target, and its sum is the module's loss."""
    import torch.nn.functional as F

    from veomni.ops import register_head_loss_backend

    calls = []

    def plain(head, hidden, targets, chunk_size):
        calls.append((hidden.shape[0], chunk_size))
        return F.cross_entropy(head(hidden).float(), targets, reduction="sum")

    register_head_loss_backend("test_plain", plain)
    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32")
    batch, labels = _batch()
    expected = _plain(model, batch, labels)
    out = CausalLMLoss(model, 16, backend="test_plain")(labels, **batch)
    assert calls == [(sum(LENGTHS) - len(LENGTHS), 16)]
    torch.testing.assert_close(out.loss_sum, expected[0], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="unknown head-loss backend 'nope'"):
        CausalLMLoss(model, 16, backend="nope")


def test_the_chunk_loop_equals_the_whole_head():
    """The checkpointed chunk loop (`map_chunks`: the head loss without gradients or with a tensor-parallel head, and
    the preference loss's per-token log-probs) covers every row once, ragged last chunk included."""
    from veomni.ops.loss import chunked_backend
    from veomni.ops.preference_loss import _head_logps, token_logps

    torch.manual_seed(0)
    head = torch.nn.Linear(24, 97)
    hidden, targets = torch.randn(30, 24, requires_grad=True), torch.randint(0, 97, (30,))
    torch.testing.assert_close(_head_logps(head, hidden, targets, 7), token_logps(head(hidden), targets))
    with torch.no_grad():
        whole = torch.nn.functional.cross_entropy(head(hidden), targets, reduction="sum")
        torch.testing.assert_close(chunked_backend(head, hidden, targets, 7), whole)
