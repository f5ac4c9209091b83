"""The language-model loss: one label convention, one loss, one token counter.

Labels arrive shifted (`labels[t]` is the target of position t, as torchtitan's loader yields them): MainCollator
shifts every packed row before anything slices it, so a Ulysses shard holds its own targets, and the last token of
each document, whose next token opens another document, has none. `shift_labels` is that shift for HF-style labels
(aligned to `input_ids`). The loss is a token *sum* (fp32), so the trainer can normalise by the global number of loss
tokens; a loss token is simply a label that is not IGNORE_INDEX.

`CausalLMLoss` is the training forward of a causal LM: the model's decoder, then its output head and the loss. With
`chunk_size > 0` the head never materialises the (tokens x vocab) logits: the head's input is captured by a forward
pre-hook and handed on as an empty slice, so the model returns no logits, and the head then runs `chunk_size` tokens
at a time through a head-loss backend. The default backend (`chunked`) is a fused linear + cross-entropy: each
chunk's gradients (softmax - one-hot, through the head) are computed in the forward pass, so backward neither
recomputes the logits nor the softmax (~10% of a step of the demo model; the price is the head's weight gradient held
from forward to backward; no second-order gradients: a create_graph backward raises). A tensor-parallel head (DTensor
weight) checkpoints each chunk and recomputes it instead. Another kernel (a GPU fused linear + cross-entropy) plugs in
as a backend (`register_head_loss_backend`).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from .vocab_parallel_loss import IGNORE_INDEX, vocab_parallel_token_cross_entropy


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF-style labels (aligned to input_ids) -> targets: `targets[..., t] = labels[..., t + 1]`, and the last position
    of each row predicts nothing. Packed rows need their documents' first labels masked first (MainCollator does)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    return targets


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss: shifted labels that are not IGNORE_INDEX."""
    return int((labels != IGNORE_INDEX).sum())


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum of cross-entropy (fp32) of `logits[..., t, :]` against the shifted `labels[..., t]`, and its token count."""
    flat_labels = labels.reshape(-1).to(logits.device)
    tokens = (flat_labels != IGNORE_INDEX).sum()
    if isinstance(logits, DTensor):  # a tensor-parallel head's vocab-sharded logits: reduced without gathering
        return vocab_parallel_token_cross_entropy(logits, flat_labels).sum(), tokens
    flat_logits = logits.reshape(-1, logits.size(-1)).float()
    return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum"), tokens


# --------------------------------------------------------------------------------------- head-loss backends
class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_i CE(hidden_i @ W^T + b, target_i) over rows whose target is not IGNORE_INDEX, chunk by chunk; the
    gradients are computed in forward and only scaled by the incoming (scalar) gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        # only the gradients autograd will ask for (a frozen head or bias costs neither time nor memory)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
            logits = F.linear(h, weight, bias).float()
            valid = t != IGNORE_INDEX
            picked = t.masked_fill(~valid, 0)
            log_z = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, picked[:, None]).squeeze(1)
            total += torch.where(valid, log_z - target_logit, 0.0).sum()
            if not (want_hidden or want_weight or want_bias):
                continue
            grad_logits = logits.sub_(log_z[:, None]).exp_()  # softmax, in place of the logits
            grad_logits[torch.arange(len(t), device=t.device), picked] -= 1.0
            grad_logits = grad_logits.mul_(valid[:, None]).to(weight.dtype)
            if want_hidden:
                grad_hidden[start : start + chunk_size] = grad_logits @ weight
            if want_weight:
                grad_weight += (grad_logits.t() @ h).float()
            if want_bias:
                grad_bias += grad_logits.float().sum(0)
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if torch.is_grad_enabled():  # create_graph: the saved gradients carry no graph, a penalty on them would be 0
            raise RuntimeError(
                "the fused linear + cross-entropy loss has no second-order gradient (create_graph=True): set "
                "model.ops_implementation.loss_chunk_size 0 for the plain loss"
            )
        scale = grad_total.float()
        grads = (None if grad is None else _scaled(grad, scale) for grad in ctx.saved_tensors)  # hidden, weight, bias
        return (*grads, None, None)


def _scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad * scale (0-dim fp32), the product taken in fp32 as the plain loss's backward takes it: a bf16 gradient
    times the scale rounded to bf16 is off by up to 0.4% everywhere (1/300: 0.2% low)."""
    if grad.dtype == torch.float32 or grad.device.type == "cpu":
        return grad * scale  # CPU's kernel multiplies by a 0-dim operand's own fp32 value (and 4x faster than below)
    return _scaled_in_fp32(grad, scale)  # elsewhere (CUDA) the 0-dim operand is first cast to grad's dtype


