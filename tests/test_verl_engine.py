"""verl's VeOmni engine (verl 0.9.1 from PyPI, unchanged) trains on this package: dense, FSDP2 over 2 ranks, Ulysses 2,
MoE with expert parallel 2, the critic, verl's offload and verl's checkpoint manager.

Every loss and grad norm verl returns is compared with a plain single-process torch reference on the unsharded
model (transformers' own class, fp32, AdamW, `clip_grad_norm_` over every parameter, experts included), not only
with verl's own one-process run. verl is installed beside this environment (tests/verl_site.py); the only addition
verl needs is a CPU platform (tests/dist/verl_engine_scenarios.py). Two launches: one process, then two ranks.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from verl_site import verl_site

from helpers import REPO, child_env, torchrun_cmd

SCENARIOS = os.path.join(REPO, "tests", "dist", "verl_engine_scenarios.py")
STEPS = 3
LR, CLIP, CLIPRANGE_VALUE = 1e-3, 1.0, 0.5
TOL = 1e-5  # relative, fp32


# ------------------------------------------------------------------------------------------------- assets
def _save_model(folder: str, config_dir: str, head: str = "causal", seed: int = 0) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(os.path.join(REPO, "configs", "model", config_dir))
    torch.manual_seed(seed)
    if head == "critic":  # what verl's critic builds: one value per token, untied
        config.num_labels, config.tie_word_embeddings = 1, False
        config.architectures = [f"{type(config).__name__.replace('Config', '')}ForTokenClassification"]
        model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def _batches(vocab: int, seed: int) -> list:
    """STEPS global batches of 4 sequences (prompt + response, loss on the response) with critic targets."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        batch = {"input_ids": [], "loss_mask": [], "prompt_len": [], "values": [], "returns": []}
        for _ in range(4):
            n = int(torch.randint(14, 40, (1,), generator=g))
            p = int(torch.randint(3, n - 4, (1,), generator=g))
            batch["input_ids"].append(torch.randint(0, vocab, (n,), generator=g).tolist())
            batch["loss_mask"].append([0] * p + [1] * (n - p))
            batch["prompt_len"].append(p)
            batch["values"].append((torch.randn(n - p, generator=g) * 0.5).tolist())
            batch["returns"].append(torch.randn(n - p, generator=g).tolist())
        batches.append(batch)
    return batches


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    out = {
        "dense": _save_model(str(root / "dense"), "demo_qwen3"),
        "moe": _save_model(str(root / "moe"), "demo_qwen3_moe"),
        "critic": _save_model(str(root / "critic"), "demo_qwen3", head="critic"),
        "root": str(root),
    }
    for name, vocab in (("dense", 151936), ("moe", 4096)):
        out[f"batches_{name}"] = str(root / f"batches_{name}.pt")
        torch.save(_batches(vocab, seed=1), out[f"batches_{name}"])
    return out


def _launch(nproc: int, runs: list, out: str) -> dict:
    """All runs of one world size in one launch: starting verl (ray, tensordict, ...) costs seconds per process."""
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([REPO, verl_site(), env.get("PYTHONPATH", "")])
    plan = out + ".plan.json"
    with open(plan, "w") as f:
        json.dump({"runs": runs}, f)
    args = [SCENARIOS, plan, out]
    cmd = [sys.executable, *args] if nproc == 1 else torchrun_cmd(nproc, "--master_port=0", *args)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:  # the ranks' own errors first: torchrun's summary at the end says only that one failed
        errors = [line for line in proc.stderr.splitlines() if "Error" in line and "Warning" not in line]
        raise AssertionError(f"{' '.join(cmd)} failed:\n" + "\n".join(errors[:20]) + f"\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def one_process(assets):
    """verl on one process: dense, dense with verl's offload between steps, MoE (ep 1), the critic."""
    dense = {"kind": "lm", "model": assets["dense"], "batches": assets["batches_dense"], "steps": STEPS}
    runs = [
        {"name": "dense", **dense},
        {"name": "dense_offload", **dense, "param_offload": True, "offload_before": [1, 2]},
        {"name": "critic", **dense, "kind": "critic", "model": assets["critic"], "steps": 2},
        {"name": "moe_ep1", **dense, "model": assets["moe"], "batches": assets["batches_moe"]},
    ]
    return _launch(1, runs, os.path.join(assets["root"], "one.json"))


@pytest.fixture(scope="module")
def two_ranks(assets):
    """verl on two ranks: FSDP2 (with a checkpoint saved after step 1 and resumed), Ulysses 2, MoE with EP 2."""
    checkpoint = {"dir": os.path.join(assets["root"], "ckpt"), "save_after": 1}
    dense = {"kind": "lm", "model": assets["dense"], "batches": assets["batches_dense"], "steps": STEPS}
    runs = [
        {"name": "fsdp2", **dense, "checkpoint": checkpoint},
        {"name": "ulysses2", **dense, "ulysses": 2},
        {"name": "moe_ep2", **dense, "model": assets["moe"], "batches": assets["batches_moe"], "ep": 2},
    ]
    return _launch(2, runs, os.path.join(assets["root"], "two.json"))


# ---------------------------------------------------------------------------------------------- reference
def _step(model, optimizer, loss) -> float:
    """backward, then torch's clip_grad_norm_ in its two halves with the norm taken over float64 copies: torch's fp32
    norm of a 10M-value gradient on CPU sums without cascading and is itself off by ~1e-5 relative."""
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([g.double() for g in grads])
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), CLIP, norm)
    optimizer.step()
    optimizer.zero_grad()
    return norm.item()


