"""Validation (data.eval_path): the token-weighted loss of the held-out set equals transformers' loss over the same
documents one by one, and is the same on 1 and 2 ranks (an odd number of held-out micro-batches: a rank that has
run out joins the others' forwards with a masked batch); logged every eval_steps and after the last step. The demo
models evaluate to the same loss, perplexity and token count (1e-6, fp32) on one process and on 4 ranks under FSDP2,
Ulysses SP 2, TP 2 and EP 2 (one 4-rank launch evaluates the layouts in turn: tests/dist/trainer_scenarios.py
`evaluate`)."""

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import launch_sequence, read_metrics, run_text_tasks, tiny_run_config, torchrun, write_token_data
from veomni.utils.device import get_device  # noqa: F401  (the package imports before the helpers' runs)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = os.path.join(REPO, "tasks", "train_text.py")


def _reference_loss(hf_dir, path):
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for line in open(path):
            ids = torch.tensor([json.loads(line)["input_ids"]])
            loss = model(input_ids=ids, labels=ids).loss  # mean over the document's len - 1 predictions
            total, tokens = total + loss.item() * (ids.shape[1] - 1), tokens + ids.shape[1] - 1
    return total / tokens, tokens


def test_eval_loss_equals_transformers_and_is_the_same_on_1_and_2_ranks(tmp_path):
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=60, low=20, high=120)
    held_out = write_token_data(f"{tmp}/valid.jsonl", n=9, low=40, high=120, seed=7)  # 5 micro-batches: 3 + 2
    config = tiny_run_config(tmp)
    frozen = ["--train.optimizer.lr", "1e-20", "--train.optimizer.weight_decay", "0", "--train.max_steps", "2",
              "--train.dyn_bsz", "false", "--data.eval_path", held_out, "--train.eval_steps", "1",
              "--train.checkpoint.save_hf_weights", "true"]  # fmt: skip
    one = run_text_tasks(1, [(config, f"{tmp}/one", frozen)])[0]
    torchrun(TASK, [config, "--train.checkpoint.output_dir", f"{tmp}/two", *frozen], 2)
    two = read_metrics(f"{tmp}/two")
    expected, tokens = _reference_loss(f"{tmp}/one/hf", held_out)
    for metrics in (one, two):
        assert [m["step"] for m in metrics if "eval_loss" in m] == [1, 2]  # every step, and the last
        for m in metrics:
            assert m["eval_tokens"] == tokens
            assert abs(m["eval_loss"] - expected) <= 1e-5 * expected, (m["eval_loss"], expected)
    assert abs(one[-1]["eval_loss"] - two[-1]["eval_loss"]) <= 1e-6 * expected


def test_eval_runs_at_its_steps_and_after_the_last(tmp_path):
    tmp = str(tmp_path)
    held_out = write_token_data(f"{tmp}/valid.jsonl", n=5, low=40, high=100, seed=3)
    config = tiny_run_config(tmp)
    proc = torchrun(TASK, [config, "--train.checkpoint.output_dir", f"{tmp}/run", "--train.max_steps", "5",
                           "--data.eval_path", held_out, "--train.eval_steps", "2"], 2)  # fmt: skip
    metrics = read_metrics(f"{tmp}/run")
    assert [m["step"] for m in metrics if "eval_loss" in m] == [2, 4, 5]
    assert "step 5/5: eval loss" in proc.stdout
    losses = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert losses[-1] < losses[0]  # the model learns the held-out arithmetic runs too


# ------------------------------------------------------------------ parity over layouts (1 process vs 4 ranks)
EP2 = ["--train.accelerator.extra_parallel_sizes", "2", "--train.accelerator.extra_parallel_names", "ep"]
LAYOUTS = {  # name: (model, flags) of the 4-rank launch, each compared with its model on one process; its layout
    "dp4": ("dense", [], {"dp": 4, "sp": 1, "tp": 1, "ep": 1, "mesh_dims": ["dp_shard"]}),
    "sp2": (
        "dense",
        ["--train.accelerator.ulysses_size", "2"],
        {"dp": 2, "sp": 2, "tp": 1, "ep": 1, "mesh_dims": ["dp_shard_sp"]},
    ),
    "tp2": (
        "dense",
        ["--train.accelerator.tp_size", "2"],
        {"dp": 2, "sp": 1, "tp": 2, "ep": 1, "mesh_dims": ["dp_shard", "tp"]},
    ),
    "ep2": ("moe", EP2, {"dp": 4, "sp": 1, "tp": 1, "ep": 2, "mesh_dims": ["dp_shard", "ep", "ep_fsdp"]}),
}


