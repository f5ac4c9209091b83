"""Start-up time of a run whose sample cache is already built ("second run"), with a 2 GB and a 20 GB cache.

    python benchmarks/data_cache_startup.py [--sizes-gb 2 20] [--folder /tmp/veomni-cache-startup] [--keep]

The caches are written synthetically at the token level, in the cache's own format, under the key the real dataset
computes (a small jsonl stands for the data; its records point into the token files), so the timed process opens
them exactly as training does. Two shapes per size: the same number of samples with 10x the tokens each (what grows
is the token files only) and the same sample length with 10x the samples (the index arrays and the batch plan grow
too). Timed in fresh processes: `imports`, `open` (build_dataset and the
cache's opening checks), `plan` (build_dataloader and the epoch's step count; the first run plans and keeps the plan
beside the cache, later runs read it), `first batch`; the fastest of three fresh processes after a first one. For
reference, the time to read every token file once: what the opening check did before chunks were verified as read.
Check disk space first (the largest cache is on disk at a time); each is removed after its timing unless --keep.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, ".")

BLOCK = 64 << 20  # one random block, written again and again (its chunk checksums computed once)

CHILD = r"""
import sys, time
t0 = time.perf_counter()
sys.path.insert(0, ".")
from functools import partial
from veomni.data import build_dataloader, build_dataset
from veomni.data.data_transform import process_pretrain_example
import veomni.distributed.parallel_state  # (build_dataloader reads the parallel state: its import is not start-up)
data, cache, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
t1 = time.perf_counter()
dataset = build_dataset(train_path=data, datasets_type="mapping", seed=0, cache_dir=cache,
                        transform=partial(process_pretrain_example, tokenizer=None, max_seq_len=max_len))
dataset.prepare()
t2 = time.perf_counter()
loader = build_dataloader(dataset=dataset, micro_batch_size=1, max_seq_len=max_len, dyn_bsz=False,
                          dataloader_batch_size=4, dp_rank=0, dp_size=1, drop_last=False)
