"""Muon (momentum + Newton-Schulz orthogonalised updates) for 2-D weights and 3-D expert stacks, on any sharding.

One step, per parameter (the math of `torch.optim.Muon`, extended to a batch of matrices):

    buf <- lerp(buf, g, 1 - momentum);  u <- lerp(g, buf, momentum) if nesterov else buf   (elementwise, on shards)
    O   <- NS(u)   for each matrix on its own (a 3-D stack [E, m, n] is E independent matrices, batched)
    p   <- p * (1 - lr * weight_decay) - adjust(lr, m, n) * O

Only NS needs whole matrices. `DistributedMuon` looks at each parameter's layout and takes one of four paths:

    local           plain tensor / replicated DTensor: the matrix is here, no communication
    fsdp_gather_2d  2-D DTensor sharded over one mesh dim (FSDP): rows or columns are spread over that group
    moe_local_3d    3-D DTensor sharded on dim 0 only (whole experts per rank, e.g. muon_expert_zero_comm): no comm
    moe_gather_3d   3-D DTensor sharded inside its matrices (dim > 0, the ep_fsdp dim): as fsdp_gather_2d, per expert

The two gather paths do not make every rank orthogonalise every matrix. The matrices of a group are dealt out to
its ranks (balanced by NS cost); each rank sends its shard of matrix k to k's owner in one all-to-all, owners run
NS on whole matrices (batched by shape), and a second all-to-all returns each rank its shard of the result. Every
rank's payload is padded to the same length, so the all-to-all has equal splits and runs on gloo as on NCCL
(`strategy="all_gather"` instead gathers everything everywhere and computes redundantly: fewer messages, W x the
NS work). Collectives are issued group by group in parameter order, the same on every rank whatever its data.
"""

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat.torch import local_tensor
from ..utils.logging import get_logger
from .multi_optimizer import closure_loss

logger = get_logger(__name__)

