"""Optimizers and schedules."""

import math

import pytest
import torch
from torch import nn

from veomni.optim import AnyPrecisionAdamW, build_lr_scheduler, build_optimizer


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 1, bias=False)

    def forward(self, x):
        return self.out(self.norm(self.proj(x)))


def _train(opt_builder, steps=5):
    torch.manual_seed(0)
    model = Tiny()
    opt = opt_builder(model)
    x = torch.randn(16, 8)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def test_no_weight_decay_on_biases_and_norms():
    opt = build_optimizer(Tiny(), lr=0.1, weight_decay=0.5)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {2}
    assert len(no_decay["params"]) == 3  # proj.bias, norm.weight, norm.bias


def test_anyprecision_adamw_equals_torch_adamw_in_fp32():
    ref = _train(lambda m: build_optimizer(m, lr=1e-2, weight_decay=0.1, optimizer_type="adamw"))
    got = _train(lambda m: build_optimizer(m, lr=1e-2, weight_decay=0.1, optimizer_type="anyprecision_adamw"))
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_anyprecision_kahan_keeps_bf16_updates():
    """Tiny updates vanish in plain bf16 params; Kahan summation keeps them."""

    def run(kahan):
        p = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        opt = AnyPrecisionAdamW([p], lr=1e-4, use_kahan_summation=kahan)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.float().mean().item()

    expected = 1 - 50 * 1e-4  # 0.995; bf16 spacing just below 1 is 2**-8 / 2
    assert run(False) == 1.0  # each 1e-4 step rounds away
    assert abs(run(True) - expected) <= 2**-9  # nearest bf16 neighbour of the exact result


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="unknown optimizer type 'sgd'"):
        build_optimizer(Tiny(), optimizer_type="sgd")


def _lrs(**kw):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=kw["lr"])
    sched = build_lr_scheduler(opt, **kw)
    out = []
    for _ in range(kw["train_steps"]):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_schedules():
    const = _lrs(train_steps=10, lr=1.0, lr_warmup_ratio=0.2)
    assert const == [0.5, 1.0] + [1.0] * 8
    lin = _lrs(train_steps=10, lr=1.0, lr_min=0.0, lr_decay_style="linear")
    assert lin[0] == 1.0 and lin[5] == pytest.approx(0.5) and lin[-1] == pytest.approx(0.1)
    cos = _lrs(train_steps=11, lr=1.0, lr_min=0.1, lr_decay_style="cosine", lr_warmup_ratio=1 / 11)
    assert cos[0] == 1.0 and cos[1] == 1.0
    assert cos[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert min(cos) >= 0.1 and all(a >= b for a, b in zip(cos[1:], cos[2:]))
    with pytest.raises(ValueError, match="lr_decay_style 'step'"):
        _lrs(train_steps=4, lr=1.0, lr_decay_style="step")
