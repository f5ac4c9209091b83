"""What the compiled trainer runs per step beyond benchmarks/gpu_mfu.py's compiled bare loop, counted on CPU (one
gloo rank, a tiny Qwen3, the decoder layers compiled with backend aot_eager). Run by tests/test_compile_gap.py.

    python tests/dist/check_compile_gap.py OUT.json [BREAK]

Both loops are gpu_mfu's own (`time_trainer_model`, `time_bare_model`): its `profiled` step marker is replaced by a
counter that records the step after the warm-up step. Per loop and step it writes:
  * outside_ops: top-level aten ops dispatched outside the compiled graphs (the backend runs every forward and
    backward graph inside a profiler range, so an op inside one is told apart), by name;
  * ops_by_cause: the same ops by the innermost region they ran in: FSDP2's ranges (`fsdp`), `optimizer_step`,
    `zero_grad`, the parts both loops share (`forward` with the loss, `backward`, `clip_grad_norm`), the trainer's
    own (`step_totals`, `to_device`), `compiled_runtime` (aot_autograd's own work around a compiled graph, e.g. a
    detach per tensor the forward saves for backward) and `step_rest` (the loop's code around them);
  * dtensor_dispatches: ops dispatched on DTensors (each pays DTensor's sharding propagation on the host), by region;
  * fsdp_ranges: FSDP2's hook work by kind; hooks: module forward / backward hooks fired (the model's and global);
  * optimizer_ms: host time of `optimizer.step` (a figure, not asserted: this box is shared).
BREAK (for the test's red check) adds work the bare loop does not have to the trainer's step: `extra_op` one
needless op per step, `extra_hook` a forward hook on every decoder layer. `ddp` instead counts the trainer with
`fsdp_mode: ddp` (a comparison for one GPU, not a break).
"""

import functools
import json
import os
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import gpu_mfu  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "use_cache": False, "hidden_act": "silu",
}  # fmt: skip
KINDS = ("outside_ops", "ops_by_cause", "dtensor_dispatches", "fsdp_ranges", "hooks")


MARK = "veomni::compiled_graph"  # a record_function around every compiled graph run


def marking_backend():
    """aot_eager whose forward and backward graphs run inside a `MARK` profiler range."""
    from functorch.compile import make_boxed_func

    def compiler(gm, example_inputs):
        inner = make_boxed_func(gm.forward)

        def run(args):
            with torch.profiler.record_function(MARK):
                return inner(args)

        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def cause_of(ancestors):
    """The innermost named region an op ran in: aot_autograd's runtime, FSDP2's own ranges, the optimizer's, or a
    `veomni::` marker."""
    if ancestors and ancestors[0].startswith("CompiledFunction"):  # the compiled function's own op (also backward)
        return "compiled_runtime"
    for name in ancestors:
        if name.startswith("FSDP::"):
            return "fsdp"
        if name.startswith("Optimizer.step#"):
            return "optimizer_step"
        if name.startswith("Optimizer.zero_grad#"):
            return "zero_grad"
        if name.startswith("veomni::") and name != MARK:
            return name[len("veomni::") :]
    return "step_rest"  # the loop's own code around these


def tally_profile(events, tally):
    """Top-level aten ops (not nested in another op) outside compiled graphs, by name and by cause; DTensor
    dispatches (the profiler's `PythonSubclass` range) by op and by cause; FSDP2's ranges (its hooks' work)."""
    for event in events:
        name, ancestors = event.name, []
        parent = event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if MARK in ancestors:
            continue
        nested = any(a.startswith("aten::") or a == "PythonSubclass" for a in ancestors)
        if name.startswith("aten::") and not nested:
            tally["outside_ops"][name[6:]] += 1
            tally["ops_by_cause"][cause_of(ancestors)] += 1
        elif name == "PythonSubclass":
            tally["dtensor_dispatches"][cause_of(ancestors)] += 1
        elif name.startswith("FSDP::"):
            tally["fsdp_ranges"][name.split(" ")[0]] += 1


def marked(label, fn):
    """`fn` inside a `veomni::<label>` profiler range (names the cause of the ops it dispatches)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.profiler.record_function(f"veomni::{label}"):
            return fn(*args, **kwargs)

    return run


def mark_regions():
    """Name the parts of a step in both loops (forward + loss, backward, grad clipping) and the trainer's own."""
    from veomni.ops import CausalLMLoss
    from veomni.trainer import base

    CausalLMLoss.forward = marked("forward", CausalLMLoss.forward)
    torch.Tensor.backward = marked("backward", torch.Tensor.backward)
    base.clip_grad_norm_tensor = marked("clip_grad_norm", base.clip_grad_norm_tensor)
    torch.nn.utils.clip_grad_norm_ = marked("clip_grad_norm", torch.nn.utils.clip_grad_norm_)
    for method in ("_step_totals", "_to_device"):
        setattr(base.BaseTrainer, method, marked(method.strip("_"), getattr(base.BaseTrainer, method)))


HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def count_hooks(model, tally):
    """Wrap every module hook of `model` (and the global ones) so that each call is counted; returns an undo."""
    from torch.nn.modules import module as nn_module

    saved = []
    dicts = [getattr(m, d) for m in model.modules() for d in HOOK_DICTS]
    dicts += [getattr(nn_module, f"_global{d}") for d in HOOK_DICTS]
    for hooks in dicts:
        saved.append((hooks, dict(hooks)))
        for key, hook in list(hooks.items()):
            hooks[key] = _counting(hook, tally)

    def undo():
        for hooks, original in saved:
            hooks.clear()
            hooks.update(original)

    return undo


def _counting(hook, tally):
    @functools.wraps(hook)
    def wrapper(*args, **kwargs):
        tally["hooks"][getattr(hook, "__qualname__", type(hook).__name__)] += 1
        return hook(*args, **kwargs)

    return wrapper


class StepCounter:
    """Stands in for gpu_mfu.profiled: counts the step after the warm-up step of the loop it marks."""

    loops = {}  # label -> counts
    model = None

    def __init__(self, label, warmup):
        self.label, self.warmup, self.steps = label.split()[0], warmup, 0
        self.tally = {k: Counter() for k in KINDS}
        self.optimizer_s, self.prof, self.undo = [], None, None

    def __enter__(self):
        handles = [register_optimizer_step_pre_hook(self._opt_begin)]
        handles.append(register_optimizer_step_post_hook(self._opt_end))
        self.handles = handles
        return self

    def _opt_begin(self, *_):
        self.tic = time.perf_counter()

    def _opt_end(self, *_):
        if self.prof is not None:
            self.optimizer_s.append(time.perf_counter() - self.tic)

    def step(self):
        self.steps += 1
        if self.steps == self.warmup:  # the warm-up step done (compiled, optimizer state made): count the next
            self.undo = count_hooks(StepCounter.model, self.tally)
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        elif self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.undo()
            tally_profile(self.prof.events(), self.tally)
            self.prof = None
            row = {k: dict(v) for k, v in self.tally.items()}
            row["optimizer_ms"] = sum(self.optimizer_s) * 1e3
            StepCounter.loops[self.label] = row

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def main():
    out, brk = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    torch.set_num_threads(1)
    gpu_mfu.DEVICE = "cpu"
    gpu_mfu.profiled = StepCounter
    backend = marking_backend()
    torch.compile = functools.partial(torch.compile, backend=backend)
    mark_regions()

    time_trainer, time_bare = gpu_mfu.time_trainer, gpu_mfu.time_bare

    def trainer_counted(trainer, *args, **kwargs):
        StepCounter.model = trainer.model
        if brk:
            break_trainer(trainer, brk)
        return time_trainer(trainer, *args, **kwargs)

    def bare_counted(model, *args, **kwargs):
        StepCounter.model = model
        return time_bare(model, *args, **kwargs)

    gpu_mfu.time_trainer, gpu_mfu.time_bare = trainer_counted, bare_counted
    if brk == "ddp":
        extra = ("--train.accelerator.fsdp_config.fsdp_mode", "ddp")
        gpu_mfu.build_trainer = functools.partial(gpu_mfu.build_trainer, extra_argv=extra)
    folder = tempfile.mkdtemp(prefix="compile_gap_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    batch = gpu_mfu.micro_batch([40, 24], CONFIG["vocab_size"], seed=0)
    # 3 steps, counting from the first marker to the second: the trainer reads a step's metrics (and fires
    # on_step_end, gpu_mfu's marker) one step late, so its window holds step 3; the bare loop's holds step 2
    args = type("Args", (), {"steps": 3, "warmup": 1, "compile": True})()
    gpu_mfu.time_trainer_model(folder, False, batch, args)
    from veomni.distributed import destroy_parallel_state

    destroy_parallel_state()
    gpu_mfu.time_bare_model(folder, False, batch, args)
    with open(out, "w") as f:
        json.dump(StepCounter.loops, f, indent=1)


def break_trainer(trainer, kind):
    """Work the bare loop does not do, for the test's red check."""
    if kind == "ddp":
        return
    if kind == "extra_op":
        step = trainer.train_step

        def train_step(*args, **kwargs):
            torch.zeros(1).add_(1)  # one needless op per step
            return step(*args, **kwargs)

        trainer.train_step = train_step
    elif kind == "extra_hook":
        for layer in trainer.model.model.layers:
            layer.register_forward_hook(lambda *_: None)
    else:
        raise ValueError(kind)


if __name__ == "__main__":
    main()
