"""liger-kernel's RMSNorm, RoPE and SwiGLU Triton kernels as torch custom ops (`veomni::liger_*`).

liger exposes them as autograd Functions that launch Triton kernels from Python (and write into their inputs'
storage: RoPE rotates q and k in place, SwiGLU's backward overwrites its saved inputs). torch.compile then traces
into the launches: on a GPU inside a compiled layer they failed and fell back (GPU_NOTES), under Triton's
interpreter dynamo cannot trace them at all. As custom ops with fake (shape-only) implementations and registered
backward ops, each is one opaque node to dynamo and AOT autograd: a compiled layer keeps its single graph, layers
share one code, and inductor calls the kernels as they are. Inputs are never written (RoPE and SwiGLU's backward
work on copies; the copies cost a few percent of those kernels' bytes, nothing next to a layer).

The kernels' own entry points (`rms_norm_forward`/`_backward`, `rope_forward`/`_backward`, `swiglu_forward`/
`_backward` of liger_kernel.ops) do the work; only their calling convention changes here.
"""

from typing import Tuple

import torch
from torch import Tensor

_RMS_CASTING = "llama"  # fp32 normalisation, cast back to the input dtype, then times the weight (transformers')


# ------------------------------------------------------------------------------------------------ RMSNorm
@torch.library.custom_op("veomni::liger_rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    from liger_kernel.ops.rms_norm import rms_norm_forward

    y, _, rstd, _, _, _ = rms_norm_forward(x.contiguous(), weight, eps, 0.0, _RMS_CASTING, None)
    return y, rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("veomni::liger_rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> Tuple[Tensor, Tensor]:
    from liger_kernel.ops.rms_norm import _str_to_casting_mode, calculate_settings, rms_norm_backward

    block, warps = calculate_settings(x.shape[-1])
    x2d = x.contiguous().view(-1, x.shape[-1])
    mode = _str_to_casting_mode[_RMS_CASTING]  # the int the forward returns (liger's name, pinned 0.8.5)
    dx, dw = rms_norm_backward(dy.contiguous(), x2d, weight, rstd, 0.0, mode, block, warps, False, None)
    return dx.view(x.shape), dw


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])  # (rstd)


def _rms_norm_grad(ctx, dy, _drstd):
    return (*_rms_norm_backward(dy, *ctx.saved_tensors), None)  # dx, dw; none for eps


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * (x / rms(x)) as transformers' llama-style RMSNorm computes it (fp32 inside)."""
    return _rms_norm(x, weight, eps)[0]


class LigerRMSNorm(torch.nn.Module):
    """An RMSNorm module running the kernel; holds the replaced module's own weight Parameter."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


# ------------------------------------------------------------------------------------------------ RoPE
def _seq_major_copy(t: Tensor) -> Tensor:
    """A copy of [batch, heads, seq, dim] laid out as [batch, seq, heads, dim] (the kernel's layout, which it rotates
    in place): one copy whatever the input's layout, and liger's own transpose + contiguous is then free."""
    return t.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


def _rope_fake(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    return tuple(t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2) for t in (q, k))


@torch.library.custom_op("veomni::liger_rope", mutates_args=())
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    from liger_kernel.ops.rope import rope_forward

    q, k, _, _ = rope_forward(_seq_major_copy(q), _seq_major_copy(k), cos, sin)
    return q, k


@torch.library.custom_op("veomni::liger_rope_backward", mutates_args=())
def _rope_backward(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    from liger_kernel.ops.rope import rope_backward

    dq, dk = rope_backward(_seq_major_copy(dq), _seq_major_copy(dk), cos, sin)
    return dq, dk


_rope.register_fake(_rope_fake)
_rope_backward.register_fake(_rope_fake)


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _rope_grad(ctx, dq, dk):
    return (*_rope_backward(dq, dk, *ctx.saved_tensors), None, None)  # (cos and sin take none)


_rope.register_autograd(_rope_grad, setup_context=_rope_setup)


def rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tuple[Tensor, Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)`: q/k [batch, heads, seq, head_dim], cos/sin [batch or 1,
    seq, head_dim] (M-RoPE models: the sections already merged by their rotary embedding)."""
    if unsqueeze_dim != 1:
        raise ValueError(
            f"the fused RoPE takes [batch, heads, seq, dim] queries (unsqueeze_dim=1), not {unsqueeze_dim}"
        )
    return _rope(q, k, cos, sin)


def rotary_pos_emb_vision(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """The vision towers' `apply_rotary_pos_emb_vision`: q/k [patches, heads, dim], cos/sin [patches, dim]; in fp32,
    the result cast back to q's dtype (as transformers computes it)."""
    q32, k32 = (t.float().unsqueeze(0).transpose(1, 2) for t in (q, k))
    q32, k32 = _rope(q32, k32, cos.float(), sin.float())
    return q32.transpose(1, 2).squeeze(0).to(q.dtype), k32.transpose(1, 2).squeeze(0).to(k.dtype)


# ------------------------------------------------------------------------------------------------ SwiGLU
@torch.library.custom_op("veomni::liger_swiglu", mutates_args=())
def _swiglu(a: Tensor, b: Tensor) -> Tensor:
    from liger_kernel.ops.swiglu import swiglu_forward

    return swiglu_forward(a.contiguous(), b.contiguous())[2]


@torch.library.custom_op("veomni::liger_swiglu_backward", mutates_args=())
def _swiglu_backward(a: Tensor, b: Tensor, dc: Tensor) -> Tuple[Tensor, Tensor]:
    from liger_kernel.ops.swiglu import swiglu_backward

    # the kernel writes da and db over its a and b
    a, b = a.clone(memory_format=torch.contiguous_format), b.clone(memory_format=torch.contiguous_format)
    return swiglu_backward(a, b, dc.contiguous())


@_swiglu.register_fake
def _(a, b):
    return a.new_empty(a.shape)


@_swiglu_backward.register_fake
def _(a, b, dc):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dc):
    return _swiglu_backward(*ctx.saved_tensors, dc)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up in one kernel."""
    return _swiglu(gate, up)


def swiglu_mlp_forward(self, x: Tensor) -> Tensor:
    """A gated MLP's forward with the fused activation (its Linear layers, LoRA-wrapped or not, run as they are)."""
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
