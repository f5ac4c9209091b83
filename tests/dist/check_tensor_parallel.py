"""Tensor parallel vs one process on the demo models and real text; run by tests/test_tensor_parallel.py.

    torchrun --nproc_per_node=4 check_tensor_parallel.py OUT tp2dp2    TP runs, checkpoint at step 5, HF export
    python check_tensor_parallel.py OUT single                          reference runs, resume of that checkpoint
    torchrun --nproc_per_node=2 check_tensor_parallel.py OUT tp2        TP runs, resume of that checkpoint

Each writes OUT/<mode>.json: per model family the loss and grad norm of every step (and of the resumed steps); the
test compares them. The loop is the trainer's: packed rows through veomni_varlen, chunked vocab-parallel loss,
sum / global loss tokens * dp_size, float64 grad-norm clipping, AdamW; FSDP2 over dp_shard on top of TP.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from veomni.checkpoint import Checkpointer, save_hf_model
from veomni.distributed import clip_grad_norm
from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from veomni.distributed.torch_parallelize import build_parallelize_model
from veomni.models import build_foundation_model
from veomni.ops import CausalLMLoss, count_loss_tokens, shift_labels
from veomni.optim import build_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, SAVE_AT, ROW, ROWS_PER_STEP, CHUNK = 10, 5, 256, 2, 256
FAMILIES = ("qwen2", "llama")
QWEN3_STEPS = 6  # Qwen3 (per-head q/k norms, whose weight gradients TP must sum over heads): tp 2 only, a few steps


def model_config(out: str, family: str, mode: str) -> str:
    """The demo Qwen2 (tied embeddings) as is, a Llama of the same size with an untied head, and a Qwen3."""
    with open(os.path.join(REPO, "configs", "model", "demo_qwen2", "config.json")) as f:
        config = json.load(f)
    if family == "qwen3":
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=64)
    if family == "llama":
        config.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
    folder = os.path.join(out, f"config_{family}_{mode}")  # runs of different modes may share `out` at once
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    dist.barrier()
    return folder


def shakespeare_steps():
    """STEPS global batches of ROWS_PER_STEP packed rows of ROW tokens from the demo text, documents cut at ROW."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(REPO, ".assets", "tokenizer"))
    rows, ids, pos, labels = [], [], [], []
    with open(os.path.join(REPO, ".assets", "shakespeare", "train.jsonl")) as f:
        for line in f:
            doc = (tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id])[: ROW // 2]
            if len(ids) + len(doc) > ROW:
                rows.append({"input_ids": ids, "position_ids": pos, "labels": labels})
                ids, pos, labels = [], [], []
                if len(rows) == STEPS * ROWS_PER_STEP:
                    break
            ids, pos = ids + doc, pos + list(range(len(doc)))
            labels = labels + [-100] + doc[1:]  # a document's first token is not predicted from the previous one
    rows = [{k: torch.tensor([v]) for k, v in row.items()} for row in rows]
    rows = [dict(row, labels=shift_labels(row["labels"])) for row in rows]  # as the collator yields them
    return [rows[i * ROWS_PER_STEP : (i + 1) * ROWS_PER_STEP] for i in range(STEPS)]


def build(config_dir: str):
    torch.manual_seed(0)
    model = build_foundation_model(config_path=config_dir, torch_dtype="float32", attn_implementation="veomni_varlen")
    model = build_parallelize_model(model, basic_modules=list(model._no_split_modules))
    optimizer = build_optimizer(model, lr=3e-3, weight_decay=0.01)
    return model, optimizer


def micro_loss(model, mb, chunk: int = CHUNK) -> torch.Tensor:
    inputs = {k: v for k, v in mb.items() if k != "labels"}
    return CausalLMLoss(model, chunk)(mb["labels"], **inputs, use_cache=False).loss_sum


def train(model, optimizer, steps, state, first: int, last: int, checkpointer=None):
    losses, norms = [], []
    for step in range(first, last + 1):
        batch = steps[step - 1]
        total = sum(count_loss_tokens(mb["labels"]) for mb in batch)
        mine = batch[state.dp_rank :: state.dp_size]  # ranks of one tp group take the same rows
        loss_sum = torch.zeros((), dtype=torch.float64)
        for mb in mine:
            loss = micro_loss(model, mb)
            (loss * state.dp_size / total).backward()
            loss_sum += loss.detach().double()
        norms.append(clip_grad_norm(model, 1.0))
        dist.all_reduce(loss_sum, group=state.dp_group)
        losses.append(loss_sum.item() / total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if checkpointer is not None and step == SAVE_AT:
            checkpointer.save(step, model, optimizer, {}, {})
    return {"loss": losses, "grad_norm": norms}


def export_check(model, steps, out: str, family: str) -> dict:
    """Logits of the sharded model vs the HF export reloaded in one process; chunked vs full-logit loss."""
    mb = steps[0][0]
    inputs = {k: v for k, v in mb.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
        full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        chunked, plain = micro_loss(model, mb).item(), micro_loss(model, mb, chunk=0).item()
    folder = os.path.join(out, f"hf_{family}")
    save_hf_model(model, folder)
    result = {"chunked_vs_full_logits_loss": abs(chunked - plain) / abs(plain)}
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="veomni_varlen")
        with torch.no_grad():
            reloaded = hf(**inputs, use_cache=False).logits
        result["export_logits_max_abs_diff"] = (reloaded - full).abs().max().item()
        result["tied"] = hf.lm_head.weight is hf.model.embed_tokens.weight
    return result


def main():
    out, mode = sys.argv[1], sys.argv[2]
    tp = {"tp2dp2": 2, "tp2": 2, "single": 1}[mode]
    state = init_parallel_state(tp_size=tp, dp_shard_size=int(os.environ.get("WORLD_SIZE", 1)) // tp)
    steps = shakespeare_steps()
    ckpt_dir = os.path.join(out, "ckpt_qwen2")
    results = {}
    for family in FAMILIES + (("qwen3",) if mode != "tp2dp2" else ()):
        config = model_config(out, family, mode)
        model, optimizer = build(config)
        saver = Checkpointer(ckpt_dir) if mode == "tp2dp2" and family == "qwen2" else None
        results[family] = train(model, optimizer, steps, state, 1, QWEN3_STEPS if family == "qwen3" else STEPS, saver)
        if mode == "tp2dp2" and family == "qwen2":  # tied embeddings: the harder export
            results[family].update(export_check(model, steps, out, family))
        if mode != "tp2dp2" and family == "qwen2":  # resume the tp2 x dp2 checkpoint here, continue to the end
            model, optimizer = build(config)
            Checkpointer(ckpt_dir).load(
                os.path.join(ckpt_dir, "checkpoints", f"global_step_{SAVE_AT}"), model, optimizer
            )
            results[family]["resumed"] = train(model, optimizer, steps, state, SAVE_AT + 1, STEPS)
        del model, optimizer
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(results, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
