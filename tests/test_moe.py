"""Mixture-of-experts: fused vs eager, parity with transformers, expert parallel, moe_merge / moe_split."""

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from helpers import (
    REPO,
    TINY_QWEN3_MOE,
    child_env,
    run_python,
    torchrun,
    write_moe_config,
)
from veomni.models import build_foundation_model

QWEN2_MOE = dict(
    TINY_QWEN3_MOE,
    architectures=["Qwen2MoeForCausalLM"],
    model_type="qwen2_moe",
    shared_expert_intermediate_size=48,
    qkv_bias=True,
)


def _hf_checkpoint(folder, config, shard="200KB"):
    """A transformers-saved checkpoint (per-expert keys on disk), several shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    write_moe_config(folder, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def checkpoint(request, tmp_path_factory):
    config = TINY_QWEN3_MOE if request.param == "qwen3_moe" else QWEN2_MOE
    return _hf_checkpoint(str(tmp_path_factory.mktemp(request.param)), config)


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_equals_eager_loss_and_grads(checkpoint):
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    results = []
    for impl in ("eager", "fused"):
        model = build_foundation_model(checkpoint, checkpoint, torch_dtype="float32", moe_implementation=impl)
        assert model.config._experts_implementation == ("eager" if impl == "eager" else "veomni_fused")
        results.append(_loss_and_grads(model, ids))
    (loss_e, grads_e), (loss_f, grads_f) = results
    assert abs(loss_e - loss_f) <= 1e-5 * loss_e
    assert grads_e.keys() == grads_f.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_f[name], grads_e[name], rtol=1e-5, atol=1e-7, msg=name)


def test_matches_transformers_on_the_same_weights(checkpoint):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, experts_implementation="eager")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        for impl in ("eager", "fused"):
            ours = build_foundation_model(checkpoint, checkpoint, torch_dtype="float32", moe_implementation=impl)
            torch.testing.assert_close(ours(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_expert_parallel_dispatch_is_exact_with_an_empty_expert(tmp_path):
    folder = write_moe_config(str(tmp_path))
    proc = torchrun(os.path.join(REPO, "tests", "dist", "check_expert_parallel.py"), [folder], 2)
    assert proc.stdout.count("EXPERT_PARALLEL_OK") == 2


def _tensors(folder):
    out = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _script(name, *args, cli=False):
    """Run scripts/NAME with ARGS: as its own process when `cli` (the command line users type), else in this process
    (each launch imports torch and transformers again: seconds that the tool's own work does not need)."""
    path = os.path.join(REPO, "scripts", name)
    if cli:
        return run_python([sys.executable, path, *args], env=child_env())
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, sys.argv = sys.argv, [path, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except Exception as error:  # what the process would print as its traceback's last line, and exit 1
        err.write(f"{type(error).__name__}: {error}")
        code = 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("layout", ["fused", "stacked"])
def test_moe_merge_then_split_round_trips_bytes(checkpoint, tmp_path, layout):
    merged, split = str(tmp_path / "merged"), str(tmp_path / "split")
    cli = layout == "fused" and os.path.basename(checkpoint).startswith("qwen3_moe")  # once through the command line
    proc = _script("moe_merge.py", "--raw_hf_path", checkpoint, "--merge_hf_path", merged, "--layout", layout, cli=cli)
    assert proc.returncode == 0, proc.stderr
    assert "merged 2 MoE layers" in proc.stdout
    merged_keys = set(_tensors(merged))
    assert not any(".experts.0." in k for k in merged_keys)
    expected = {"fused": "gate_up_proj", "stacked": "gate_proj"}[layout]
    assert any(k.endswith(f"experts.{expected}") for k in merged_keys)
    proc = _script("moe_split.py", "--merge_hf_path", merged, "--split_hf_path", split, cli=cli)
    assert proc.returncode == 0, proc.stderr
    original, back = _tensors(checkpoint), _tensors(split)
    assert original.keys() == back.keys()
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape, key
        assert back[key].contiguous().view(torch.uint8).equal(tensor.contiguous().view(torch.uint8)), key
    index = json.load(open(os.path.join(merged, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == merged_keys and len(set(index["weight_map"].values())) > 1

    # the merged checkpoint loads into our model and gives the per-expert checkpoint's logits
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = build_foundation_model(checkpoint, checkpoint, torch_dtype="float32")(input_ids=ids).logits
        b = build_foundation_model(merged, merged, torch_dtype="float32")(input_ids=ids).logits
    assert torch.equal(a, b)


def test_merge_refuses_a_dense_checkpoint(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import write_model_config

    folder = write_model_config(str(tmp_path / "dense"))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    proc = _script("moe_merge.py", "--raw_hf_path", folder, "--merge_hf_path", str(tmp_path / "out"))
    assert proc.returncode != 0 and "not an HF per-expert MoE checkpoint" in proc.stderr
    proc = _script("moe_split.py", "--merge_hf_path", folder, "--split_hf_path", str(tmp_path / "out2"))
    assert proc.returncode != 0 and "nothing to split" in proc.stderr


@pytest.mark.parametrize("counts", [[5, 7, 6, 6], [0, 9, 9, 6], [24, 0, 0, 0], [0, 0, 0, 0]])
def test_padded_batched_path_equals_per_expert_loop(counts):
    from veomni.ops.moe import _grouped_mlp, _padded_bmm_mlp

    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    gate_up = torch.randn(4, 2 * 8, 16, generator=g, requires_grad=True)
    down = torch.randn(4, 16, 8, generator=g, requires_grad=True)

    def act(h):
        a, b = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b

    loop = torch.cat(
        [
            torch.nn.functional.linear(act(torch.nn.functional.linear(r, gate_up[e])), down[e])
            for e, r in enumerate(x.split(counts))
        ]
    )
    grads_loop = torch.autograd.grad(loop.pow(2).sum(), (x, gate_up, down))
    padded = _padded_bmm_mlp(x, counts, gate_up, down, act)
    grads_padded = torch.autograd.grad(padded.pow(2).sum(), (x, gate_up, down))
    torch.testing.assert_close(padded, loop, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_padded, grads_loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    grouped = _grouped_mlp(x, counts, gate_up, down, act)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    # whatever the counts (none at all included), the output hangs on x and on every expert's weights, so a
    # rank whose experts got no rows still runs its backward all-to-all and gives its experts a zero gradient
    grads = torch.autograd.grad(grouped.sum(), (x, gate_up, down))
    for grad, ref in zip(grads, grads_loop):
        assert grad.shape == ref.shape
    for e in [e for e, n in enumerate(counts) if n == 0]:
        assert grads[1][e].abs().sum() == 0 and grads[2][e].abs().sum() == 0


def test_grouped_mlp_takes_every_expert_into_the_graph_on_the_unbalanced_path():
    from veomni.ops.moe import _grouped_mlp

    x = torch.randn(10, 16, requires_grad=True)
    gate_up, down = torch.randn(4, 16, 16, requires_grad=True), torch.randn(4, 16, 8, requires_grad=True)
    out = _grouped_mlp(x, [10, 0, 0, 0], gate_up, down, lambda h: h[..., :8] * h[..., 8:])  # per-expert loop
    assert torch.autograd.grad(out.sum(), down)[0][1:].abs().sum() == 0


def test_load_balancing_loss_is_per_document():
    """One document: transformers' loss times its loss tokens. Packed documents: the sum of their own losses,
    so micro-batch grouping (1 process vs several ranks) cannot change it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from veomni.ops import shift_labels
    from veomni.ops.moe import load_balancing_loss_sum

    g = torch.Generator().manual_seed(0)
    lengths, experts, top_k, layers = [7, 12, 5], 8, 2, 3
    logits = [torch.randn(sum(lengths), experts, generator=g) for _ in range(layers)]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.randint(0, 50, (1, sum(lengths)), generator=g)
    labels[0, 2] = -100  # an ignored label counts for nothing
    labels[0, torch.tensor([0, *lengths[:-1]]).cumsum(0)[1:]] = -100  # each document's first label (the collator)
    packed = load_balancing_loss_sum(logits, top_k, shift_labels(labels), position_ids)  # labels as collated
    alone, start = 0.0, 0
    for n in lengths:
        part = [lg[start : start + n] for lg in logits]
        doc_labels = labels[:, start : start + n].clone()
        want = load_balancing_loss_func(tuple(part), experts, top_k) * (doc_labels[0, 1:] != -100).sum()
        got = load_balancing_loss_sum(part, top_k, shift_labels(doc_labels), position_ids[:, start : start + n])
        torch.testing.assert_close(got, want.float())
        alone, start = alone + got, start + n
    torch.testing.assert_close(packed, alone)


def test_load_balancing_loss_over_a_sequence_group_of_one_equals_the_plain_one(one_process_group):
    """The Ulysses path (position ids gathered, statistics all-reduced over the group, the sum split over its ranks)
    on a group of one is the plain per-document loss, value and gradient (2-rank parity: test_ulysses)."""
    import torch.distributed as dist

    from veomni.ops import shift_labels
    from veomni.ops.moe import load_balancing_loss_sum

    g = torch.Generator().manual_seed(0)
    lengths, experts, top_k = [7, 12, 5], 8, 2
    logits = [torch.randn(sum(lengths), experts, generator=g, requires_grad=True) for _ in range(3)]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = shift_labels(torch.randint(0, 50, (1, sum(lengths)), generator=g))
    plain = load_balancing_loss_sum(logits, top_k, labels, position_ids)
    grouped = load_balancing_loss_sum(logits, top_k, labels, position_ids, group=dist.group.WORLD)
    torch.testing.assert_close(grouped, plain)
    want = torch.autograd.grad(plain, logits)
    for got, expected in zip(torch.autograd.grad(grouped, logits), want):
        torch.testing.assert_close(got, expected)
