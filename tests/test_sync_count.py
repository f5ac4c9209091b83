"""The training step makes no avoidable host reads of device values (each one a sync on an accelerator).

One 2-rank launch (tests/dist/count_syncs.py) trains three runs of 3 steps with `log_steps: 1` and metrics.jsonl on:
the dense tiny model, the tiny MoE with its experts on the grouped-matmul path (what CUDA bf16 runs), and the same
MoE with expert parallelism 2. Every `.item()`/`int(t)`, data-dependent-shape op (nonzero, bincount, masked_select,
boolean-mask indexing, ...), `tolist`/`cpu`/`numpy` and `synchronize` inside the loop's per-step work is counted by
site. A site must be in ALLOWED below, with its reason, and stay within its budget.
"""

import json
import os

from helpers import REPO, tiny_run_config, torchrun, write_moe_config

# site [what] -> (budget unit, reads per unit, why it stays)
ALLOWED = {
    "veomni/trainer/step_metrics.py:host_loss_tokens [item]": (
        "micro_batch",
        2,
        "host only: the loss tokens of the loader's CPU labels (the step's token all-reduce, and the chunked loss's "
        "row count), before the copy to the device",
    ),
    "veomni/trainer/base.py:_step_totals [tolist]": (
        "step",
        1,
        "host only: the loop's decisions (data left on every rank, stop requests) and token counts, all-reduced over "
        "a gloo group in host memory",
    ),
    "veomni/trainer/step_metrics.py:resolve [tolist]": (
        "step",
        1,
        "the pinned host copy of a step's metrics, read one step later (or before a save/stop/the end) after its copy "
        "event: the device never waits",
    ),
    "veomni/ops/attention.py:varlen_attention_forward [tolist]": (
        "layer_micro_batch",
        1,
        "CPU (fp32) only: causal SDPA per document takes the document lengths as host ints; CUDA bf16/fp16 runs a "
        "varlen kernel on the collator's cu_seq_lens and max_length (host int) instead",
    ),
    "veomni/ops/moe.py:_expert_parallel_mlp [tolist]": (
        "moe_layer_micro_batch",
        1,
        "expert parallelism: the all-to-all split sizes are host arguments (token-choice dispatch without capacity "
        "padding): one read of the sent and received per-expert counts together",
    ),
}

RUNS = {"dense": [], "moe": ["--grouped-mm"], "moe_ep2": ["--grouped-mm"]}
STEPS, MICRO_BATCHES, LAYERS = 3, 2, 2  # per run; micro-batches per step on each of the 2 ranks


def budget(site: str, moe: bool) -> int:
    unit, per, _ = ALLOWED[site]
    units = {
        "step": STEPS,
        "micro_batch": STEPS * MICRO_BATCHES,
        "layer_micro_batch": STEPS * MICRO_BATCHES * LAYERS,
        "moe_layer_micro_batch": STEPS * MICRO_BATCHES * LAYERS if moe else 0,
    }
    return per * units[unit]


def test_a_training_step_reads_nothing_from_the_device_but_the_allowed(tmp_path):
    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    moe = write_moe_config(os.path.join(tmp, "moe"))
    common = [config, "--train.max_steps", str(STEPS), "--train.log_steps", "1"]
    extra = {
        "dense": [],
        "moe": ["--model.config_path", moe],
        "moe_ep2": ["--model.config_path", moe, "--train.accelerator.extra_parallel_sizes", "2"]
        + ["--train.accelerator.extra_parallel_names", "ep"],
    }
    argv = []
    for name, flags in RUNS.items():
        out = os.path.join(tmp, name)
        argv += (["::"] if argv else []) + [f"{out}.json", *flags, *common, *extra[name]]
        argv += ["--train.checkpoint.output_dir", out]
    torchrun(os.path.join(REPO, "tests", "dist", "count_syncs.py"), argv, 2, timeout=600)
    for name in RUNS:
        result = json.load(open(os.path.join(tmp, f"{name}.json")))
        assert result["steps"] == STEPS
        metrics = [json.loads(line) for line in open(os.path.join(tmp, name, "metrics.jsonl"))]
        assert [m["step"] for m in metrics] == [1, 2, 3]  # every step's metrics were written (log_steps 1)
        events = result["events"]
        unexpected = {site: n for site, n in events.items() if site not in ALLOWED}
        assert not unexpected, f"{name}: host reads of device values per {STEPS} steps: {unexpected}"
        over = {s: (n, budget(s, "moe" in name)) for s, n in events.items() if n > budget(s, "moe" in name)}
        assert not over, f"{name}: over budget (count, budget): {over}"
        # the counter sees what it must: the expert-parallel split sizes are read once per layer and micro-batch
        ep_reads = events.get("veomni/ops/moe.py:_expert_parallel_mlp [tolist]", 0)
        assert ep_reads == (STEPS * MICRO_BATCHES * LAYERS if name == "moe_ep2" else 0), (name, ep_reads)