loader.set_epoch(0)
steps = loader.num_batches()
t3 = time.perf_counter()
tokens = sum(mb["input_ids"].numel() for mb in next(iter(loader)))
t4 = time.perf_counter()
print(f"TIMES {t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f} {t4 - t3:.3f} {steps} {tokens}")
"""


def write_cache(folder: str, data: str, samples: int, tokens_per_sample: int) -> int:
    """A token-mode cache of `samples` samples under the key of the dataset over `data`; returns its bytes."""
    from functools import partial

    from veomni.data import build_dataset, cache_writer, sample_cache
    from veomni.data.data_transform import process_pretrain_example

    with open(data, "w") as f:  # the stand-in data: one short record per sample (the key is computed from it)
        for i in range(samples):
            f.write(json.dumps({"input_ids": [i % 1000 + 3, 7]}) + "\n")
    dataset = build_dataset(
        train_path=data, datasets_type="mapping", seed=0, cache_dir=folder,
        transform=partial(process_pretrain_example, tokenizer=None, max_seq_len=tokens_per_sample),
    )  # fmt: skip
    target, parts = sample_cache._key(dataset, folder, dataset.name)
    os.makedirs(target)
    total = samples * tokens_per_sample * 4
    block = np.random.default_rng(0).integers(3, 50_000, BLOCK // 4, dtype=np.int32).tobytes()
    chunk = cache_writer.CHUNK_BYTES
    block_crcs = [zlib.crc32(block[c : c + chunk]) for c in range(0, BLOCK, chunk)]
    crcs, written = [], 0
    with open(os.path.join(target, "part-00000.input_ids.bin"), "wb") as f:
        while written < total:
            piece = block[: min(BLOCK, total - written)]
            f.write(piece)
            crcs += (
                block_crcs
                if len(piece) == BLOCK
                else [zlib.crc32(piece[c : c + chunk]) for c in range(0, len(piece), chunk)]
            )
            written += len(piece)
    lengths = np.full(samples, tokens_per_sample, dtype=np.int32)
    records = np.stack([np.zeros(samples, np.int64), np.arange(samples, dtype=np.int64), np.ones(samples, np.int64)], 1)
    np.save(os.path.join(target, "part-00000.lengths.npy"), lengths)
    np.save(os.path.join(target, "part-00000.records.npy"), records)
    index = {
        s: cache_writer.whole_file_crc(os.path.join(target, f"part-00000.{s}")) for s in ("records.npy", "lengths.npy")
    }
    part = {
        "part": "00000", "records": samples, "samples": samples, "tokens": samples * tokens_per_sample,
        "token_mode": True, "index": index, "skipped": 0, "empty": 0, "blank": 0,
        "fields": {"input_ids": {"stored": True, "bytes": total, "crc32": crcs}, "attention_mask": {"const": 1},
                   "labels": {"alias": "input_ids"}},
    }  # fmt: skip
    manifest = {"format": sample_cache.FORMAT, "token_mode": True, "fingerprint": parts, "created": "synthetic",
                "parts": [part], **{k: part[k] for k in ("records", "samples", "tokens", "skipped", "empty", "blank")}}  # fmt: skip
    with open(os.path.join(target, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return total


def time_start(data: str, folder: str, max_len: int, runs: int = 4):
    """The timings of the fastest of `runs` fresh processes after the first (which may plan and keep the plan)."""
    timings = []
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, data, folder, str(max_len)], capture_output=True, text=True, timeout=1800,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
        line = [x for x in proc.stdout.splitlines() if x.startswith("TIMES")]
        if proc.returncode or not line:
            sys.exit(f"the timed run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        timings.append([float(x) for x in line[0].split()[1:5]] + [int(x) for x in line[0].split()[5:]])
    return min(timings[1:], key=lambda t: sum(t[:4]))


def read_all(folder: str) -> float:
    tic = time.perf_counter()
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".bin"):
                with open(os.path.join(root, name), "rb") as f:
                    while f.read(64 << 20):
                        pass
    return time.perf_counter() - tic


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[2, 20])
    parser.add_argument("--folder", default="/tmp/veomni-cache-startup")
    parser.add_argument("--samples", type=int, default=100_000, help="samples of the smallest cache")
    parser.add_argument("--keep", action="store_true")
    a = parser.parse_args()
    need = max(a.sizes_gb) * 2**30  # one cache at a time
    free = shutil.disk_usage(os.path.dirname(a.folder.rstrip("/")) or "/").free
    if free < need * 1.1:
        sys.exit(f"needs {need / 2**30:.0f} GB on {a.folder}, {free / 2**30:.0f} GB free")
    small = min(a.sizes_gb)
    rows = []
    try:
        for shape in ("same samples, longer", "same length, more samples"):
            for gb in a.sizes_gb:
                total = int(gb * 2**30)
                samples = a.samples if shape.startswith("same samples") else int(a.samples * gb / small)
                per_sample = total // (samples * 4)
                folder = os.path.join(a.folder, f"{gb:g}gb-{samples}")
                os.makedirs(folder, exist_ok=True)
                data = os.path.join(folder, "data.jsonl")
                size = write_cache(folder, data, samples, per_sample)
                times = time_start(data, folder, per_sample)
                rows.append((shape, gb, samples, per_sample, size, times, read_all(folder)))
                print(
                    f"{shape:27s} {gb:5g} GB  {samples:>9,} samples of {per_sample:>6,} tokens: imports {times[0]:.2f} s, "
                    f"open {times[1]:.3f} s, plan {times[2]:.3f} s ({times[4]} steps), first batch {times[3]:.3f} s; "
                    f"start-up {sum(times[1:4]):.3f} s; reading every token file once: {rows[-1][6]:.1f} s",
                    flush=True,
                )
                shutil.rmtree(folder) if not a.keep else None
        for shape in ("same samples, longer", "same length, more samples"):
            mine = [r for r in rows if r[0] == shape]
            if len(mine) == 2:
                whole = sum(mine[1][5][:4]) / sum(mine[0][5][:4])
                data = sum(mine[1][5][1:4]) / sum(mine[0][5][1:4])
                old = mine[1][6] / mine[0][6]
                print(
                    f"{shape}: {mine[1][1]:g} GB / {mine[0][1]:g} GB: fresh process to the first batch {whole:.2f}x, "
                    f"its data steps alone (open, plan, first batch: {sum(mine[0][5][1:4]):.3f} s and "
                    f"{sum(mine[1][5][1:4]):.3f} s) {data:.2f}x; a full read of the token files {old:.1f}x"
                )
    finally:
        if not a.keep:
            shutil.rmtree(a.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
