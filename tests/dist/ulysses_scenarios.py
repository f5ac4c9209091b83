"""Under torchrun: several Ulysses checks in one launch (each launch costs seconds of start-up on 2 cores).

argv: plan.json, a list of steps run in order, each one of
  {"kind": "attention"}                      the Ulysses wrapper around veomni_varlen / sdpa / eager vs full attention
  {"kind": "train", "argv": [...]}           a TextTrainer on one process's global batches (SameGlobalBatches);
                                             "steps": n stops it after n steps (the LR schedule still spans argv's)
  {"kind": "load", "argv": [...], "like": i} build a trainer that resumes a checkpoint (argv's load_path), and
                                             compare its model and optimizer state with train step i's final state
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from veomni.arguments import VeOmniArguments, parse_args
from veomni.distributed import destroy_parallel_state, init_parallel_state
from veomni.ops.attention import varlen_attention_forward
from veomni.trainer import TextTrainer
from veomni.verify.harness import ProbedTrainer as Trainer
from veomni.verify.harness import full as _full


def final_state(trainer) -> dict:
    """Every parameter and AdamW moment, unsharded (a few MB for the demo model)."""
    params = dict(trainer.model.named_parameters())
    state = {f"param/{n}": _full(p.detach()).clone() for n, p in params.items()}
    for n, p in params.items():
        for key, value in trainer.optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[f"optim/{n}/{key}"] = _full(value).clone()
    return state


class _Attention(torch.nn.Module):
    """What the attention interface reads from a module: config, GQA groups, flags."""

    def __init__(self, config, heads, kv_heads):
        super().__init__()
        self.config, self.num_key_value_groups, self.is_causal = config, heads // kv_heads, True


def check_attention_wrappers() -> None:
    """Ulysses around three inner kernels (varlen, sdpa with the mask built here, the model's eager) equals full
    packed attention, forward and backward, on an uneven multi-document row, for GQA with KV heads that do not
    split over sp: fewer KV heads than sp (4 heads : 1), and 6 : 3 over 2, where each rank must get the copies of
    its own query groups' KV heads (a wrong copy order fails here)."""
    state = init_parallel_state(ulysses_size=int(os.environ["WORLD_SIZE"]))
    for heads, kv_heads in ((4, 1), (6, 3)):
        check_attention(state, heads, kv_heads)


def check_attention(state, heads: int, kv_heads: int) -> None:
    from transformers import AutoConfig

    from veomni.distributed.sequence_parallel.ulysses import ulysses_attention_forward, ulysses_name

    sp, rank = state.sp_size, state.sp_rank
    dim = 8
    lengths = [5, 17, 3, 11, 4]  # 40 tokens: a document straddles every shard border
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, total, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(1, total, heads, dim, generator=g)
    config = AutoConfig.for_model("qwen2", num_attention_heads=heads, num_key_value_heads=kv_heads)
    config._attn_implementation = "veomni_varlen"
    module = _Attention(config, heads, kv_heads)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = varlen_attention_forward(module, *ref_in, None, scaling=dim**-0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    (ref * grad_out).sum().backward()
    shard = slice(rank * total // sp, (rank + 1) * total // sp)
    import transformers.models.qwen2.modeling_qwen2 as qwen2_modeling

    module.__class__ = type("Qwen2Attention", (_Attention,), {"__module__": qwen2_modeling.__name__})
    for inner in ("veomni_varlen", "sdpa", "eager"):
        config._attn_implementation = ulysses_name(inner)
        mine = [t[:, :, shard].clone().requires_grad_() for t in (q, k, v)]
        kwargs = {"position_ids": position_ids[:, shard]}
        if inner == "veomni_varlen":  # the others find the documents from the gathered position ids
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        out, _ = ulysses_attention_forward(module, *mine, None, scaling=dim**-0.5, **kwargs)
        (out * grad_out[:, shard]).sum().backward()
        err = (out - ref[:, shard]).abs().max().item()
        # the exchanges' backward brings every rank's contribution home: each shard's gradient is complete
        gerr = max((t.grad - r.grad[:, :, shard]).abs().max().item() for t, r in zip(mine, ref_in))
        what = f"ulysses around {inner}, {heads}:{kv_heads} heads"
        assert err < 1e-6 and gerr < 1e-5, f"{what}: output error {err:.2e}, grad error {gerr:.2e}"
        if rank == 0:
            report = {"attention": inner, "heads": heads, "kv_heads": kv_heads, "max_err": err, "grad_err": gerr}
            print(json.dumps(report), flush=True)


def main():
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    finals = {}
    try:
        for i, step in enumerate(plan):
            if step["kind"] == "attention":
                check_attention_wrappers()
                continue
            tic, cpu = time.perf_counter(), time.process_time()
            args = parse_args(VeOmniArguments, step["argv"])
            if step["kind"] == "train":
                trainer = Trainer(args)
                trainer.total_steps = step.get("steps", trainer.total_steps)
                trainer.fit()
                finals[i] = final_state(trainer)
            else:  # load: the constructor resumes from args.train.checkpoint.load_path
                trainer = TextTrainer(args)
                got, want = final_state(trainer), finals[step["like"]]
                assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
                worst = max((got[k] - want[k]).abs().max().item() for k in want)
                assert worst == 0.0, f"state loaded across layouts differs by {worst}"
                if dist.get_rank() == 0:
                    print(json.dumps({"loaded": len(want), "max_diff": worst}), flush=True)
            del trainer
            if dist.get_rank() == 0:  # where a launch's time goes (CI budget)
                took = {"wall_s": time.perf_counter() - tic, "cpu_s": time.process_time() - cpu}
                print(json.dumps({"timing": i, **{k: round(v, 2) for k, v in took.items()}}), flush=True)
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