PATHS = ("local", "fsdp_gather_2d", "moe_local_3d", "moe_gather_3d")
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def zeropower_via_newtonschulz(
    update: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Approximate orthogonalisation (U S' V^T, S' ~ 1) of a matrix [m, n] or of each matrix of a batch [B, m, n].

    The same iteration as `torch.optim.Muon` (which always runs it in bf16); `dtype` picks the precision.
    """
    a, b, c = coefficients
    x = update.to(dtype)
    batched = x.ndim == 3
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    # spectral norm <= Frobenius norm: scale every matrix to norm <= 1 (2-D: the very reduction torch uses)
    norm = x.norm(dim=(-2, -1), keepdim=True) if batched else x.norm()
    x = x / norm.clamp(min=eps)
    mm = torch.baddbmm if batched else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)
        x = mm(x, poly, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], rows: int, cols: int) -> float:
    """`original` (Keller Jordan): sqrt(max(1, rows/cols)); `match_rms_adamw` (Moonlight): 0.2 * sqrt(max dim)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; choose 'original' or 'match_rms_adamw'")


# ------------------------------------------------------------------------------------------ classification
@dataclass(frozen=True)
class MuonPlan:
    """How one parameter reaches whole matrices: `path`, and for the gather paths the group its matrices are
    split over, along which tensor dim, its size and this rank's index in it."""

    path: str
    group: Optional[object] = None
    dim: int = -1
    size: int = 1
    rank: int = 0


def classify_param(param: torch.Tensor) -> MuonPlan:
    if param.ndim not in (2, 3):
        raise ValueError(f"Muon takes 2-D matrices and 3-D expert stacks, got a {param.ndim}-D parameter")
    if not isinstance(param, DTensor):
        return MuonPlan("local")
    mesh = param.device_mesh
    shards = [(i, pl.dim % param.ndim) for i, pl in enumerate(param.placements) if pl.is_shard() and mesh.size(i) > 1]
    inside = [(i, d) for i, d in shards if d >= param.ndim - 2]  # splits that cut matrices apart
    if not shards:
        return MuonPlan("local")
    if not inside:  # 3-D split on the expert dim only: whole experts on every rank
        return MuonPlan("moe_local_3d")
    if len(inside) > 1:
        raise NotImplementedError(f"Muon: matrices split over several mesh dims ({param.placements}) not supported")
    i, d = inside[0]
    # strided sharding of a matrix dim would need a permutation to reassemble; FSDP never produces it there
    if type(param.placements[i]).__name__ != "Shard":
        raise NotImplementedError(f"Muon: {param.placements[i]} inside a matrix is not supported")
    path = "fsdp_gather_2d" if param.ndim == 2 else "moe_gather_3d"
    return MuonPlan(path, mesh.get_group(i), d, mesh.size(i), mesh.get_local_rank(i))


def shard_sizes(length: int, parts: int) -> List[int]:
    """Sizes of torch.chunk's pieces (what FSDP2 and DTensor's Shard hold), empty ones included."""
    chunk = -(-length // parts)
    return [max(0, min(chunk, length - r * chunk)) for r in range(parts)]


# ------------------------------------------------------------------------------------------ the exchange
@dataclass
class _Matrix:
    """One matrix of a gather path: `shard` is this rank's piece (a view into the update), split on `dim`."""

    shard: torch.Tensor
    shape: Tuple[int, int]
    dim: int  # 0 or 1 within the matrix
    sizes: List[int]  # each rank's length along `dim`
    result: Optional[torch.Tensor] = None

    def numel_of(self, rank: int) -> int:
        return self.sizes[rank] * self.shape[1 - self.dim]

    def shard_shape(self, rank: int) -> Tuple[int, int]:
        return (self.sizes[rank], self.shape[1]) if self.dim == 0 else (self.shape[0], self.sizes[rank])


def _ns_batched(mats: List[torch.Tensor], ns) -> List[torch.Tensor]:
    """NS of many whole matrices, one batched call per distinct shape."""
    out: List[Optional[torch.Tensor]] = [None] * len(mats)
    by_shape = defaultdict(list)
    for k, m in enumerate(mats):
        by_shape[tuple(m.shape)].append(k)
    for ks in by_shape.values():
        results = ns(torch.stack([mats[k] for k in ks])) if len(ks) > 1 else ns(mats[ks[0]]).unsqueeze(0)
        for k, r in zip(ks, results):
            out[k] = r
    return out


def _own_piece(full: torch.Tensor, m: _Matrix, rank: int) -> torch.Tensor:
    return full.narrow(m.dim, sum(m.sizes[:rank]), m.sizes[rank])


def _pack(rows: List[List[torch.Tensor]], width: int, dtype, device) -> torch.Tensor:
    """[len(rows), width] zeros whose row j holds the pieces of `rows[j]`, flattened one after another."""
    out = torch.zeros(len(rows), width, dtype=dtype, device=device)
    for j, pieces in enumerate(rows):
        if pieces:
            flat = torch.cat([p.reshape(-1) for p in pieces])
            out[j, : flat.numel()] = flat
    return out


def _split(row: torch.Tensor, mats: List[_Matrix], rank: int) -> List[torch.Tensor]:
    """The pieces `row` holds one after another: rank `rank`'s shard of each of `mats`, in order."""
    sizes = [m.numel_of(rank) for m in mats]
    return [piece.view(m.shard_shape(rank)) for piece, m in zip(row[: sum(sizes)].split(sizes), mats)]


def _unpack(received: torch.Tensor, mats: List[_Matrix]) -> List[torch.Tensor]:
    """The whole matrices `mats`, each assembled from its pieces: rank r's piece of each, in order, in row r."""
    per_rank = [_split(row, mats, r) for r, row in enumerate(received)]
    return [torch.cat([pieces[k] for pieces in per_rank], dim=m.dim) for k, m in enumerate(mats)]


def _exchange_owner(mats: List[_Matrix], group, size: int, rank: int, ns, dtype) -> None:
    """Deal whole-matrix NS out to the ranks: shards -> owner (all-to-all), NS, results -> shards (all-to-all)."""
    cost = [math.prod(m.shape) * min(m.shape) for m in mats]
    load, owner = [0.0] * size, [0] * len(mats)
    for k in sorted(range(len(mats)), key=lambda k: -cost[k]):
        owner[k] = min(range(size), key=lambda r: load[r])  # deterministic: the same deal on every rank
        load[owner[k]] += cost[k]
    owned = [[k for k in range(len(mats)) if owner[k] == j] for j in range(size)]
    # the longest payload any rank sends to any rank: everyone pads to it (equal splits work on gloo)
    width = max(sum(mats[k].numel_of(r) for k in owned[j]) for j in range(size) for r in range(size))
    send = _pack([[mats[k].shard for k in owned[j]] for j in range(size)], width, dtype, mats[0].shard.device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[r] holds rank r's shards of the matrices this rank owns, in order
    mine = [mats[k] for k in owned[rank]]
    results = _ns_batched(_unpack(recv, mine), ns)
    back = _pack(
        [[_own_piece(res, m, r) for m, res in zip(mine, results)] for r in range(size)], width, dtype, send.device
    )
    recv_back = torch.empty_like(back)
    dist.all_to_all_single(recv_back, back, group=group)
    for j in range(size):  # recv_back[j]: my shards of the matrices rank j owns
        for k, result in zip(owned[j], _split(recv_back[j], [mats[k] for k in owned[j]], rank)):
            mats[k].result = result


def _exchange_all_gather(mats: List[_Matrix], group, size: int, rank: int, ns, dtype) -> None:
    """Every rank gathers every matrix whole (one all-gather) and orthogonalises all of them."""
    width = max(sum(m.numel_of(r) for m in mats) for r in range(size))
    send = _pack([[m.shard for m in mats]], width, dtype, mats[0].shard.device)[0]
    recv = torch.empty(size * width, dtype=dtype, device=send.device)  # flat: gloo wants chunks shaped like `send`
    dist.all_gather_into_tensor(recv, send, group=group)
    for m, res in zip(mats, _ns_batched(_unpack(recv.view(size, width), mats), ns)):
        m.result = _own_piece(res, m, rank)


_EXCHANGES = {"owner": _exchange_owner, "all_gather": _exchange_all_gather}


# ------------------------------------------------------------------------------------------ the optimizer
class DistributedMuon(torch.optim.Optimizer):
    """Muon over plain tensors and DTensors (FSDP2, expert parallel): see the module docstring for the paths.

    `ns_dtype`: precision of Newton-Schulz and of its communication; None picks bf16 on an accelerator (as
    torch.optim.Muon, tensor-core speed) and the update's own dtype (fp32) on CPU, where bf16 buys no speed.
    `strategy`: "owner" (each matrix orthogonalised once, by one rank) or "all_gather" (by every rank).
    `bucket_numel`: cap on the whole-matrix elements exchanged per round (bounds the communication buffers).
    State: one `momentum_buffer` per parameter, laid out like the parameter (DCP reshards it like the weights).
    """

    def __init__(
        self,
        params,
        lr: float = 2e-2,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = "match_rms_adamw",
        ns_dtype: Optional[torch.dtype] = None,
        strategy: str = "owner",
        bucket_numel: int = 2**26,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon needs lr, momentum, weight_decay >= 0; got {lr}, {momentum}, {weight_decay}")
        if len(ns_coefficients) != 3:
            raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients}")
        if not 0 < ns_steps < 100:
            raise ValueError(f"ns_steps must be in 1..99, got {ns_steps}")
        adjusted_lr(1.0, adjust_lr_fn, 1, 1)  # validate the name
        if strategy not in _EXCHANGES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(_EXCHANGES)}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        self.ns_dtype, self.strategy, self.bucket_numel = ns_dtype, strategy, bucket_numel
        self._plans: Dict[torch.Tensor, MuonPlan] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:  # the layout is fixed once sharded: classify once
            self._plans[p] = classify_param(p)

    def path_of(self, param: torch.Tensor) -> str:
        return self._plans[param].path

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group) -> None:
        momentum, nesterov = group["momentum"], group["nesterov"]
        params, updates = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = local_tensor(p.grad), local_tensor(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            params.append(p)
            updates.append(grad.lerp(buf, momentum) if nesterov else buf)
        if not params:
            return
        dtype = self.ns_dtype
        if dtype is None:  # see the class docstring
            dtype = updates[0].dtype if updates[0].device.type == "cpu" else torch.bfloat16

        def ns(x):
            return zeropower_via_newtonschulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)

        ortho = self._orthogonalize(params, updates, ns, dtype)
        lr, decay = group["lr"], group["weight_decay"]
        for p, o in zip(params, ortho):
            local = local_tensor(p)
            if decay:
                local.mul_(1 - lr * decay)
            if o is not None:
                rows, cols = p.shape[-2:]
                local.add_(o.to(local.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))

    def _orthogonalize(self, params, updates, ns, dtype) -> List[Optional[torch.Tensor]]:
        ortho: List[Optional[torch.Tensor]] = [None] * len(params)
        by_group: Dict[tuple, List[Tuple[int, _Matrix]]] = {}  # insertion order = parameter order
        for i, (p, u) in enumerate(zip(params, updates)):
            plan = self._plans[p]
            if plan.path in ("local", "moe_local_3d"):
                ortho[i] = ns(u) if u.numel() else u  # a rank may hold no experts at all
                continue
            key = (plan.size, tuple(dist.get_process_group_ranks(plan.group)))
            entry = by_group.setdefault(key, (plan, []))
            # a 3-D stack is a batch of matrices split on the same dim; gathered and returned one by one
            matrix_dim = plan.dim - (p.ndim - 2)
            sizes = shard_sizes(p.shape[plan.dim], plan.size)
            shape = tuple(p.shape[-2:])
            if u.shape[plan.dim] != sizes[plan.rank]:
                raise RuntimeError(f"Muon: local shard {tuple(u.shape)} is not torch.chunk's piece of {p.shape}")
            u = u.to(dtype)
            stack = u if p.ndim == 3 else u.unsqueeze(0)
            for e in range(stack.shape[0]):
                entry[1].append((i, _Matrix(stack[e], shape, matrix_dim, sizes)))
        for plan, items in by_group.values():
            exchange = _EXCHANGES[self.strategy]
            start = 0
            while start < len(items):  # rounds of at most bucket_numel whole-matrix elements (at least one)
                end, total = start, 0
                while end < len(items) and (
                    end == start or total + math.prod(items[end][1].shape) <= self.bucket_numel
                ):
                    total += math.prod(items[end][1].shape)
                    end += 1
                exchange([m for _, m in items[start:end]], plan.group, plan.size, plan.rank, ns, dtype)
                start = end
            pieces = defaultdict(list)
            for i, m in items:
                pieces[i].append(m.result)
            for i, results in pieces.items():
                ortho[i] = torch.stack(results) if params[i].ndim == 3 else results[0]
        return ortho


Muon = DistributedMuon
