"""What a verify run leaves for a bug report: the planner's predicted vs measured bytes, and a markdown file with
the versions, the config, the table and the failing parameter."""

import platform
import sys
from typing import Dict, List

from .compare import render_table

MIB = 2**20


def render_plans(plans: Dict[str, dict]) -> str:
    """Per layout, the largest rank's predicted / measured MiB of parameters, gradients, optimizer state, of the
    collectives of one optimizer step, and the peak memory (measured on an accelerator only)."""
    lines = ["planner, per rank (largest rank), predicted / measured MiB (collectives: one step's bytes; peak: the "
             "device allocator's high-water mark over the steps):"]  # fmt: skip
    for name, plan in plans.items():
        predicted, measured = plan.get("predicted", {}), plan.get("measured", {})
        if "error" in predicted:
            lines.append(f"  {name}: no prediction ({predicted['error']})")
            continue
        parts = []
        for key in ("params", "grads", "optimizer", "collectives"):
            if key in predicted:
                seen = f"{measured[key] / MIB:.3f}" if key in measured else "-"
                parts.append(f"{key} {predicted[key] / MIB:.3f} / {seen}")
        if "peak" in predicted:
            parts.append(f"peak {predicted['peak'] / MIB:.3f} / {_peak(predicted['peak'], measured.get('peak'))}")
        lines.append(f"  {name}: " + ", ".join(parts))
    return "\n".join(lines)


def _peak(predicted: float, measured) -> str:
    if measured is None:
        return "n/a (no GPU)"
    return f"{measured / MIB:.3f} (measured/predicted {measured / max(predicted, 1.0):.2f})"


def _versions() -> List[str]:
    from importlib.metadata import version

    import torch

    return [
        f"python {sys.version.split()[0]}, torch {version('torch')}, transformers {version('transformers')}",
        f"veomni {version('veomni')}, {platform.platform()}",
        f"devices: {torch.accelerator.device_count()} {torch.accelerator.current_accelerator().type}"
        if torch.accelerator.is_available()
        else "devices: CPU (gloo)",
    ]


def write_report(path: str, config: str, overrides: List[str], options, outcome) -> None:
    failing = [row.verdict() for row in outcome.rows if not row.ok]
    with open(config) as f:
        config_text = f.read()
    text = [
        "# veomni verify report",
        "",
        f"Verdict: **{'FAILED' if failing else 'every layout within tolerance'}** ({outcome.seconds:.0f} s)",
        *[f"- {line}" for line in failing],
        "",
        "## Versions",
        *[f"- {line}" for line in _versions()],
        "",
        "## Command",
        "",
        f"    python -m veomni.verify {config} {' '.join(overrides)} --layouts {options.layouts} "
        f"--steps {options.steps} --nproc {options.nproc}",
        "",
        "## Results",
        "",
        "```",
        render_table(outcome.rows, outcome.skipped),
        "",
        render_plans(outcome.plans),
        "```",
        "",
        f"## Config ({config})",
        "",
        "```yaml",
        config_text.rstrip(),
        "```",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(text))
