"""Expert parallelism under hostile routing, trained for real (FSDP2, all-to-all), against one process.

The launches (each torchrun carries several checks):
  2 ranks     EP 2 (ep_fsdp 1)
  4 ranks     EP 2 x ep_fsdp 2
  1 process   the reference run (20 steps), then a resume of the 2-rank EP checkpoint (step 10 -> 20)
  2 ranks     the issue's repro: the MoE demo config, EP 2, short real documents (it used to hang)
Every training launch cycles the router through the cases of tests/dist/ep_forced_routing.py, one per step.
Micro-batches hold two documents, grouped differently on 1, 2 and 4 ranks: a load-balancing loss taken over a
micro-batch (rather than per document) shows up as a loss / grad-norm mismatch.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from helpers import (
    REPO,
    assert_close_series,
    child_env,
    launch_ranks,
    read_metrics,
    write_moe_config,
    write_tokenizer,
)
from veomni.models import build_foundation_model

CASES = ("one_expert", "receives_nothing", "sends_nothing", "natural")  # tests/dist/ep_forced_routing.py, in turn

SCRIPT = os.path.join(REPO, "tests", "dist", "ep_forced_routing.py")
STEPS, SAVE_AT, SEED = 20, 10, 0
EP = ["--train.accelerator.extra_parallel_sizes", "2", "--train.accelerator.extra_parallel_names", "ep"]


def _torchrun(nproc: int, *args: str, timeout: int) -> str:
    """Launch on `nproc` ranks; a run that outlives `timeout` (a hang) is killed with all its ranks and fails."""
    try:
        proc = launch_ranks([sys.executable, *args], nproc, child_env(), timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"hung: no exit within {timeout} s: {' '.join(args)}") from None
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-5000:]}"
    return proc.stdout


def _routing_data(path: str, n: int, vocab: int = 512) -> str:
    """Documents whose tokens are "low" (< vocab/2) or "high". The loader cuts its epoch-0 order (the seeded
    permutation below) into global steps of 8 documents, and each data rank takes a consecutive share: ranks 1 of
    2 get places 4..7, ranks 1 and 3 of 4 get places 2..3 and 6..7. Those are the ranks holding experts 4..7 (ep
    rank 1, ep innermost), so documents at places 2..7 of every step are high: every ep rank 1 holds only high
    documents, on 2 and on 4 ranks alike, and the first rank keeps low ones."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED)).tolist()
    place = {record: j for j, record in enumerate(order)}
    g = torch.Generator().manual_seed(1)
    half = vocab // 2
    with open(path, "w") as f:
        for record in range(n):
            low = 3 if place[record] % 8 < 2 else half
            length = int(torch.randint(12, 40, (1,), generator=g))
            start, stride = (
                int(torch.randint(0, half - 3, (1,), generator=g)),
                int(torch.randint(1, 4, (1,), generator=g)),
            )
            ids = [low + (start + i * stride) % (half - 3) for i in range(length)]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def _write_config(tmp: str) -> str:
    config = {
        "model": {
            "config_path": write_moe_config(f"{tmp}/model"),
            "tokenizer_path": write_tokenizer(f"{tmp}/tokenizer"),
            "ops_implementation": {"moe_implementation": "fused"},
        },
        "data": {"train_path": _routing_data(f"{tmp}/data.jsonl", 168), "max_seq_len": 64},
        "train": {
            "seed": SEED,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "dyn_bsz": False,
            "max_steps": STEPS,
            "optimizer": {"lr": 3e-3, "lr_warmup_ratio": 0.1, "lr_decay_style": "cosine", "weight_decay": 0.1},
            "checkpoint": {"output_dir": f"{tmp}/unused", "save_steps": SAVE_AT},
            "log_steps": 100,
        },
    }
    path = f"{tmp}/config.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def _train(config: str, nproc: int, out: str, *extra: str, timeout: int = 240):
    """One launch of the forced-routing trainer; returns each rank's routing report."""
    stdout = _torchrun(nproc, SCRIPT, config, "--train.checkpoint.output_dir", out, *extra, timeout=timeout)
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("ROUTING ")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three training launches; returns their output folders and the 2-/4-rank routing reports."""
    tmp = str(tmp_path_factory.mktemp("ep"))
    config = _write_config(tmp)
    out = {name: f"{tmp}/{name}" for name in ("one", "ep2", "ep2x2", "resumed")}
    routing = {"ep2": _train(config, 2, out["ep2"], *EP), "ep2x2": _train(config, 4, out["ep2x2"], *EP)}
    resume = ["--train.checkpoint.load_path", f"{out['ep2']}/checkpoints/global_step_{SAVE_AT}"]
    routing["one"] = _train(
        config, 1, out["one"], "::", config, "--train.checkpoint.output_dir", out["resumed"], *resume
    )
    return out, routing


@pytest.mark.parametrize("layout", ["ep2", "ep2x2"])
def test_forced_routing_trains_like_one_process(runs, layout):
    out, routing = runs
    one, ep = read_metrics(out["one"]), read_metrics(out[layout])
    assert len(one) == STEPS
    assert_close_series([m["loss"] for m in one], [m["loss"] for m in ep], 1e-5, "loss")
    assert_close_series([m["grad_norm"] for m in one], [m["grad_norm"] for m in ep], 1e-5, "grad_norm")

    # the cases really happened: ep rank 1 received nothing, and in "sends_nothing" kept all its rows
    reports = routing[layout]
    assert len(reports) == {"ep2": 2, "ep2x2": 4}[layout]
    for report in reports:
        stats, holder_of_4_to_7 = report["routing"], report["ep_rank"] == 1
        assert all(s["calls"] > 0 for s in stats.values())
        if holder_of_4_to_7:
            assert stats["receives_nothing"]["received"] == 0
            assert stats["sends_nothing"]["sent_away"] == 0 and stats["sends_nothing"]["received"] > 0
        assert stats["natural"]["received"] > 0
    rank0 = next(r for r in reports if r["rank"] == 0)
    assert rank0["routing"]["sends_nothing"]["received"] > 0  # rank 0 keeps its low documents' rows


def test_moe_metrics_count_each_routed_token_once_whatever_the_layout(runs):
    """The MoE metrics' per-expert counts (counted before the dispatch, summed over the step's micro-batches and
    ranks) are the same integers on 1 process, EP 2 and EP 2 x ep_fsdp 2; the forced cases show in the loads."""
    out, routing = runs
    one = routing["one"][0]["counts"]
    assert len(one) == STEPS
    for layout in ("ep2", "ep2x2"):
        for report in routing[layout]:
            assert report["counts"] == one, (layout, report["rank"])
    metrics = read_metrics(out["one"])
    for step, (counts, m) in enumerate(zip(one, metrics)):
        case = CASES[step % len(CASES)]
        assert all(sum(layer) == 2 * m["tokens"] for layer in counts)  # top-2: every token twice, no more
        assert abs(m["loss"] - (m["lm_loss"] + 0.01 * m["aux_loss"])) <= 1e-6 * m["loss"]
        if case == "one_expert":  # every token's first choice is expert 0, and no token picks expert 7
            assert all(layer[0] == m["tokens"] and layer[7] == 0 for layer in counts)
            assert m["moe_max_load"] == pytest.approx(4.0) and m["moe_min_load"] == 0  # 8 experts, top-2
        elif case == "receives_nothing":
            assert all(layer[4:] == [0, 0, 0, 0] for layer in counts) and m["moe_min_load"] == 0
    for layout in ("ep2", "ep2x2"):  # the aux loss and the LM loss apart, as on one process
        ep = read_metrics(out[layout])
        for key in ("aux_loss", "lm_loss", "moe_entropy", "moe_max_load"):
            assert_close_series([m[key] for m in metrics], [m[key] for m in ep], 1e-5, f"{layout} {key}")


def test_ep_checkpoint_resumes_on_one_process(runs):
    """Saved at step 10 by 2 EP ranks, continued by 1 process: steps 11..20 as if nothing had happened."""
    out, _ = runs
    resumed, one = read_metrics(out["resumed"]), read_metrics(out["one"])
    assert [m["step"] for m in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    assert_close_series([m["loss"] for m in one[SAVE_AT:]], [m["loss"] for m in resumed], 1e-5, "loss")
    assert_close_series([m["grad_norm"] for m in one[SAVE_AT:]], [m["grad_norm"] for m in resumed], 1e-5, "grad_norm")


def test_expert_parallel_refuses_eager_experts(tmp_path):
    from veomni.distributed.parallel_plan import apply_ep

    model = build_foundation_model(write_moe_config(str(tmp_path)), torch_dtype="float32", moe_implementation="eager")
    with pytest.raises(ValueError, match="expert parallel needs model.ops_implementation.moe_implementation=fused"):
        apply_ep(model, state=None)  # refused before any mesh is touched


def _short_real_documents(path: str) -> str:
    """The demo's Shakespeare, one paragraph per record: short real documents (a few to a few hundred tokens)."""
    import re

    from veomni.utils.demo_assets import ensure_demo_assets

    root = ensure_demo_assets(f"{REPO}/.assets", quiet=True)
    with open(f"{root}/shakespeare/valid.jsonl") as f, open(path, "w") as out:
        for line in f:
            for paragraph in re.split(r"\n\s*\n", json.loads(line)["text"]):
                if paragraph.strip():
                    out.write(json.dumps({"text": paragraph.strip()}) + "\n")
    return f"{root}/tokenizer"


