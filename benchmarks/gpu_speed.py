"""One command for a GPU loan: CUDA parity tests, then trainer vs bare-loop speed per variant, the HF Trainer row,
a sync check and a profile, all within a time budget (default 345 s: under 6 minutes on an H100, cold compiles
included).

    /opt/torch/.venv/bin/python3 benchmarks/gpu_speed.py [--budget 345] [--wheels .whl]
    python benchmarks/gpu_speed.py --smoke        # the same code path on CPU with a tiny model (CI runs it)

Wheels the GPU image lacks (torch 2.11 there; no torchdata, liger-kernel, torchao): fetched here into .whl/
(4.3 MiB) and carried with the working tree (`carry: [".whl"]`); the script installs them with `pip install
--no-index --no-deps --target` into a folder of its own and puts it on its stages' PYTHONPATH:

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl \\
        torchdata==0.11.0 liger-kernel==0.8.5 torchao==0.18.0

Stages, in order of value, each a child process under `timeout -s KILL` (a SIGTERM would be caught by the
trainer's stop handler) whose limit is cut to what is left of the budget (a stage that no longer fits is skipped
and says so); logs go to <out>/logs/<stage>.log and their tails are printed at the end:
  tests     tests/test_cuda.py (packed attention, fused loss, MoE, trainer on GPU, liger kernels in bf16)
  speed     Qwen3-1.7B, 8192 packed tokens: trainer and bare loop (benchmarks/gpu_mfu.py's loop and FLOP count) for
            each variant: eager, kernels, compile, compile+kernels, compile+kernels+fp8 (tensorwise)
  hf        the HF Trainer on the same documents: DataCollatorWithFlattening (padding-free), sdpa, bf16,
            adamw_torch_fused
  loss      the output head's loss alone (bf16 head of the model's shape): chunked vs liger's fused linear
            cross-entropy, time and peak memory, to choose the CUDA default (chunked until this says otherwise)
  sync      one compiled trainer step under torch.cuda.set_sync_debug_mode("warn"): the syncs it makes, by site
  profile   2 steps of the compiled trainer and of the compiled bare loop under torch.profiler: top kernels of each
  more      when time allows: Qwen3-0.6B 8k, Qwen3-4B 32k with activation checkpointing, Qwen3-30B-A3B (4 layers) 8k
Rows go to benchmarks/results/<gpu>_<date>.jsonl (MFU against the GPU's dense bf16 peak); a table is printed.
"""

import argparse
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, REPO)

VARIANTS = {  # name: (kernels, compile, fp8)
    "eager": ("eager", False, "off"),
    "kernels": ("liger", False, "off"),
    "compile": ("eager", True, "off"),
    "compile+kernels": ("liger", True, "off"),
    "compile+kernels+fp8": ("liger", True, "tensorwise"),
}
SMOKE_VARIANTS = ("eager", "compile+kernels+fp8")  # every code path (the others are combinations of these)
WHEELS = {"torchdata": "torchdata==0.11.0", "liger_kernel": "liger-kernel==0.8.5", "torchao": "torchao==0.18.0"}
# (stage, seconds it may take at most on an H100, seconds below which it is not worth starting)
PLAN = [
    ("tests", 150, 60),
    ("speed:qwen3_1_7b:8192:off", 150, 40),
    ("hf:qwen3_1_7b:8192", 110, 40),  # limits as an H200 took them cold (2026-11-27): hf and sync were cut at 40/25
    ("loss:qwen3_1_7b:8192", 25, 15),
    ("sync:qwen3_1_7b:8192", 45, 25),
    ("profile:qwen3_1_7b:8192", 60, 35),
    ("speed:qwen3_0_6b:8192:off", 60, 30),
    ("speed:qwen3_4b:32768:on", 90, 45),
    ("speed:qwen3_30b_a3b:8192:off", 70, 40),
]
SMOKE_PLAN = [(s.replace("qwen3_1_7b", "demo_qwen3").replace(":8192", ":256"), 240, 1) for s, _, _ in PLAN[:6]]


