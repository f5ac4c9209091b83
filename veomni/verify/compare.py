"""A layout's run against the one-process run: the table's row and its verdict.

The tolerances are the ones the parity tests prove on CPU in fp32 (tests/test_parity_data_parallel.py,
test_ulysses.py, test_tensor_parallel.py, test_expert_parallel.py): loss and grad norm to 1e-5 relative; a
parameter's gradient at equal weights to GRAD_RTOL of its largest entry; a resume bit-identical."""

import dataclasses
from typing import Dict, List, Optional, Tuple

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
GRAD_RTOL = 1e-4


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@dataclasses.dataclass
class Row:
    layout: str
    loss: Optional[float] = None  # max relative loss difference over the steps
    grad_norm: Optional[float] = None
    worst_grad: Optional[Tuple[float, str, int]] = None  # (relative difference, parameter, step)
    first_failing: Optional[Tuple[str, int]] = None  # the first failing step's worst parameter, and the step
    error: Optional[str] = None
    tolerance: str = f"loss/grad norm {LOSS_RTOL:.0e}, grads {GRAD_RTOL:.0e}"

    @property
    def ok(self) -> bool:
        if self.error is not None or self.loss is None:
            return False
        grads_ok = self.worst_grad is None or self.worst_grad[0] <= GRAD_RTOL
        return self.loss <= LOSS_RTOL and (self.grad_norm or 0.0) <= GRAD_NORM_RTOL and grads_ok

    def verdict(self) -> str:
        if self.error is not None:
            return f"FAIL: {self.error}"
        if self.ok:
            return "ok"
        if self.first_failing is not None:
            name, step = self.first_failing
            return f"FAIL: {name} under {self.layout} (step {step})"
        return "FAIL: loss or grad norm out of tolerance"


def compare_series(ref: List[dict], got: List[dict], layout: str, grad_diffs: Dict[str, Dict[str, float]]) -> Row:
    """A layout's metrics.jsonl and per-step gradient differences against the one-process run's metrics."""
    row = Row(layout)
    if len(got) != len(ref):
        row.error = f"ran {len(got)} steps, the one-process run {len(ref)}"
        return row
    row.loss = max(rel(r["loss"], g["loss"]) for r, g in zip(ref, got))
    row.grad_norm = max(rel(r["grad_norm"], g["grad_norm"]) for r, g in zip(ref, got))
    steps = sorted(grad_diffs, key=int)
    worst = ((diff, name, int(step)) for step in steps for name, diff in grad_diffs[step].items())
    row.worst_grad = max(worst, key=lambda entry: entry[0], default=None)  # the first of equals
    for step in steps:
        diffs = grad_diffs[step]
        # at the first step that fails, the parameter furthest off: a wrong gradient also moves the gradients
        # of the layers below it a little, its own the most
        if row.first_failing is None and diffs and max(diffs.values()) > GRAD_RTOL:
            row.first_failing = (max(diffs, key=diffs.get), int(step))
    return row


def compare_resume(ref: List[dict], got: List[dict], label: str, rtol: float) -> Row:
    """A resumed continuation against the uninterrupted run's same steps (rtol 0: bit-identical)."""
    row = Row(label, tolerance="bit-identical" if rtol == 0 else f"loss/grad norm {rtol:.0e}")
    tail = {m["step"]: m for m in ref}
    if not got or any(m["step"] not in tail for m in got):
        row.error = f"resumed steps {[m['step'] for m in got]} not in the uninterrupted run"
        return row
    row.loss = max(rel(tail[m["step"]]["loss"], m["loss"]) for m in got)
    row.grad_norm = max(rel(tail[m["step"]]["grad_norm"], m["grad_norm"]) for m in got)
    if row.loss > rtol or row.grad_norm > rtol:
        row.error = f"continuation differs: loss {row.loss:.2e}, grad norm {row.grad_norm:.2e}"
    return row


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1e}"


def render_table(rows: List[Row], skipped: List[tuple]) -> str:
    header = ("layout", "max rel loss diff", "max rel grad-norm diff", "worst parameter gradient", "verdict")
    lines = [header]
    for row in rows:
        worst = (
            "-" if row.worst_grad is None else f"{row.worst_grad[0]:.1e} {row.worst_grad[1]} (step {row.worst_grad[2]})"
        )
        lines.append((row.layout, _fmt(row.loss), _fmt(row.grad_norm), worst, f"{row.verdict()} [{row.tolerance}]"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    out += [f"skipped {kind}: {why}" for kind, why in skipped]
    return "\n".join(out)