def test_issue_repro_moe_demo_ep2_short_documents_does_not_hang(tmp_path):
    """configs/text/qwen3_moe_demo.yaml, EP 2 on 2 ranks, micro-batches of 2 short documents, 40 steps: before the
    fix a rank whose experts got no rows skipped its backward all-to-all, the ranks' collectives paired wrongly
    (the loss left the 2-rank FSDP run's at step 3) and the job hung (at step 9 of this 40-step schedule; a
    12-step schedule took a path that never hit it). The timeout turns a regression into a failure, not a stuck CI.
    """
    data = str(tmp_path / "short.jsonl")
    tokenizer = _short_real_documents(data)
    args = ["configs/text/qwen3_moe_demo.yaml", "--data.train_path", data, "--model.tokenizer_path", tokenizer]
    args += ["--data.max_seq_len", "2048", "--train.micro_batch_size", "2", "--train.global_batch_size", "4"]
    args += ["--train.dyn_bsz", "false", "--train.max_steps", "40", "--train.checkpoint.output_dir", str(tmp_path)]
    _torchrun(2, "tasks/train_text.py", *args, *EP, timeout=300)
    losses = [m["loss"] for m in read_metrics(str(tmp_path))]
    assert len(losses) == 40 and losses[-1] < losses[0]