# ------------------------------------------------------------------------------------------------ orchestrator
def wheels_site(wheels_dir):
    """A folder holding the carried wheels' packages when any of them is missing here (None when none is)."""
    import importlib.util

    missing = [m for m in WHEELS if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    files = glob.glob(os.path.join(wheels_dir, "*.whl")) if wheels_dir else []
    if not files:
        print(f"missing {', '.join(missing)} and no wheels in {wheels_dir!r}: those rows will fail. Fetch them with")
        print("  pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 "
              f"-d .whl {' '.join(WHEELS[m] for m in missing)}")  # fmt: skip
        return None
    site = os.path.join(tempfile.gettempdir(), "veomni_gpu_speed_site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, *files]
    subprocess.run(cmd, check=True)
    return site


def run_stage(stage, limit, args, env, logs):
    """`timeout -s KILL limit python gpu_speed.py --stage stage`: (exit code, seconds)."""
    log = os.path.join(logs, stage.replace(":", "_") + ".log")
    if stage == "tests":
        cmd = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-x", "-p", "no:cacheprovider", "-rs"]
        cmd += ["-k", args.tests] if args.tests else []
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--stage", stage, "--rows", args.rows_tmp]
        cmd += ["--variants", args.variants] if args.variants else []
        cmd += ["--smoke"] if args.smoke else []
    tic = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(["timeout", "-s", "KILL", str(int(limit)), *cmd], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT).returncode  # fmt: skip
    return code, time.perf_counter() - tic, log


def orchestrate(args):
    start = time.perf_counter()
    args.budget = args.budget or (900.0 if args.smoke else 345.0)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    site = None if args.smoke else wheels_site(args.wheels)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, REPO, env.get("PYTHONPATH")) if p)
    if args.smoke:
        env.update(OMP_NUM_THREADS="1", VEOMNI_DEVICE="cpu")
    gpu, peak = device_and_peak(args)
    stamp = datetime.date.today().isoformat()
    name = "smoke" if args.smoke else re.sub(r"[^a-z0-9]+", "", gpu.lower().replace("nvidia", ""))[:12]
    out = args.out or os.path.join(REPO, "benchmarks", "results")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    results = os.path.join(out, f"{name}_{stamp}.jsonl")
    args.rows_tmp = os.path.join(out, "logs", f"rows_{os.getpid()}.jsonl")
    print(f"{gpu}, peak {peak} TFLOP/s bf16; budget {args.budget} s; results -> {results}", flush=True)
    status = {}
    for stage, most, least in SMOKE_PLAN if args.smoke else PLAN:
        if args.stages and not stage.startswith(tuple(args.stages.split(","))):
            continue
        left = args.budget - (time.perf_counter() - start)
        if left < least:
            status[stage] = f"skipped ({left:.0f} s left, needs {least})"
            continue
        code, seconds, log = run_stage(stage, min(most, left), args, env, os.path.join(out, "logs"))
        status[stage] = f"{'ok' if code == 0 else 'KILLED at limit' if code in (124, 137, -9) else f'exit {code}'}"
        status[stage] += f" in {seconds:.0f} s"
        print(f"=== {stage}: {status[stage]}", flush=True)
        if code != 0:
            print("".join(open(log).readlines()[-25:]), flush=True)
    rows = [json.loads(line) for line in open(args.rows_tmp)] if os.path.exists(args.rows_tmp) else []
    with open(results, "a") as f:
        for row in rows:
            f.write(json.dumps({**row, "gpu": gpu, "date": stamp, "mfu": row.get("flops", 0) / max(row.get("s", 1), 1e-9) / (peak * 1e12)}) + "\n")  # fmt: skip
    print_table(rows, peak)
    print(f"total {time.perf_counter() - start:.0f} s; stages: {json.dumps(status, indent=1)}")
    return 0 if all(s.startswith(("ok", "skipped")) for s in status.values()) else 1


def device_and_peak(args):
    if args.smoke:
        return "CPU (smoke)", 1.0
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    gpu = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    if not gpu:
        sys.exit("benchmarks/gpu_speed.py needs a CUDA GPU (or --smoke): nothing measured")
    from gpu_mfu import PEAK_TFLOPS

    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    if peak is None:
        sys.exit(f"unknown peak bf16 TFLOP/s for {gpu!r}: pass --peak-tflops")
    return gpu, peak


