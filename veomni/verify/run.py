"""The launches of a verify run: the one process (the reference; then, in the same launch, a run that saves at
step k and is SIGKILLed by this process in the middle of step k + 1), every layout on `nproc` ranks in one launch,
then one fresh process resuming both the killed run (in place, `load_path: auto`, as a restarted job would) and
the FSDP2 layout's checkpoint of step k."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional, Tuple

from .compare import GRAD_NORM_RTOL, Row, compare_resume, compare_series
from .harness import KILL_MARKER
from .layouts import Layout, _sizes

KILLED = "killed in step k+1"  # the run SIGKILLed after its step-k checkpoint (its folder's name)
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


def launch(workdir: str, name: str, nproc: int, runs: List[dict], ref_dir: str, kill_at: str = "") -> int:
    """One launch of the worker over `runs`; its output goes to workdir/<name>.log. Returns the exit code:
    -SIGKILL when the file `kill_at` appeared and this process killed the launch (every process of it at once)."""
    plan_path = os.path.join(workdir, f"{name}.json")
    with open(plan_path, "w") as f:
        json.dump({"ref_dir": ref_dir, "runs": runs}, f)
    worker = ["-m", "veomni.verify.worker", plan_path]
    if nproc == 1:  # a world of one needs no launcher
        cmd = [sys.executable, *worker]
    else:
        rendezvous = ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "--master_port=0"]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *rendezvous, *worker]
    print(f"verify: {name} on {nproc} rank(s): {', '.join(run['name'] for run in runs)}")
    with open(os.path.join(workdir, f"{name}.log"), "w") as out:
        # a session of its own: one killpg reaches the launch and its loader workers (a one-rank launch)
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if kill_at and os.path.isfile(kill_at):
                    os.killpg(proc.pid, signal.SIGKILL)  # as a node failure: no handler, no cleanup runs
                    break
                time.sleep(0.02)
            return proc.wait()
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C): torchrun stops its ranks on SIGTERM; then no mercy
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _read(out: str, name: str) -> Optional[dict]:
    path = os.path.join(out, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        if name.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)


class Verify:
    def __init__(self, config: str, overrides: List[str], workdir: str, steps: int, nproc: int):
        self.config, self.overrides, self.workdir, self.steps, self.nproc = config, overrides, workdir, steps, nproc
        self.ref_dir = os.path.join(workdir, "reference")
        self.save_at = max(steps - 1, 1)  # the resume continues from here
        self.killed_code: Optional[int] = None  # the exit of the launch whose last run was killed

    def argv(self, layout_flags, out: str) -> List[str]:
        fixed = {
            "train.max_steps": self.steps,
            "train.checkpoint.save_steps": self.save_at,
            "train.checkpoint.save_total_limit": 0,  # the step-k checkpoint the resume reads stays
            "data.eval_path": "null",
            "train.log_steps": 1000,
            "train.checkpoint.save_hf_weights": "false",
            "train.use_tensorboard": "false",
            "train.wandb.enable": "false",
            "train.checkpoint.load_path": "null",
            "train.checkpoint.output_dir": out,
        }
        flags = [item for key, value in fixed.items() for item in (f"--{key}", str(value))]
        return [self.config, *self.overrides, *FP32, *layout_flags, *flags]

    def run_dir(self, name: str) -> str:
        return os.path.join(self.workdir, "".join(c if c.isalnum() else "_" for c in name))

    def reference(self) -> Optional[str]:
        """The one-process run, then (steps >= 2) the run killed in step k + 1; None, or why it failed."""
        os.makedirs(self.ref_dir, exist_ok=True)
        out = self.run_dir("one process")
        runs = [{"name": "one process", "argv": self.argv(_sizes(), out), "record": True, "save": False}]
        kill_at = ""
        if self.steps >= 2:
            killed = self.run_dir(KILLED)
            runs.append({"name": KILLED, "argv": self.argv(_sizes(), killed), "stall_at": self.save_at})
            kill_at = os.path.join(killed, KILL_MARKER)
        self.killed_code = launch(self.workdir, "reference", 1, runs, self.ref_dir, kill_at=kill_at)
        result = _read(out, "verify.json")  # the run to kill, after it, has a row of its own (resumes)
        if not result or result["error"] or not _read(out, "metrics.jsonl"):
            return f"the one-process run failed: see {os.path.join(self.workdir, 'reference.log')}"
        return None

    def _killed_state(self) -> Tuple[Optional[List[int]], str]:
        """The steps the killed run logged and its latest checkpoint, read before its resume appends to them."""
        out = self.run_dir(KILLED)
        steps = [m["step"] for m in _read(out, "metrics.jsonl") or []]
        latest = os.path.join(out, "checkpoints", "latest")
        return steps, open(latest).read().strip() if os.path.isfile(latest) else "none"

    def layouts(self, layouts: List[Layout]) -> Outcome:
        ref = _read(self.run_dir("one process"), "metrics.jsonl")
        runs = [
            {"name": lay.name, "argv": self.argv(lay.flags, self.run_dir(lay.name)), "save": lay.kind == "fsdp2"}
            for lay in layouts  # the FSDP2 layout's checkpoint is the one the reshard resume reads
        ]
        if runs:
            launch(self.workdir, "layouts", self.nproc, runs, self.ref_dir)
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
        """The killed one-process run resumed in place by a fresh process (bit-identical to the uninterrupted run,
        its steps before the kill included), and the FSDP2 layout's step-k checkpoint resumed on one process
        (resharded N -> 1, within the parity tolerance)."""
        if self.steps < 2:
            return []
        k = self.save_at
        kill_label = f"SIGKILL in step {k + 1}, resume 1 -> 1"
        steps, latest = self._killed_state()
        not_killed = None
        if self.killed_code != -signal.SIGKILL or steps != list(range(1, k + 1)) or latest != f"global_step_{k}":
            not_killed = (f"the run to kill was not killed in step {k + 1} after its step-{k} checkpoint "
                          f"(exit {self.killed_code}, steps {steps}, latest {latest})")  # fmt: skip
        runs, sources = [], []
        if not_killed is None:
            argv = self.argv(_sizes(), self.run_dir(KILLED)) + ["--train.checkpoint.load_path", "auto"]
            runs.append({"name": kill_label, "argv": argv, "resume": True, "save": False})
            sources.append((kill_label, self.run_dir(KILLED), 0.0))
        if fsdp_layout is not None:
            label, source = f"reshard resume {self.nproc} -> 1", self.run_dir(fsdp_layout.name)
            load = ["--train.checkpoint.load_path", os.path.join(source, "checkpoints", f"global_step_{k}")]
            argv = self.argv(_sizes(), self.run_dir(label)) + load
            runs.append({"name": label, "argv": argv, "resume": True, "save": False})
            sources.append((label, self.run_dir(label), GRAD_NORM_RTOL))
        if runs:
            launch(self.workdir, "resume", 1, runs, self.ref_dir)
        ref = _read(self.run_dir("one process"), "metrics.jsonl")
        rows = [] if not_killed is None else [Row(kill_label, error=not_killed, tolerance="bit-identical")]
        for label, out, rtol in sources:
            got = _read(out, "metrics.jsonl")
            if got is None:
                rows.append(Row(label, error=f"did not finish: see {os.path.join(self.workdir, 'resume.log')}"))
                continue
            row = compare_resume(ref, got, label, rtol)
            if rtol == 0 and row.error is None and [m["step"] for m in got] != list(range(1, self.steps + 1)):
                row.error = f"logged steps {[m['step'] for m in got]} after the resume, not 1..{self.steps}"
            rows.append(row)
        return rows
