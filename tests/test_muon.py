"""Muon, single process: equal to torch.optim.Muon, expert stacks batched per expert, and what build_optimizer
puts where. (Distributed paths: tests/test_muon_distributed.py.)"""

import pytest
import torch
from torch import nn

from helpers import write_model_config, write_moe_config
from veomni.models import build_foundation_model
from veomni.optim import DistributedMuon, MultiOptimizer, build_lr_scheduler, build_optimizer

SHAPES = [(16, 8), (8, 24), (12, 12)]  # tall, wide, square


def _problem(shapes, seed=0):
    """Least squares per matrix: gradients depend on the weights, so 10 steps compound any difference."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(*s, generator=g) for s in shapes]
    data = [(torch.randn(s[1], 5, generator=g), torch.randn(s[0], 5, generator=g)) for s in shapes]
    return weights, data


def _run(make_opt, shapes=SHAPES, steps=10):
    weights, data = _problem(shapes)
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = make_opt(params)
    for _ in range(steps):
        loss = sum(((p @ a - b) ** 2).sum() for p, (a, b) in zip(params, data))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in params]


SETTINGS = [
    dict(adjust_lr_fn="original", nesterov=True, weight_decay=0.0),
    dict(adjust_lr_fn="match_rms_adamw", nesterov=True, weight_decay=0.1),
    dict(adjust_lr_fn="match_rms_adamw", nesterov=False, weight_decay=0.0),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_equals_torch_muon_fp32(settings, monkeypatch):
    """torch.optim.Muon always runs Newton-Schulz in bf16. Make its `.bfloat16()` a no-op so torch's own code runs
    in fp32, and compare tightly (1e-6 over 10 steps) with ours in fp32."""
    kw = dict(lr=0.02, momentum=0.9, ns_steps=5, eps=1e-7, **settings)
    ours = _run(lambda ps: DistributedMuon(ps, ns_dtype=torch.float32, **kw))
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self: self.clone())
    theirs = _run(lambda ps: torch.optim.Muon(ps, **kw))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours[0], _problem(SHAPES)[0][0])  # it moved


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_equals_unmodified_torch_muon_in_bf16(adjust_lr_fn):
    """With ns_dtype=bf16 ours runs torch's exact arithmetic: equal to unmodified torch.optim.Muon."""
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    ours = _run(lambda ps: DistributedMuon(ps, ns_dtype=torch.bfloat16, **kw))
    theirs = _run(lambda ps: torch.optim.Muon(ps, **kw))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    fp32 = _run(lambda ps: DistributedMuon(ps, ns_dtype=torch.float32, **kw))
    assert max((a - b).abs().max().item() for a, b in zip(fp32, theirs)) > 1e-4  # bf16 NS is really different