def print_table(rows, peak):
    steps = [r for r in rows if r.get("kind") == "step"]
    hf = {(r["model"], r["tokens"]): r for r in rows if r.get("kind") == "hf"}
    print(f"\n{'model':14s} {'tokens':>6s} {'variant':21s} {'loop':7s} {'tok/s':>8s} {'MFU':>6s} {'GiB':>5s}  vs")
    for r in steps + list(hf.values()):
        mfu = r["flops"] / r["s"] / (peak * 1e12)
        ratio = ""
        if r.get("loop") == "trainer":
            bare = next((b for b in steps if b["loop"] == "bare" and b["variant"] == r["variant"]
                         and b["model"] == r["model"] and b["tokens"] == r["tokens"]), None)  # fmt: skip
            ratio = f"trainer/bare {bare['s'] / r['s']:.3f}" if bare else ""
            if (r["model"], r["tokens"]) in hf:
                ratio += f"  ours/HF {hf[(r['model'], r['tokens'])]['s'] / r['s']:.2f}x"
        print(f"{r['model']:14s} {r['tokens']:6d} {r.get('variant', '-'):21s} {r.get('loop', 'hf'):7s} "
              f"{r['tokens'] / r['s']:8.0f} {mfu:6.1%} {r.get('peak', 0) / 2**30:5.1f}  {ratio}")  # fmt: skip
    for r in rows:
        if r.get("kind") in ("sync", "profile", "loss", "error"):
            print(json.dumps(r)[:2000])


# ------------------------------------------------------------------------------------------------ stages
def record(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def stage_setup(args, model):
    """(torch, gpu_mfu, config folder, micro-batch, FLOPs per step, steps, warmup) for a stage's model."""
    import gpu_mfu

    torch = gpu_mfu.gpu_or_refuse(args.smoke)
    if args.smoke:  # dynamo's tracing runs, inductor's minutes-long cold compile on this box does not
        import functools

        torch.compile = functools.partial(torch.compile, backend="eager")
    config = gpu_mfu.model_config(model, moe_layers=4)
    folder = tempfile.mkdtemp(prefix=f"gpu_speed_{model}_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    tokens = int(args.stage.split(":")[2])
    lengths = gpu_mfu.documents(tokens, seed=tokens) if not args.smoke else [100, 60, 96]
    batch = gpu_mfu.micro_batch(lengths, config["vocab_size"], seed=0)
    steps, warmup = (2, 1) if args.smoke else (5, 2)
    return torch, gpu_mfu, folder, batch, lengths, gpu_mfu.step_flops(config, lengths), steps, warmup


def bare_model(gpu_mfu, folder, variant, checkpointing):
    """The bare loop's model with the variant's kernels, float8 and compile, as the trainer applies them."""
    from veomni.distributed.activation_checkpointing import apply_ac
    from veomni.distributed.compile import compile_basic_modules
    from veomni.distributed.fp8 import apply_fp8
    from veomni.distributed.fsdp import basic_module_instances, no_split_module_names
    from veomni.models import build_foundation_model
    from veomni.ops.kernels import bind_kernels

    kernels, compiled, fp8 = VARIANTS[variant]
    model = build_foundation_model(folder, init_device=gpu_mfu.DEVICE, torch_dtype="float32",
                                   moe_implementation="fused")  # fmt: skip
    bind_kernels(model, "auto" if gpu_mfu.DEVICE == "cpu" else kernels, gpu_mfu.DEVICE)
    apply_fp8(model, fp8)
    if checkpointing:
        apply_ac(model, reentrant=False)
    if compiled:
        compile_basic_modules(basic_module_instances(model, no_split_module_names(model)))
    model.train()
    return model


def trainer_argv(variant, smoke):
    kernels, _, fp8 = VARIANTS[variant]
    return ["--model.ops_implementation.kernels", "auto" if smoke else kernels, "--train.fp8", fp8]


def stage_speed(args):
    _, model_name, tokens, ckpt = args.stage.split(":")
    torch, gpu_mfu, folder, batch, lengths, flops, steps, warmup = stage_setup(args, model_name)
    from veomni.distributed import destroy_parallel_state

    checkpointing = ckpt == "on"
    for variant, (_, compiled, _) in VARIANTS.items():
        if (args.smoke and variant not in SMOKE_VARIANTS) or (
            args.variants and variant not in args.variants.split(",")
        ):
            continue
        row = {"kind": "step", "model": model_name, "tokens": int(tokens), "ckpt": checkpointing, "flops": flops,
               "variant": variant}  # fmt: skip
        try:
            trainer = gpu_mfu.build_trainer(
                folder, steps, batch, checkpointing, compiled, trainer_argv(variant, args.smoke)
            )
            s, peak = gpu_mfu.time_trainer(trainer, steps, warmup)
            del trainer
            destroy_parallel_state()
            gpu_mfu.reset_peak_memory()
            record(args.rows, {**row, "loop": "trainer", "s": s, "peak": peak})
            model = bare_model(gpu_mfu, folder, variant, checkpointing)
            s, peak = gpu_mfu.time_bare(model, batch, steps, warmup)
            del model
            gpu_mfu.reset_peak_memory()
            record(args.rows, {**row, "loop": "bare", "s": s, "peak": peak})
        except Exception as e:  # one variant failing (a missing wheel, out of memory) leaves the others to run
            destroy_parallel_state()
            record(args.rows, {"kind": "error", "stage": args.stage, "variant": variant, "error": repr(e)[:500]})
            print(f"{variant}: {e!r}", flush=True)
            if isinstance(e, torch.OutOfMemoryError):
                gpu_mfu.reset_peak_memory()


def stage_hf(args):
    """transformers.Trainer on the same documents: padding-free (DataCollatorWithFlattening), sdpa, bf16, fused
    AdamW; the step time of `steps` optimizer steps after `warmup`."""
    _, model_name, tokens = args.stage.split(":")
    torch, gpu_mfu, folder, batch, lengths, flops, steps, warmup = stage_setup(args, model_name)
    from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainerCallback
    from transformers import TrainingArguments as HFArgs

    ids = batch["input_ids"][0].tolist()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    docs = [{"input_ids": ids[a:b], "labels": ids[a:b]} for a, b in zip(starts, starts[1:])]
    dtype = torch.bfloat16 if not args.smoke else torch.float32
    with torch.device(gpu_mfu.DEVICE):  # a CPU init of 1.7B random weights takes longer than the stage's limit
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), attn_implementation="sdpa")

    class Clock(TrainerCallback):
        times = []

        def on_step_begin(self, *a, **k):
            gpu_mfu.synchronize()
            self.tic = time.perf_counter()

        def on_step_end(self, *a, **k):
            gpu_mfu.synchronize()
            self.times.append(time.perf_counter() - self.tic)

    hf_args = HFArgs(output_dir=folder, per_device_train_batch_size=len(docs), max_steps=steps, bf16=dtype == torch.bfloat16,
                     optim="adamw_torch_fused" if not args.smoke else "adamw_torch", report_to=[], save_strategy="no",
                     logging_strategy="no", dataloader_num_workers=0, learning_rate=1e-5, use_cpu=args.smoke)  # fmt: skip
    gpu_mfu.reset_peak_memory()
    trainer = Trainer(model=model, args=hf_args, train_dataset=docs * steps, data_collator=DataCollatorWithFlattening(),
                      callbacks=[Clock()])  # fmt: skip
    trainer.train()
    s = sum(Clock.times[warmup:]) / max(len(Clock.times) - warmup, 1)
    record(args.rows, {"kind": "hf", "model": model_name, "tokens": int(tokens), "flops": flops, "s": s,
                       "peak": gpu_mfu.peak_memory(), "variant": "hf_flat_sdpa_bf16"})  # fmt: skip


