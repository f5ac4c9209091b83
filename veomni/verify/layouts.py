"""Which parallel layouts a config can be verified under on `nproc` local ranks, and why the others are skipped."""

import dataclasses
from typing import List, Optional, Sequence, Tuple

from ..plan.model_shape import ModelShape

ACC = "--train.accelerator."
KINDS = ("fsdp2", "hsdp", "tp", "ulysses", "ulysses_async", "ep", "ep_ulysses")


@dataclasses.dataclass(frozen=True)
class Layout:
    kind: str  # one of KINDS, or "config" (the config's own parallel sizes)
    name: str  # what the table shows: "TP 2 x FSDP2 2"
    flags: Tuple[str, ...]  # config overrides that select it


def _sizes(tp: int = 1, sp: int = 1, ep: int = 1, replicate: int = 1, asynchronous: bool = False) -> Tuple[str, ...]:
    flags = [ACC + "tp_size", str(tp), ACC + "ulysses_size", str(sp), ACC + "enable_async", str(asynchronous).lower()]
    flags += [ACC + "dp_replicate_size", str(replicate) if replicate > 1 else "-1"]
    if ep > 1:
        flags += [ACC + "extra_parallel_sizes", str(ep), ACC + "extra_parallel_names", "ep"]
    else:
        flags += [ACC + "extra_parallel_sizes", "[]", ACC + "extra_parallel_names", "[]"]
    return (*flags, ACC + "fsdp_config.fsdp_mode", "fsdp2")


def _dp_name(dp: int) -> str:
    return f" x FSDP2 {dp}" if dp > 1 else ""


def _candidate(kind: str, nproc: int, shape: ModelShape, multimodal: bool) -> Tuple[Optional[Layout], str]:
    """The layout of `kind` on nproc ranks, or None and why it does not apply."""
    if kind == "fsdp2":
        return Layout(kind, f"FSDP2 {nproc}", _sizes()), ""
    if kind == "hsdp":
        if nproc < 4 or nproc % 2:
            return None, f"needs 2 replicas x 2 shards: 4 ranks (--nproc is {nproc})"
        return Layout(kind, f"HSDP 2x{nproc // 2}", _sizes(replicate=2)), ""
    if kind == "tp":
        from ..distributed.tensor_parallel import TP_PLANS

        if not shape.is_moe and (shape.model_type not in TP_PLANS or multimodal):
            return None, f"no tensor-parallel plan for model_type {shape.model_type}"
        if shape.tp_refusal(2):
            return None, shape.tp_refusal(2)
        return Layout(kind, f"TP 2{_dp_name(nproc // 2)}", _sizes(tp=2)), ""
    if kind in ("ulysses", "ulysses_async"):
        if shape.heads % 2:
            return None, f"num_attention_heads {shape.heads} not divisible by 2"
        mode = "async" if kind == "ulysses_async" else "sync"
        flags = _sizes(sp=2, asynchronous=kind == "ulysses_async")
        return Layout(kind, f"Ulysses 2 {mode}{_dp_name(nproc // 2)}", flags), ""
    if kind in ("ep", "ep_ulysses"):
        if not shape.experts:
            return None, "not a MoE model"
        if shape.experts % 2:
            return None, f"num_experts {shape.experts} not divisible by 2"
        if kind == "ep":
            return Layout(kind, f"EP 2 (FSDP2 {nproc})", _sizes(ep=2)), ""
        if nproc < 4 or shape.heads % 2:
            return None, f"needs EP 2 x Ulysses 2: 4 ranks (--nproc is {nproc})"
        return Layout(kind, f"EP 2 + Ulysses 2 sync (FSDP2 {nproc // 2})", _sizes(sp=2, ep=2)), ""
    raise ValueError(f"--layouts: unknown layout {kind!r} (known: auto, {', '.join(KINDS)})")


def own_layout(args, nproc: int) -> Tuple[Optional[Layout], str]:
    """The config's own parallel sizes when it sets any beyond plain FSDP2 (a combination it uses)."""
    acc = args.train.accelerator
    ep = dict(zip(acc.extra_parallel_names, acc.extra_parallel_sizes)).get("ep", 1)
    if acc.tp_size == 1 and acc.ulysses_size == 1 and ep == 1 and acc.dp_replicate_size in (-1, 1):
        return None, ""
    ranks = acc.tp_size * acc.ulysses_size * max(acc.dp_replicate_size, 1)
    if nproc % ranks:
        return None, f"its parallel sizes need a multiple of {ranks} ranks (--nproc is {nproc})"
    name = f"config: tp {acc.tp_size}, ulysses {acc.ulysses_size}, ep {ep}, dp_replicate {acc.dp_replicate_size}"
    return Layout("config", name, ()), ""


def choose_layouts(
    args, shape: ModelShape, nproc: int, requested: Sequence[str], multimodal: bool = False
) -> Tuple[List[Layout], List[tuple]]:
    """(layouts to run, [(kind, reason skipped)]) for a model of `shape` (its text model's, for a `multimodal` one);
    `requested` is ["auto"] or names from KINDS."""
    kinds = KINDS if list(requested) == ["auto"] else requested
    runs, skipped = [], []
    for kind in kinds:
        layout, why = _candidate(kind, nproc, shape, multimodal)
        if layout is None:
            skipped.append((kind, why))
        else:
            runs.append(layout)
    own, why = own_layout(args, nproc)
    if own is not None:
        runs.append(own)
    elif why:
        skipped.append(("config", why))
    return runs, skipped