def _scaled_in_fp32(grad: torch.Tensor, scale: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """A block of rows at a time, so no fp32 copy of a head-sized gradient is made."""
    out = torch.empty_like(grad)
    for start in range(0, grad.shape[0], rows):
        out[start : start + rows] = grad[start : start + rows].float() * scale
    return out


def chunked_backend(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Summed cross-entropy of `head(hidden)` ([N, H] rows, [N] targets), `chunk_size` rows of logits at a time:
    the fused linear + cross-entropy in training, a checkpointed chunk loop for a tensor-parallel head or without
    gradients."""
    if torch.is_grad_enabled() and isinstance(head, nn.Linear) and not isinstance(head.weight, DTensor):
        return _LinearCrossEntropySum.apply(hidden, head.weight, head.bias, targets, chunk_size)
    # (lm_loss_sum: a tensor-parallel head's chunk of logits is vocab-sharded)
    losses = map_chunks(lambda h, t: lm_loss_sum(head(h), t)[0], hidden, targets, chunk_size)
    return sum(losses, hidden.new_zeros((), dtype=torch.float32))


def map_chunks(fn: Callable, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> list:
    """`fn(rows, their targets)` for each `chunk_size` rows of `hidden`; with gradients each call is recomputed in
    backward, so one chunk's logits are alive at a time."""
    pieces = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        pieces.append(checkpoint(fn, h, t, use_reentrant=False) if torch.is_grad_enabled() else fn(h, t))
    return pieces


HeadLossBackend = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]
_HEAD_LOSS_BACKENDS: Dict[str, HeadLossBackend] = {"chunked": chunked_backend}


def register_head_loss_backend(name: str, backend: HeadLossBackend) -> None:
    """Add a head-loss kernel: `backend(head, hidden [N, H], targets [N], chunk_size) -> summed fp32 loss`, called
    with only the rows that have a target, the head's parameters gathered (FSDP) and its module hooks intact."""
    _HEAD_LOSS_BACKENDS[name] = backend


def chunked_head_loss_sum(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    backend: str = "chunked",
    num_loss_tokens: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`lm_loss_sum(head(hidden), labels)` with the logits of at most `chunk_size` tokens alive at once.
    `num_loss_tokens`: the labels' loss tokens when the caller counted them on the host (the trainer, from the
    loader's CPU labels), so nothing here waits for the device."""
    if backend not in _HEAD_LOSS_BACKENDS:
        raise ValueError(f"unknown head-loss backend {backend!r}; registered: {sorted(_HEAD_LOSS_BACKENDS)}")
    targets = labels.to(hidden.device).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    # only positions with a target reach the head: masked ones add exactly 0 to the sum and its gradient, and in SFT
    # (prompts, image tokens) they are most of the row
    # (index_select, not a boolean mask: its backward is an index_add, where a mask's would wait for the GPU again)
    keep = _target_positions(targets, num_loss_tokens)
    flat, targets = flat.index_select(0, keep), targets.index_select(0, keep)
    return _HEAD_LOSS_BACKENDS[backend](head, flat, targets, chunk_size), (targets != IGNORE_INDEX).sum()


def _target_positions(targets: torch.Tensor, count: Optional[int]) -> torch.Tensor:
    """Positions of `targets` that are not IGNORE_INDEX, in order. With their `count` known on the host: a stable
    sort puts them first and the first `count` are kept (fixed shapes: no device sync); the same indices as
    `nonzero`, which otherwise reads the count from the device."""
    if count is None:
        return torch.nonzero(targets != IGNORE_INDEX).squeeze(1)
    ignored = (targets == IGNORE_INDEX).to(torch.uint8)
    return torch.argsort(ignored, stable=True)[:count]


def supports_chunked_loss(model: nn.Module) -> bool:
    """Models whose logits are exactly `get_output_embeddings()(hidden)` (no soft-capping or scaling after it)."""
    config = getattr(model, "config", None)
    for cfg in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: None)()) if c}.values():
        scaled = getattr(cfg, "logits_scaling", 1) not in (None, 1)  # e.g. Granite divides the logits after the head
        if scaled or getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
            return False
    return isinstance(getattr(model, "get_output_embeddings", lambda: None)(), nn.Linear)