def stage_sync(args):
    """One compiled trainer step (after a warm-up step) under set_sync_debug_mode("warn"): each sync's site. The
    trainer reads a step's metrics one step later: step 1's are read after step 2 is queued, step 2's after step 3,
    so the window between those two reads holds exactly one step's work (step 3's, and the reading of step 2's)."""
    _, model_name, tokens = args.stage.split(":")
    torch, gpu_mfu, folder, batch, lengths, flops, steps, warmup = stage_setup(args, model_name)
    import traceback
    import warnings

    trainer = gpu_mfu.build_trainer(folder, 3, batch, False, True, trainer_argv("compile+kernels", args.smoke))
    sites = []

    def on_step_end(_callback, t, metrics):
        if gpu_mfu.DEVICE == "cuda" and metrics["step"] in (1, 2):
            torch.cuda.set_sync_debug_mode("warn" if metrics["step"] == 1 else 0)

    hooks = {"on_step_end": on_step_end, "on_train_begin": lambda *a: None, "on_train_end": lambda *a: None}
    trainer.callbacks = [type("S", (), hooks)()]
    original = warnings.showwarning

    def show(message, category, filename, lineno, *rest):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-2] if "/veomni/" in f.filename]
            sites.append(f"{frames[-1].filename.split('/veomni/')[-1]}:{frames[-1].lineno}" if frames else filename)
        else:
            original(message, category, filename, lineno, *rest)

    warnings.showwarning = show
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        trainer.fit()
    if gpu_mfu.DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    counts = {site: sites.count(site) for site in dict.fromkeys(sites)}
    record(args.rows, {"kind": "sync", "model": model_name, "syncs_per_step": len(sites), "sites": counts})