def _reference(folder: str, batches: list, steps: int, critic: bool = False) -> list:
    """(loss, grad norm) per step of plain torch on one process: the HF class, one sequence at a time, AdamW."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out = []
    for batch in batches[:steps]:
        tokens = sum(sum(mask) for mask in batch["loss_mask"])
        loss = 0.0
        for i, ids in enumerate(batch["input_ids"]):
            ids = torch.tensor(ids)
            if critic:  # verl's clipped value loss; the value of token t is read at t - 1
                p = batch["prompt_len"][i]
                v = model(ids[None]).logits[0, p - 1 : len(ids) - 1, 0]
                old, ret = torch.tensor(batch["values"][i]), torch.tensor(batch["returns"][i])
                clipped = torch.clamp(v, old - CLIPRANGE_VALUE, old + CLIPRANGE_VALUE)
                loss = loss + 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2).sum() / tokens
            else:
                mask = torch.tensor(batch["loss_mask"][i][1:], dtype=torch.float32)
                logp = torch.log_softmax(model(ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
                loss = loss - (logp * mask).sum() / tokens
        out.append((loss.item(), _step(model, optimizer, loss)))
    return out


@pytest.fixture(scope="module")
def reference(assets):
    dense = torch.load(assets["batches_dense"])
    return {
        "dense": _reference(assets["dense"], dense, STEPS),
        "moe": _reference(assets["moe"], torch.load(assets["batches_moe"]), STEPS),
        "critic": _reference(assets["critic"], dense, 2, critic=True),
    }


# ------------------------------------------------------------------------------------------------- checks
def _close(a: float, b: float, what: str) -> None:
    assert abs(a - b) <= TOL * max(abs(a), abs(b)), f"{what}: verl {a!r} vs reference {b!r}"


def _loss_and_norm(step: list) -> tuple:
    """verl's loss of one step (the mean over ranks of each rank's micro-batch losses, which verl scales by the data
    parallel size) and its grad norm (reported by the ranks that hold outputs, all equal)."""
    losses = [sum(rank["loss"]) for rank in step]
    norms = {rank["grad_norm"] for rank in step if rank["grad_norm"] is not None}
    assert len(norms) == 1, f"ranks report different grad norms: {norms}"
    return sum(losses) / len(losses), norms.pop()


def _check_run(steps: list, expected: list, what: str) -> None:
    assert len(steps) == len(expected)
    for i, (step, (ref_loss, ref_norm)) in enumerate(zip(steps, expected)):
        loss, norm = _loss_and_norm(step)
        _close(loss, ref_loss, f"{what} loss at step {i + 1}")
        _close(norm, ref_norm, f"{what} grad norm at step {i + 1}")


def test_dense_on_one_process_matches_plain_torch(one_process, reference):
    _check_run(one_process["dense"]["steps"], reference["dense"], "dense, 1 process")


def test_fsdp2_on_two_ranks_matches_plain_torch(two_ranks, reference):
    _check_run(two_ranks["fsdp2"]["steps"], reference["dense"], "FSDP2, 2 ranks")


def test_ulysses_2_matches_plain_torch_on_every_rank(two_ranks, reference):
    steps = two_ranks["ulysses2"]["steps"]
    _check_run(steps, reference["dense"], "Ulysses 2")
    for i, step in enumerate(steps):  # both sequence-parallel ranks return the whole sequence's loss
        for rank in step:
            _close(sum(rank["loss"]), reference["dense"][i][0], f"Ulysses 2 rank loss at step {i + 1}")


def test_verl_offload_to_cpu_and_back_leaves_the_next_steps_bit_identical(one_process):
    assert one_process["dense_offload"]["steps"] == one_process["dense"]["steps"]


def test_moe_with_expert_parallel_2_matches_ep_1_and_plain_torch(one_process, two_ranks, reference):
    _check_run(one_process["moe_ep1"]["steps"], reference["moe"], "MoE, ep 1")
    _check_run(two_ranks["moe_ep2"]["steps"], reference["moe"], "MoE, ep 2")
    for i, (ep1, ep2) in enumerate(zip(one_process["moe_ep1"]["steps"], two_ranks["moe_ep2"]["steps"])):
        _close(_loss_and_norm(ep2)[1], _loss_and_norm(ep1)[1], f"MoE grad norm ep 2 vs ep 1 at step {i + 1}")


def test_critic_value_head_matches_plain_torch(one_process, reference):
    _check_run(one_process["critic"]["steps"], reference["critic"], "critic")


def test_verl_checkpoint_save_then_load_resumes_bit_identically(two_ranks):
    fsdp2 = two_ranks["fsdp2"]
    assert fsdp2["resumed"] == fsdp2["steps"][1:], "resumed steps differ from the uninterrupted run"