# ------------------------------------------------------------------------------------------------ the module
@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # summed token loss (fp32, 0-dim)
    tokens: torch.Tensor  # its loss tokens (0-dim)
    outputs: Any  # the model's own output (router logits, ...); its logits are empty when the head was chunked


class CausalLMLoss(nn.Module):
    """`model` -> (summed loss, loss tokens) of a micro-batch with shifted labels: the training forward.

    `chunk_size <= 0`, or a model whose logits are not its head's plain output (soft-capping, scaling, a LoRA-wrapped
    head): the model's own logits and `lm_loss_sum`. Otherwise the head runs through `backend` on the hidden states
    the head was given, at most `chunk_size` tokens of logits at a time. The head is then called outside the model's
    forward: an FSDP2 root that resharded after its forward is gathered again first (`unshard`; its post-backward
    reshards it), so the head's weight and its gradient are the gathered ones, tied embeddings included.
    """

    def __init__(self, model: nn.Module, chunk_size: int = 0, backend: str = "chunked"):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size if chunk_size > 0 and supports_chunked_loss(model) else 0
        if backend not in _HEAD_LOSS_BACKENDS:
            raise ValueError(f"unknown head-loss backend {backend!r}; registered: {sorted(_HEAD_LOSS_BACKENDS)}")
        self.backend = backend

    def forward(self, labels: torch.Tensor, num_loss_tokens: Optional[int] = None, **inputs) -> LossOutput:
        """`num_loss_tokens`: the loss tokens of `labels` counted on the host, if the caller has them (no sync)."""
        if not self.chunk_size:
            outputs = self.model(**inputs)
            return LossOutput(*lm_loss_sum(outputs.logits, labels), outputs)
        outputs, hidden = forward_to_head_input(self.model, inputs)
        head = self.model.get_output_embeddings()
        loss_sum, tokens = chunked_head_loss_sum(head, hidden, labels, self.chunk_size, self.backend, num_loss_tokens)
        return LossOutput(loss_sum, tokens, outputs)


def forward_to_head_input(model: nn.Module, inputs: Dict[str, Any]) -> Tuple[Any, torch.Tensor]:
    """`model(**inputs)` without its head's logits: (its outputs, the hidden states its head was given), with an FSDP2
    root gathered again for the caller's chunked head. A forward pre-hook keeps the head's input and gives the head an
    empty slice of it, so the model's own forward computes no logits."""
    captured = []

    def hook(module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        captured.append(args[0])
        return (args[0][..., :0, :].detach(), *args[1:])  # (detached: the empty call keeps nothing for backward)

    handle = model.get_output_embeddings().register_forward_pre_hook(hook, prepend=True)
    try:
        outputs = model(**inputs)
    finally:
        handle.remove()
    if isinstance(model, FSDPModule):  # an FSDP2 root: its parameters (the head's) gathered for the chunks
        model.unshard()
    return outputs, captured[0]