def stage_profile(args):
    """2 steps of the compiled trainer and of the compiled bare loop: GPU busy time and top kernels of each."""
    _, model_name, tokens = args.stage.split(":")
    torch, gpu_mfu, folder, batch, lengths, flops, steps, warmup = stage_setup(args, model_name)
    from torch.profiler import ProfilerActivity, profile

    from veomni.distributed import destroy_parallel_state

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu_mfu.DEVICE == "cuda" else [])
    for loop in ("trainer", "bare"):
        variant = "compile+kernels"
        with profile(activities=activities) as prof:
            if loop == "trainer":
                trainer = gpu_mfu.build_trainer(
                    folder, warmup + 2, batch, False, True, trainer_argv(variant, args.smoke)
                )
                gpu_mfu.time_trainer(trainer, warmup + 2, warmup)
                del trainer
                destroy_parallel_state()
            else:
                gpu_mfu.time_bare(bare_model(gpu_mfu, folder, variant, False), batch, warmup + 2, warmup)
        events = prof.key_averages()
        key = "self_device_time_total" if gpu_mfu.DEVICE == "cuda" else "self_cpu_time_total"
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:12]
        record(args.rows, {"kind": "profile", "loop": loop, "variant": variant, "model": model_name,
                           "busy_ms": sum(getattr(e, key) for e in events) / 1e3,
                           "top": [(e.key[:60], round(getattr(e, key) / 1e3, 2), e.count) for e in top]})  # fmt: skip
        gpu_mfu.reset_peak_memory()


def stage_loss(args):
    """The head-loss backends "chunked" vs "liger" on the model's head shape, bf16: fwd+bwd time, peak memory."""
    _, model_name, tokens = args.stage.split(":")
    torch, gpu_mfu, folder, batch, lengths, flops, steps, warmup = stage_setup(args, model_name)
    import veomni.ops.kernels  # noqa: F401  (registers the "liger" backend)
    from veomni.ops import chunked_head_loss_sum

    config = gpu_mfu.model_config(model_name, moe_layers=4)
    dtype = torch.bfloat16 if gpu_mfu.DEVICE == "cuda" else torch.float32
    head = torch.nn.Linear(config["hidden_size"], config["vocab_size"], bias=False, device=gpu_mfu.DEVICE, dtype=dtype)
    hidden = torch.randn(1, int(tokens), config["hidden_size"], device=gpu_mfu.DEVICE, dtype=dtype)
    labels = batch["labels"].to(gpu_mfu.DEVICE)
    backends = ["chunked"] + (["liger"] if gpu_mfu.DEVICE == "cuda" else [])  # liger's Triton kernels need a GPU
    for name in backends:
        times = []
        gpu_mfu.reset_peak_memory()
        for _ in range(steps):
            leaf = hidden.detach().clone().requires_grad_()
            gpu_mfu.synchronize()
            tic = time.perf_counter()
            loss, _ = chunked_head_loss_sum(head, leaf, labels, 1024, backend=name)
            loss.backward()
            gpu_mfu.synchronize()
            times.append(time.perf_counter() - tic)
            head.weight.grad = None
        record(args.rows, {"kind": "loss", "loss": name, "model": model_name, "tokens": int(tokens),
                           "ms": 1e3 * sum(times[warmup:]) / max(len(times) - warmup, 1),
                           "peak": gpu_mfu.peak_memory()})  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the same code path on CPU, tiny model, no figures")
    parser.add_argument("--budget", type=float, default=None, help="seconds for everything (default 345; smoke 900)")
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"), help="carried wheels of missing packages")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--stages", default=None, help="only the stages starting with these, comma-separated "
                        "(e.g. tests,speed:qwen3_1_7b,hf): a second, shorter loan")  # fmt: skip
    parser.add_argument("--tests", default=None, help="a pytest -k expression: only these CUDA tests")
    parser.add_argument(
        "--variants", default=None, help=f"only these speed variants, comma-separated: {','.join(VARIANTS)}"
    )
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # a child: run one stage
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage is None:
        sys.exit(orchestrate(args))
    if args.smoke:
        os.environ.setdefault("VEOMNI_DEVICE", "cpu")
    stages = {"speed": stage_speed, "hf": stage_hf, "sync": stage_sync, "profile": stage_profile, "loss": stage_loss}
    stages[args.stage.split(":")[0]](args)


if __name__ == "__main__":
    main()
