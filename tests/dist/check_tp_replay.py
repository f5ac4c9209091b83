"""Tensor parallel gradients at the one-process run's weights, step by step; run by tests/test_tensor_parallel.py.

    torchrun --nproc_per_node=2 check_tp_replay.py OUT

A free-running tp 2 run leaves the one-process trajectory by more than 1e-5 within a few steps, and not for a bug:
AdamW's first updates, u(g) = g / (|g| + eps), turn float rounding in near-zero gradients into weight differences of
a whole learning rate. So here tp 2 replays the one-process trajectory: each rank trains an unsharded copy of the
model (the one-process reference, the same on both ranks: clipping, AdamW), and before every step copies that
copy's weights into the tp 2 model (built as check_tensor_parallel.py builds it: TP plan, then FSDP2), whose full
gradients before clipping are compared with the reference's parameter by parameter, on every rank (a replicated
gradient is each rank's own copy). Short documents (20..200 tokens, many packed in a row) and long ones (one per row),
real text and the demo tokenizer, per model family.

OUT/replay.json: {family: {kind: {"docs_per_row": [...], "steps": [{"loss_ref", "loss_tp", "grad_norm",
"params": {name: [max over ranks of ||g_tp,p - g_1,p||, ||g_1,p||]}}]}}} (float64); the test applies the bound.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from check_tensor_parallel import REPO, build, micro_loss, model_config
from torch.distributed.tensor import DTensor, distribute_tensor

from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from veomni.models import build_foundation_model
from veomni.ops import count_loss_tokens, shift_labels
from veomni.optim import build_optimizer

FAMILIES = ("qwen2", "llama", "qwen3")
STEPS, MICRO, ROW = 3, 1, 512  # per step MICRO micro-batches, each one packed row of up to ROW tokens
LR, MAX_NORM = 3e-3, 1.0


def documents(kind: str, tok) -> list:
    """short: the held-out text's paragraphs of 20..200 tokens; long: that text as one stream cut at ROW tokens."""
    with open(os.path.join(REPO, ".assets", "shakespeare", "valid.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    if kind == "short":
        docs = (tok(p)["input_ids"] + [tok.eos_token_id] for t in texts for p in t.split("\n\n"))
        return [d for d in docs if 20 <= len(d) <= 200]
    stream = [i for t in texts for i in tok(t)["input_ids"] + [tok.eos_token_id]]
    return [stream[i : i + ROW] for i in range(0, len(stream) - ROW + 1, ROW)]


def replay_steps(kind: str, tok):
    """STEPS global batches of MICRO rows; documents packed whole (position ids restart, first token unpredicted)."""
    rows, docs_per_row, row = [], [], []
    for doc in documents(kind, tok):
        if sum(map(len, row)) + len(doc) > ROW:
            rows.append(
                {
                    "input_ids": torch.tensor([sum(row, [])]),
                    "position_ids": torch.tensor([[i for d in row for i in range(len(d))]]),
                    "labels": shift_labels(torch.tensor([[x for d in row for x in [-100] + d[1:]]])),
                }
            )
            docs_per_row.append(len(row))
            row = []
            if len(rows) == STEPS * MICRO:
                break
        row.append(doc)
    assert len(rows) == STEPS * MICRO, f"{kind}: {len(rows)} rows of text, {STEPS * MICRO} needed"
    return [rows[i * MICRO : (i + 1) * MICRO] for i in range(STEPS)], docs_per_row


def gradients(model, batch):
    """Loss (sum over the batch / its loss tokens, as the trainer) and every parameter's full gradient; zeroes them."""
    total = sum(count_loss_tokens(mb["labels"]) for mb in batch)
    loss_sum = 0.0
    for mb in batch:
        loss = micro_loss(model, mb)
        (loss / total).backward()
        loss_sum += loss.item()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = g.detach().double()
    return loss_sum / total, grads


def replay(family: str, kind: str, steps, out: str) -> list:
    config = model_config(out, family, f"replay_{kind}")
    torch.manual_seed(0)
    ref = build_foundation_model(config_path=config, torch_dtype="float32", attn_implementation="veomni_varlen")
    ref_optimizer = build_optimizer(ref, lr=LR, weight_decay=0.01)
    model, _ = build(config)  # the tp 2 model (its optimizer unused: it takes the reference's weights every step)
    tp_params = dict(model.named_parameters())
    assert sorted(tp_params) == sorted(n for n, _ in ref.named_parameters())
    records = []
    for batch in steps:
        with torch.no_grad():  # the reference's weights, each rank its shard of them (no communication)
            for name, w in ref.named_parameters():
                p = tp_params[name]
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None).to_local())
                else:
                    p.copy_(w)
        loss_ref, g_ref = gradients(ref, batch)
        loss_tp, g_tp = gradients(model, batch)
        model.zero_grad(set_to_none=True)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in g_ref.values())).item()
        # each rank's own view (a replicated gradient is its local copy), the worst rank's difference kept
        diffs = torch.stack([(g_tp[n] - g).norm() for n, g in g_ref.items()])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        params = {n: [d, g.norm().item()] for (n, g), d in zip(g_ref.items(), diffs.tolist())}
        records.append({"loss_ref": loss_ref, "loss_tp": loss_tp, "grad_norm": norm, "params": params})
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
    return records


def main():
    from transformers import AutoTokenizer

    out = sys.argv[1]
    init_parallel_state(tp_size=2, dp_shard_size=int(os.environ["WORLD_SIZE"]) // 2)
    tok = AutoTokenizer.from_pretrained(os.path.join(REPO, ".assets", "tokenizer"))
    data = {kind: replay_steps(kind, tok) for kind in ("short", "long")}
    results = {}
    for family in FAMILIES:
        results[family] = {}
        for kind, (steps, docs_per_row) in data.items():
            results[family][kind] = {"docs_per_row": docs_per_row, "steps": replay(family, kind, steps, out)}
    if dist.get_rank() == 0:
        with open(os.path.join(out, "replay.json"), "w") as f:
            json.dump(results, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