def test_expert_stack_is_each_expert_on_its_own(monkeypatch):
    """A 3-D stack [E, m, n] steps exactly like E separate matrices (lr adjusted by the expert's own shape)."""
    experts, shape = 4, (12, 6)
    kw = dict(lr=0.02, adjust_lr_fn="match_rms_adamw", weight_decay=0.05)

    def run_stack(make_opt):
        weights, data = _problem([shape] * experts)
        stack = nn.Parameter(torch.stack(weights))
        opt = make_opt([stack])
        for _ in range(10):
            sum(((stack[e] @ a - b) ** 2).sum() for e, (a, b) in enumerate(data)).backward()
            opt.step()
            opt.zero_grad()
        return list(stack.detach())

    stacked = run_stack(lambda ps: DistributedMuon(ps, ns_dtype=torch.float32, **kw))
    assert DistributedMuon([nn.Parameter(torch.zeros(2, 3, 4))]).path_of  # 3-D accepted
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self: self.clone())
    separate = _run(lambda ps: torch.optim.Muon(ps, **kw), shapes=[shape] * experts)
    for a, b in zip(stacked, separate):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rejects_vectors_and_bad_settings():
    with pytest.raises(ValueError, match="2-D matrices and 3-D"):
        DistributedMuon([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        DistributedMuon([nn.Parameter(torch.zeros(4, 4))], adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="ns_coefficients"):
        DistributedMuon([nn.Parameter(torch.zeros(4, 4))], ns_coefficients=(1.0, 2.0))


def _split(opt):
    muon, adamw = opt.optimizers_dict["muon"], opt.optimizers_dict["adamw"]
    ids = lambda o: {id(p) for g in o.param_groups for p in g["params"]}  # noqa: E731
    return muon, adamw, ids(muon), ids(adamw)


def test_build_optimizer_puts_hidden_matrices_and_experts_in_muon(tmp_path):
    model = build_foundation_model(write_moe_config(str(tmp_path), tie_word_embeddings=False), torch_dtype="float32")
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6, optimizer_type="muon")
    assert isinstance(opt, MultiOptimizer) and list(opt.optimizers_dict) == ["adamw", "muon"]
    muon, adamw, in_muon, in_adamw = _split(opt)
    names = dict(model.named_parameters())
    routers = {n for n in names if n.endswith(".mlp.gate.weight")}  # 2-D [num_experts, hidden], one per layer
    assert len(routers) == 2 and all(names[n].shape == (8, 64) for n in routers)
    for name, p in names.items():
        # MoE routers are classifier heads over the experts: AdamW, like embeddings and lm_head
        hidden = p.ndim >= 2 and "embed" not in name and "lm_head" not in name and name not in routers
        assert (id(p) in in_muon) == hidden and (id(p) in in_adamw) == (not hidden), name
    assert muon.path_of(names["model.layers.0.mlp.experts.gate_up_proj"]) == "local"
    assert names["model.layers.0.mlp.experts.gate_up_proj"].ndim == 3
    # seed defaults for the Muon group; AdamW driven by lr / weight_decay / betas / eps
    g = muon.param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"], g["ns_steps"]) == (2e-2, 0.95, True, 0.0, 5)
    assert (g["ns_coefficients"], g["eps"], g["adjust_lr_fn"]) == ((3.4445, -4.7750, 2.0315), 1e-7, "match_rms_adamw")
    decay, no_decay = adamw.param_groups
    assert decay["lr"] == 1e-3 and decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6
    assert {id(p) for p in decay["params"]} == {
        id(names[n]) for n in ("model.embed_tokens.weight", "lm_head.weight", *routers)
    }  # routers take weight decay like the other AdamW matrices
    dense = build_foundation_model(write_model_config(str(tmp_path / "dense")), torch_dtype="float32")
    in_muon = _split(build_optimizer(dense, optimizer_type="muon"))[2]
    assert id(dict(dense.named_parameters())["model.layers.0.mlp.gate_proj.weight"]) in in_muon  # not a router


def test_muon_keys_reach_the_optimizer_and_schedule_per_group(tmp_path):
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32")
    keys = dict(
        muon_lr=0.05,
        muon_momentum=0.9,
        muon_nesterov=False,
        muon_weight_decay=0.01,
        muon_ns_steps=3,
        muon_ns_coefficients=[3.0, -4.0, 2.0],
        muon_eps=1e-6,
        muon_adjust_lr_fn="original",
        muon_expert_zero_comm=True,
    )
    opt = build_optimizer(model, lr=1e-3, optimizer_type="muon", **keys)
    g = opt.optimizers_dict["muon"].param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"], g["ns_steps"], g["eps"]) == (
        0.05,
        0.9,
        False,
        0.01,
        3,
        1e-6,
    )
    assert g["ns_coefficients"] == (3.0, -4.0, 2.0) and g["adjust_lr_fn"] == "original"
    with pytest.raises(TypeError, match="muon_lrr"):
        build_optimizer(model, optimizer_type="muon", muon_lrr=1.0)

    sched = build_lr_scheduler(opt, train_steps=10, lr=1e-3, lr_min=1e-4, lr_decay_style="linear")
    ids = torch.randint(3, 500, (1, 16))
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    lrs = opt.named_lrs()
    assert lrs["adamw"] == pytest.approx(1e-3 + (1e-4 - 1e-3) * 0.5)
    assert lrs["muon"] == pytest.approx(lrs["adamw"] * 50)  # the same curve from its own base lr

    # after a load_state_dict (which replaces the inner group dicts) the scheduler still drives the live groups
    opt.load_state_dict(opt.state_dict())
    sched.step()
    assert opt.optimizers_dict["muon"].param_groups[0]["lr"] == pytest.approx(50 * (1e-3 + (1e-4 - 1e-3) * 0.6))
