"""The launches of a verify run: the one process (the reference, which also saves at step k), every layout on
`nproc` ranks in one launch, then one process resuming both the one-process and the FSDP2 checkpoint of step k."""

import dataclasses
import json
import os
import subprocess
import sys
from typing import List, Optional

from .compare import GRAD_NORM_RTOL, Row, compare_resume, compare_series
from .layouts import Layout, _sizes

FP32 = ("--train.accelerator.fsdp_config.mixed_precision.param_dtype", "float32", "--train.tf32", "false")


@dataclasses.dataclass
class Outcome:
    rows: List[Row]
    plans: dict  # layout name -> {"predicted": {...}, "measured": {...}}
    skipped: List[tuple]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a launch sets up its own world
    return env


def launch(workdir: str, name: str, nproc: int, runs: List[dict], ref_dir: str, log) -> int:
    """One launch of the worker over `runs`; its output goes to workdir/<name>.log. Returns the exit code."""
    plan_path = os.path.join(workdir, f"{name}.json")
    with open(plan_path, "w") as f:
        json.dump({"ref_dir": ref_dir, "runs": runs}, f)
    worker = ["-m", "veomni.verify.worker", plan_path]
    if nproc == 1:  # a world of one needs no launcher
        cmd = [sys.executable, *worker]
    else:
        rendezvous = ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "--master_port=0"]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *rendezvous, *worker]
    log(f"verify: {name} on {nproc} rank(s): {', '.join(run['name'] for run in runs)}")
    with open(os.path.join(workdir, f"{name}.log"), "w") as out:
        return subprocess.run(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT).returncode


def _read(out: str, name: str) -> Optional[dict]:
    path = os.path.join(out, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        if name.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)


class Verify:
    def __init__(self, config: str, overrides: List[str], workdir: str, steps: int, nproc: int, log=print):
        self.config, self.overrides, self.workdir, self.steps, self.nproc, self.log = (
            config, overrides, workdir, steps, nproc, log,
        )  # fmt: skip
        self.ref_dir = os.path.join(workdir, "reference")
        self.save_at = max(steps - 1, 1)  # the resume continues from here

    def argv(self, layout_flags, out: str, extra=()) -> List[str]:
        flags = ["--train.max_steps", str(self.steps), "--train.checkpoint.save_steps", str(self.save_at)]
        flags += ["--train.checkpoint.save_total_limit", "0"]  # the step-k checkpoint the resume reads stays
        flags += [
            "--data.eval_path",
            "null",
            "--train.log_steps",
            "1000",
            "--train.checkpoint.save_hf_weights",
            "false",
        ]
        flags += [
            "--train.use_tensorboard",
            "false",
            "--train.wandb.enable",
            "false",
            "--train.checkpoint.load_path",
            "null",
        ]
        flags += ["--train.checkpoint.output_dir", out]
        return [self.config, *self.overrides, *FP32, *layout_flags, *flags, *extra]

    def run_dir(self, name: str) -> str:
        return os.path.join(self.workdir, "".join(c if c.isalnum() else "_" for c in name))

    def reference(self) -> Optional[str]:
        """The one-process run; None, or why it failed."""
        os.makedirs(self.ref_dir, exist_ok=True)
        out = self.run_dir("one process")
        run = {"name": "one process", "argv": self.argv(_sizes(), out), "record": True}
        if launch(self.workdir, "reference", 1, [run], self.ref_dir, self.log) != 0 or not _read(out, "metrics.jsonl"):
            return f"the one-process run failed: see {os.path.join(self.workdir, 'reference.log')}"
        return None

    def layouts(self, layouts: List[Layout]) -> Outcome:
        ref = _read(self.run_dir("one process"), "metrics.jsonl")
        runs = [
            {"name": lay.name, "argv": self.argv(lay.flags, self.run_dir(lay.name)), "save": lay.kind == "fsdp2"}
            for lay in layouts  # the FSDP2 layout's checkpoint is the one the reshard resume reads
        ]
        if runs:
            launch(self.workdir, "layouts", self.nproc, runs, self.ref_dir, self.log)
        rows, plans = [], {}
        for lay in layouts:
            out = self.run_dir(lay.name)
            result, metrics = _read(out, "verify.json"), _read(out, "metrics.jsonl") or []
            if result is None:
                rows.append(Row(lay.name, error=f"did not finish: see {os.path.join(self.workdir, 'layouts.log')}"))
                continue
            row = compare_series(ref, metrics, lay.name, result["grad_diffs"])
            row.error = result["error"] or row.error
            rows.append(row)
            plans[lay.name] = result["plan"]
        ref_result = _read(self.run_dir("one process"), "verify.json") or {}
        plans = {"one process": ref_result.get("plan", {}), **plans}
        return Outcome(rows, plans, [])

    def resumes(self, fsdp_layout: Optional[Layout]) -> List[Row]:
        """The one-process run resumed from its step-k checkpoint (bit-identical), and the FSDP2 layout's step-k
        checkpoint resumed on one process (resharded N -> 1, within the parity tolerance)."""
        if self.steps < 2:
            return []
        sources = [("resume 1 -> 1", self.run_dir("one process"), 0.0)]
        if fsdp_layout is not None:
            sources.append((f"reshard resume {self.nproc} -> 1", self.run_dir(fsdp_layout.name), GRAD_NORM_RTOL))
        runs = []
        for label, source, _ in sources:
            load = ["--train.checkpoint.load_path", os.path.join(source, "checkpoints", f"global_step_{self.save_at}")]
            argv = self.argv(_sizes(), self.run_dir(label)) + load
            runs.append({"name": label, "argv": argv, "resume": True, "save": False})
        launch(self.workdir, "resume", 1, runs, self.ref_dir, self.log)
        ref = _read(self.run_dir("one process"), "metrics.jsonl")
        rows = []
        for label, _, rtol in sources:
            got = _read(self.run_dir(label), "metrics.jsonl")
            if got is None:
                rows.append(Row(label, error=f"did not finish: see {os.path.join(self.workdir, 'resume.log')}"))
            else:
                rows.append(compare_resume(ref, got, label, rtol))
        return rows
