"""Packed tokens/s of build_dataset + build_dataloader (dyn_bsz packing), raw text and pre-tokenised.

    OMP_NUM_THREADS=2 python benchmarks/data_pipeline.py [--samples 20000] [--workers 0]

Data: `--samples` jsonl records of random length 50-2000 tokens cut from the demo's Shakespeare text (the
repo-built tokenizer), written once as raw text and once as `input_ids`. Loader: mapping dataset, micro-batch
token budget 4 x 2048, dyn_bsz, `--workers` workers. Printed per case: packed tokens/s and pack efficiency
(tokens / (micro-batches x budget)). Baselines measured in the same run: the same pipeline tokenising one record
at a time (as VeOmni's plaintext transform does), and the figure the project measured for VeOmni 0.1.12 on this
kind of box (2.2e5 packed tokens/s, raw text, mapping, dyn_bsz, 0 workers). Last, the resident memory of an
iterable (streaming) pass, sampled along the way, to show it stays flat.
"""

import argparse
import json
import os
import random
import sys
import time
from functools import partial

sys.path.insert(0, ".")
from veomni.data import build_dataloader, build_dataset  # noqa: E402
from veomni.data.data_transform import process_pretrain_example  # noqa: E402
from veomni.models import build_tokenizer  # noqa: E402
from veomni.utils.demo_assets import ensure_demo_assets  # noqa: E402

VEOMNI_0_1_12_TOKENS_PER_SEC = 2.2e5
MAX_SEQ_LEN, MICRO_BATCH = 2048, 4


def make_data(folder, tokenizer, n, seed=0):
    raw, tok = os.path.join(folder, "raw.jsonl"), os.path.join(folder, "tokens.jsonl")
    if os.path.isfile(raw) and os.path.isfile(tok):
        return raw, tok
    os.makedirs(folder, exist_ok=True)
    with open(".assets/shakespeare/train.jsonl") as f:
        corpus = tokenizer("\n\n".join(json.loads(line)["text"] for line in f), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    with open(raw, "w") as fr, open(tok, "w") as ft:
        for _ in range(n):
            length = rng.randint(50, 2000)
            start = rng.randrange(len(corpus) - length)
            ids = corpus[start : start + length]
            fr.write(json.dumps({"text": tokenizer.decode(ids)}) + "\n")
            ft.write(json.dumps({"input_ids": ids}) + "\n")
    return raw, tok


def _one_at_a_time(example, **kwargs):
    """The same transform without its batched form: one tokenizer call per record."""
    return process_pretrain_example(example, **kwargs)


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(path, tokenizer, kind="mapping", batched=True, workers=0, memory=False):
    fn = process_pretrain_example if batched else _one_at_a_time
    transform = partial(fn, tokenizer=tokenizer, max_seq_len=MAX_SEQ_LEN)
    tic = time.perf_counter()
    dataset = build_dataset(train_path=path, datasets_type=kind, transform=transform, seed=0)
    loader = build_dataloader(
        dataset=dataset,
        micro_batch_size=MICRO_BATCH,
        max_seq_len=MAX_SEQ_LEN,
        dyn_bsz=True,
        dataloader_batch_size=1,
        num_workers=workers,
        dp_rank=0,
        dp_size=1,
        drop_last=False,
    )
    loader.set_epoch(0)
    tokens = micro = 0
    rss = []
    for step in loader:
        for mb in step:
            tokens += mb["input_ids"].numel()
            micro += 1
        if memory and micro % 500 == 0:
            rss.append(rss_mb())
    elapsed = time.perf_counter() - tic
    return tokens / elapsed, tokens / (micro * MICRO_BATCH * MAX_SEQ_LEN), tokens, elapsed, rss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=0)
    a = parser.parse_args()
    ensure_demo_assets(".assets")
    tokenizer = build_tokenizer(".assets/tokenizer")
    raw, tok = make_data(f"outputs/bench_data_{a.samples}", tokenizer, a.samples)

    print(f"{a.samples} records, 50-2000 tokens each; budget {MICRO_BATCH}x{MAX_SEQ_LEN} tokens per micro-batch")
    results = {}
    for name, path, kwargs in [
        ("raw text, batched tokenisation", raw, {}),
        ("raw text, one record at a time", raw, {"batched": False}),
        ("pre-tokenised", tok, {}),
    ]:
        tps, eff, tokens, elapsed, _ = run(path, tokenizer, workers=a.workers, **kwargs)
        results[name] = tps
        print(f"{name:34s} {tps:11.0f} packed tokens/s  pack efficiency {eff:.4f}  ({tokens} tokens, {elapsed:.1f} s)")
    ours = results["raw text, batched tokenisation"]
    print(
        f"raw text: batched / one-at-a-time = {ours / results['raw text, one record at a time']:.2f}x; "
        f"vs VeOmni 0.1.12's measured {VEOMNI_0_1_12_TOKENS_PER_SEC:.1e} tokens/s = "
        f"{ours / VEOMNI_0_1_12_TOKENS_PER_SEC:.2f}x"
    )
    tps, eff, _, _, rss = run(tok, tokenizer, kind="iterable", workers=a.workers, memory=True)
    print(
        f"iterable (streaming), pre-tokenised: {tps:.0f} tokens/s, efficiency {eff:.4f}; resident memory along "
        f"the pass (MB): {', '.join(f'{r:.0f}' for r in rss)}"
    )


if __name__ == "__main__":
    main()