def _eval_results(out):
    results = []
    for name in sorted(os.listdir(out)):
        if name.startswith("eval_rank"):
            with open(os.path.join(out, name)) as f:
                results.append(json.load(f))
    return results


def _demo_model(tmp, name, config):
    """The demo model's config with a 5x wider initialisation: its loss then follows the weights token by token
    (at the demo's 0.02 every token costs about log(vocab)), which is what a parity test needs to see."""
    with open(f"{REPO}/configs/model/{name}/config.json") as f:
        model = {**json.load(f), "initializer_range": 0.1}
    os.makedirs(f"{tmp}/{name}", exist_ok=True)
    with open(f"{tmp}/{name}/config.json", "w") as f:
        json.dump(model, f)
    return [f"{REPO}/configs/text/{config}.yaml", "--model.config_path", f"{tmp}/{name}"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The demo models (dense Qwen2, Qwen3-MoE) evaluated at their seeded initial weights, fp32: on one process,
    then in one 4-rank launch under every layout in turn. 13 held-out documents of one sample each: 7 micro-batches,
    so ranks run out at different times (4 data ranks: 2, 2, 2, 1; 2 data ranks: 4, 3) and join the others with
    masked batches."""
    from veomni.utils.demo_assets import ensure_demo_assets

    tmp = str(tmp_path_factory.mktemp("eval_layouts"))
    ensure_demo_assets(os.path.join(REPO, ".assets"), quiet=True)
    train = write_token_data(f"{tmp}/train.jsonl", n=16, low=20, high=100, vocab=4096)
    held_out = write_token_data(f"{tmp}/valid.jsonl", n=13, low=30, high=128, vocab=4096, seed=5)
    flags = ["--data.train_path", train, "--data.eval_path", held_out, "--data.max_seq_len", "128"]
    flags += ["--data.datasets_type", "mapping", "--train.micro_batch_size", "2", "--train.global_batch_size", "8"]
    flags += ["--train.dyn_bsz", "false", "--train.accelerator.fsdp_config.mixed_precision.enable", "false"]
    models = {
        "dense": _demo_model(tmp, "demo_qwen2", "demo"),
        "moe": _demo_model(tmp, "demo_qwen3_moe", "qwen3_moe_demo"),
    }
    launch_sequence(1, [("evaluate", models[m][0], f"{tmp}/one_{m}", models[m][1:] + flags) for m in models])
    runs = [(name, model, extra) for name, (model, extra, _) in LAYOUTS.items()]
    launch_sequence(4, [("evaluate", models[m][0], f"{tmp}/{name}", models[m][1:] + flags + x) for name, m, x in runs])
    reference = {m: _eval_results(f"{tmp}/one_{m}")[0] for m in models}
    reference["tokens"] = sum(len(json.loads(line)["input_ids"]) - 1 for line in open(held_out))
    return reference, {name: _eval_results(f"{tmp}/{name}") for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_loss_is_the_same_under_every_layout(layouts, layout):
    reference, results = layouts
    expected = reference[LAYOUTS[layout][0]]
    assert expected["eval_tokens"] == reference["tokens"]  # every held-out prediction once
    assert abs(expected["eval_loss"] - math.log(4096)) > 0.3  # the weights decide it, not a uniform guess
    assert len(results[layout]) == 4  # every rank returns the whole set's numbers
    for got in results[layout]:
        assert got["layout"] == LAYOUTS[layout][2]  # the sizes, and the mesh dims the parameters are sharded over
        assert got["eval_tokens"] == expected["eval_tokens"]
        for key in ("eval_loss", "eval_ppl"):
            assert abs(got[key] - expected[key]) <= 1e-6 * expected[key], (key, got[key], expected[key])
