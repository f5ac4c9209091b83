"""MoE figures: fused vs eager experts step time, and moe_merge's peak memory against the checkpoint size.

    OMP_NUM_THREADS=2 python benchmarks/moe.py

1. A tiny Qwen3-MoE (E=8, top-2, hidden 256, 4 layers) forward + backward on 4096 tokens, eager (transformers'
   loop over experts with one-hot masks) vs fused (veomni: tokens sorted by expert, one matmul pair per expert);
   the median of 10 timed steps each, same process.
   The same with many narrow experts (E=64, top-8), where per-expert bookkeeping weighs more.
2. Multi-shard per-expert checkpoints (8 and 16 layers of 32 experts, fp32, 40 MB shards) merged in a fresh
   process: resident memory sampled during the merge, against the checkpoint size.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")
from veomni.models import build_foundation_model  # noqa: E402


def moe_config(folder, **kw):
    import json

    cfg = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_cache=False,
        tie_word_embeddings=False,
    )
    cfg.update(kw)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def step_times(folder, impl, steps=10, warmup=2):
    torch.manual_seed(0)
    model = build_foundation_model(folder, torch_dtype="float32", moe_implementation=impl)
    ids = torch.randint(0, 4096, (4, 1024), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + warmup):
        tic = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if i >= warmup:
            times.append(time.perf_counter() - tic)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def experts_only(folder, impl, tokens=4096, steps=10):
    """The first layer's experts module alone, fwd + bwd, on router-like random assignments."""
    torch.manual_seed(0)
    model = build_foundation_model(folder, torch_dtype="float32", moe_implementation=impl)
    experts = model.model.layers[0].mlp.experts
    k = model.config.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, model.config.hidden_size, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(experts.num_experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    times = []
    for i in range(steps + 2):
        tic = time.perf_counter()
        experts(x, idx, w).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - tic)
    return statistics.median(times)


SAMPLER = """
import os, threading, time
page = os.sysconf("SC_PAGE_SIZE") / 2**20
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
start, peak, done = rss(), [0.0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
"""


def rss_during(setup, work):
    """Resident memory before `work` (after `setup`) and its peak while `work` runs, in a fresh process."""
    code = f"{setup}\n{SAMPLER}\n{work}\ndone[0] = True\nprint('RSS', start, max(peak[0], rss()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    start, peak = out.stdout.split("RSS")[-1].split()
    return float(start), float(peak)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        folder = moe_config(os.path.join(tmp, "tiny"))
        eager, fused = step_times(folder, "eager"), step_times(folder, "fused")
        print(
            f"tiny Qwen3-MoE (E=8, top-2), 4096 tokens fwd+bwd: eager {eager * 1e3:.0f} ms, fused {fused * 1e3:.0f} ms,"
            f" fused speed-up {eager / fused:.2f}x"
        )
        eager, fused = experts_only(folder, "eager"), experts_only(folder, "fused")
        print(
            f"  experts module alone (E=8, top-2): eager {eager * 1e3:.1f} ms, fused {fused * 1e3:.1f} ms, "
            f"speed-up {eager / fused:.2f}x"
        )
        many = moe_config(os.path.join(tmp, "many"), num_experts=64, num_experts_per_tok=8, moe_intermediate_size=64)
        eager, fused = step_times(many, "eager"), step_times(many, "fused")
        print(
            f"Qwen3-MoE with E=64, top-8 (expert width 64), 4096 tokens fwd+bwd: eager {eager * 1e3:.0f} ms, "
            f"fused {fused * 1e3:.0f} ms, fused speed-up {eager / fused:.2f}x"
        )
        eager, fused = experts_only(many, "eager"), experts_only(many, "fused")
        print(
            f"  experts module alone (E=64, top-8): eager {eager * 1e3:.1f} ms, fused {fused * 1e3:.1f} ms, "
            f"speed-up {eager / fused:.2f}x"
        )

        from transformers import AutoConfig, AutoModelForCausalLM

        for layers in (8, 16):  # twice the model, same shards: the peak should not follow the size
            big = moe_config(
                os.path.join(tmp, f"big{layers}"),
                hidden_size=512,
                moe_intermediate_size=256,
                num_experts=32,
                num_hidden_layers=layers,
            )
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(big))
            model.save_pretrained(big, max_shard_size="40MB")
            del model
            files = [f for f in os.listdir(big) if f.endswith(".safetensors")]
            total = sum(os.path.getsize(os.path.join(big, f)) for f in files) / 2**20
            largest = max(os.path.getsize(os.path.join(big, f)) for f in files) / 2**20
            setup = (
                "import sys; sys.path.insert(0, '.'); from veomni.checkpoint.moe_conversion import merge_moe_checkpoint"
            )
            base, peak = rss_during(setup, f"merge_moe_checkpoint({big!r}, {os.path.join(tmp, f'merged{layers}')!r})")
            print(
                f"moe_merge, {layers} layers: {len(files)} shards, {total:.0f} MB (largest shard {largest:.0f} MB, "
                f"one layer's experts {32 * 3 * 512 * 256 * 4 / 2**20:.0f} MB): resident memory {base:.0f} MB before, "
                f"{peak:.0f} MB at peak: +{peak - base:.0f} MB = {(peak - base) / total:.2f} of the checkpoint"
            )


if __name__ == "__main__":
    main()
