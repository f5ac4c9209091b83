"""`python -m veomni.plan` against measurement: two torchrun launches (2 and 4 ranks, gloo) run one real step of
each layout on the demo models (tests/dist/check_plan.py) and count every collective and the tensor bytes of
parameters, gradients and optimizer state; the planner, on a fake world in this process, must predict them
exactly. Expert-parallel all-to-all bytes follow the router, so they are checked as their sum over the ep group
(per rank the planner assumes evenly spread tokens). The shape model used for the layout search must size shards
as the real plan does, up to 512 ranks.
"""

import json
import os

import pytest

from helpers import REPO, torchrun

CHECK = os.path.join(REPO, "tests", "dist", "check_plan.py")
DEMO, MOE = "configs/text/demo.yaml", "configs/text/qwen3_moe_demo.yaml"
EP2 = ["--train.accelerator.extra_parallel_sizes", "2", "--train.accelerator.extra_parallel_names", "ep"]
CKPT = ["--train.gradient_checkpointing.enable", "true"]
MB1 = ["--train.micro_batch_size", "1"]  # so that the demo's global batch splits over 4 data-parallel ranks
ACC = "--train.accelerator."
LAUNCHES = {
    2: {
        "fsdp2": [DEMO],
        "tp2": [DEMO, ACC + "tp_size", "2"],
        "sp2_ckpt": [DEMO, ACC + "ulysses_size", "2", *CKPT],
        "ep2": [MOE, *EP2],
    },
    4: {
        "hsdp2x2": [DEMO, ACC + "dp_replicate_size", "2", ACC + "dp_shard_size", "2", *MB1],
        "tp2dp2_ckpt": [DEMO, ACC + "tp_size", "2", *CKPT, *MB1],
        "ep2x2_ckpt": [MOE, *EP2, *CKPT, *MB1],
    },
}
ONE_STEP = ["--train.max_steps", "1", "--data.eval_path", "null", "--train.checkpoint.save_steps", "0"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the configs name their model and data relative to the repository


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from veomni.utils.demo_assets import ensure_demo_assets

    ensure_demo_assets(os.path.join(REPO, ".assets"), quiet=True)
    out = str(tmp_path_factory.mktemp("plan"))
    results = {}
    for world, runs in LAUNCHES.items():
        argv = []
        for name, run in runs.items():
            argv += (["::"] if argv else []) + [name, *run, *ONE_STEP, "--train.checkpoint.output_dir", f"{out}/{name}"]
        torchrun(CHECK, [out, *argv], world, timeout=400)
        for name in runs:
            results[name] = (world, [_read(out, name, r) for r in range(world)])
    return results


def _read(out, name, rank):
    with open(os.path.join(out, f"{name}.rank{rank}.json")) as f:
        return json.load(f)


def _predict(name, world, rank, measured_rank):
    from veomni.plan.comm import by_group, step_collectives
    from veomni.plan.real_plan import load_args, model_shape, plan_rank, step_shape

    argv = next(run for runs in LAUNCHES.values() for n, run in runs.items() if n == name)
    args = load_args([*argv, *ONE_STEP], world)
    plan = plan_rank(args, world, rank, device_type="cpu")
    micro_batches = [  # (tokens, loss tokens): the collator's labels are shifted, each one a target or -100
        (tokens, sum(label != -100 for label in labels))
        for tokens, labels in zip(measured_rank["tokens"], measured_rank["labels"])
    ]
    return plan, by_group(step_collectives(plan, model_shape(args), step_shape(args, micro_batches, "cpu")))


CASES = [(name, world) for world, runs in LAUNCHES.items() for name in runs]


@pytest.mark.parametrize("name,world", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_equal_measured(measured, name, world):
    world, ranks = measured[name]
    ep_totals = {}
    for rank, got in enumerate(ranks):
        plan, comm = _predict(name, world, rank, got)
        predicted = (plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes)
        assert predicted == (got["param_bytes"], got["grad_bytes"], got["optimizer_bytes"]), f"{name} rank {rank}"
        ep = plan.groups.get("ep")
        for key in set(comm) | set(got["comm"]):
            if ep and key == "all_to_all@" + ",".join(map(str, ep)):
                pair = ep_totals.setdefault(key, [0, 0])
                pair[0], pair[1] = pair[0] + comm.get(key, 0), pair[1] + got["comm"].get(key, 0)
                continue
            assert comm.get(key) == got["comm"].get(key), f"{name} rank {rank} {key}: predicted vs measured"
    for key, (predicted, counted) in ep_totals.items():
        assert predicted == counted and counted > 0, f"{name} {key} summed over the ep group"


@pytest.mark.parametrize(
    "config,world,sizes",
    [
        (DEMO, 4, dict(tp=2, dp_shard=2)),
        (DEMO, 512, dict(dp_shard=512)),
        (DEMO, 512, dict(dp_shard=128, dp_replicate=2, tp=2)),
        (DEMO, 8, dict(dp_shard=4, ulysses=2)),
        (MOE, 512, dict(dp_shard=256, dp_replicate=2, ep=8)),
    ],
)
def test_shape_model_sizes_shards_as_the_real_plan(config, world, sizes):
    from veomni.distributed.torch_parallelize import no_split_module_names
    from veomni.plan.analytic import Layout, ShapeModel
    from veomni.plan.real_plan import args_for_layout, load_args, plan_rank
    from veomni.trainer.base import build_model_from_args

    layout = Layout(world=world, **{"dp_replicate": 1, **sizes})
    args = args_for_layout(load_args([config], 1), layout)
    real = plan_rank(args, world, 0, "cuda")
    model = build_model_from_args(args, "cuda", "meta")
    shaped = ShapeModel(model, no_split_module_names(model), "adamw").rank_plan(layout, True)
    assert (real.param_bytes, real.grad_bytes, real.optimizer_bytes) == (
        shaped.param_bytes,
        shaped.grad_bytes,
        shaped.optimizer_bytes,
    )
    units = sorted((u.label, u.shard_size, u.replicate_size, u.padded_numel) for u in real.units)
    assert units == sorted((u.label, u.shard_size, u.replicate_size, u.padded_numel) for u in shaped.units)


def test_cli_plans_and_suggests_layouts(capsys):
    from veomni.plan.__main__ import main
    from veomni.plan.cost import GPUS
    from veomni.plan.measured import measured_mfu

    assert main([DEMO, "--nnodes", "2", "--nproc-per-node", "8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    # ranks predicted alike share one block (they were printed twice, identical)
    assert "ranks 0 and 15:" in out and "rank 0:" not in out and out.count("predicted peak") == 1
    # the demo's global batch does not split over 16 ranks: said as the trainer says it, not re-planned silently
    assert "THE TRAINER REFUSES THIS CONFIG ON 16 RANKS: train.global_batch_size=8 does not split over 16" in out
    # the MFU is the newest measured H100 record of the nearest benchmarked size, and stands by the throughputs
    mfu, source = measured_mfu("h100", 0.01, GPUS["h100"].tflops)
    assert source.startswith("measured: qwen3_0_6b") and 0.05 < mfu < 0.5
    assert f"MFU {mfu:.2f} ({source}; --mfu to assume another)" in out
    assert f"by predicted step time at MFU {mfu:.2f}" in out and f"at MFU {mfu:.2f} of 989 TFLOP/s" in out
    assert "all_gather      fsdp" in out and "layouts that fit" in out and "real plan" in out


def test_cli_plans_a_recipe_whose_config_needs_many_ranks(capsys):
    """The Qwen3-30B-A3B recipe asks for ep 8: its own sizes are read for the smallest world they fit (it failed
    when they were read for one rank)."""
    from veomni.plan.__main__ import main

    recipe = os.path.join(REPO, "configs", "text", "qwen3_moe_muon.yaml")
    assert main([recipe, "--nnodes", "2", "--nproc-per-node", "8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "all_to_all      ep" in out and "layouts that fit" in out


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node takes a count >= 1, got 0"),
        (["--nproc-per-node", "-4"], "--nproc-per-node takes a count >= 1, got -4"),
        (["--nnodes", "0"], "--nnodes takes a count >= 1, got 0"),
        (["--mfu", "1.5"], "--mfu takes a fraction in (0, 1], got 1.5"),
        (["--tokens", "0"], "--tokens takes a value > 0, got 0"),
        (["--train.no_such_key", "1"], "unknown key 'train.no_such_key'"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_flag(capsys, argv, said):
    """A bad planner flag or config key: one line on stderr naming it, exit 2, no traceback (the zero GPU count was
    a ZeroDivisionError, a negative one blamed train.global_batch_size, config errors came after 24-44 lines)."""
    from veomni.plan.__main__ import main

    assert main([DEMO, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m veomni.plan: ") and said in err[0], err


def test_the_default_mfu_is_the_newest_record_of_the_nearest_size(tmp_path):
    from veomni.plan.measured import MEASURED_FLOOR, measured_mfu

    rows = [
        {"kind": "step", "model": "qwen3_1_7b", "tokens": 8192, "flops": 2e14, "trainer_s": 1.0},  # 0.2 of 1000
        {"kind": "step", "model": "qwen3_4b", "tokens": 8192, "oom": True},
        {"kind": "step", "model": "qwen3_4b", "tokens": 8192, "mfu": 0.25},
        {"kind": "step", "model": "qwen3_4b", "tokens": 32768, "mfu": 0.27},  # newest of 4B
        {"kind": "loss", "model": "qwen3_8b", "mfu": 0.9},  # not a step record
    ]
    (tmp_path / "h100_2026-01-01.jsonl").write_text("{}\n")  # older file: not read
    (tmp_path / "h100_2026-02-01.jsonl").write_text("\n".join(map(__import__("json").dumps, rows)) + "\n")
    assert measured_mfu("h100", 8.2, 1000.0, str(tmp_path))[0] == 0.27
    assert measured_mfu("h100", 1.5, 1000.0, str(tmp_path)) == (
        0.2,
        "measured: qwen3_1_7b, 8,192 tokens a step, in benchmarks/results/h100_2026-02-01.jsonl",
    )
    assert measured_mfu("a100", 1.5, 312.0, str(tmp_path)) == (
        MEASURED_FLOOR,
        f"no benchmarks/results/a100_*.jsonl: assumed {MEASURED_FLOOR}",
    )
