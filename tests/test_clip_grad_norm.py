"""The gradient norm is exact to float64 rounding, whatever the tensor's size or spread of magnitudes.

torch's fp32 `vector_norm` on CPU is off by ~3e-5 relative on a 1M-value gradient with a few large rows (like a
tied embedding's); that error differed between FSDP shards and the full tensor and made FSDP2 drift from one process.
"""

import importlib
import math

import pytest
import torch

from veomni.distributed import clip_grad_norm, total_grad_norm

# the module, not the function of the same name that veomni.distributed exports
clip_module = importlib.import_module("veomni.distributed.clip_grad_norm")


def _embedding_like_grads():
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(4096, 256, generator=gen) * torch.rand(4096, 1, generator=gen) ** 8  # a few heavy rows
    small = torch.randn(704, 256, generator=gen) * 1e-3
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in (big, small)]
    for p, g in zip(params, (big, small)):
        p.grad = g
    return params


@pytest.mark.parametrize("chunk", [1 << 22, 1000])  # one float64 pass, or many chunks (as for a huge tensor)
def test_norm_is_exact_in_float64(monkeypatch, chunk):
    monkeypatch.setattr(clip_module, "_CHUNK", chunk)
    params = _embedding_like_grads()
    exact = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    got = total_grad_norm(params).item()
    assert abs(got - exact) <= 1e-12 * exact, (got, exact)
    inf = total_grad_norm(params, float("inf")).item()
    assert inf == max(float(p.grad.abs().max()) for p in params)


def test_clip_scales_every_gradient_to_max_norm():
    params = _embedding_like_grads()
    model = torch.nn.Module()
    model.a, model.b = params
    before = clip_grad_norm(model, max_norm=0.5)
    assert before > 0.5
    after = total_grad_norm(params).item()
    assert abs(after - 0.5) <= 1e-6, after
    assert clip_grad_norm(model, max_norm=0.0) == pytest.approx(after, rel=1e-12)  # 0: measure only, no clipping
