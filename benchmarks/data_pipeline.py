"""Packed tokens/s of build_dataset + build_dataloader (dyn_bsz packing), raw text and pre-tokenised, against
the Hugging Face padding-free recipe run in the same process on the same records and tokenizer.

    pip install -e '.[bench]'   # the peer needs `datasets`
    OMP_NUM_THREADS=2 python benchmarks/data_pipeline.py [--samples 20000] [--workers 0] [--first-pass]

Data: `--samples` jsonl records of random length 50-2000 tokens cut from the demo's Shakespeare text (the
repo-built tokenizer), written once as raw text and once as `input_ids`. Ours: mapping dataset, micro-batch
token budget 4 x 2048, dyn_bsz, `--workers` workers. Printed per case: packed tokens/s (from opening the file to
the last micro-batch: the first pass, building the sample cache included) and pack efficiency (tokens / (micro-batches
x budget)). `--first-pass`: only raw text batched, pre-tokenised and the HF recipe.
Baselines, measured in this run:
- the Hugging Face recipe: `datasets.load_dataset("json")`, `.map(tokenize, batched=True)` (with the same split
  into max_seq_len pieces and EOS), a torch DataLoader with `DataCollatorWithFlattening` (padding-free packing)
  and 8 pieces per batch (about the same tokens per batch), the same number of workers; no cache reuse;
- our pipeline tokenising one record at a time (as VeOmni's plaintext transform does).
Then streaming: N readers (N = 1, 2, 4; data-parallel ranks, each a process of one thread: tokenizer and torch)
start together and pass over their shares of the iterable dataset. Printed: tokens/s of the N together, tokens per
CPU-second per reader and its ratio to the one-record-at-a-time mapping path (a reader tokenises only its own
units, so this stays flat in N and in `--samples`), and the wall-clock ratio to 1 reader (about min(N, cores) when
readers scale), next to the same ratio for N pure-Python busy loops started together just before, and the load
average: other jobs on a shared box lower both. (The mapping path reads its files with the same reader, to build
its sample cache: a reader slowdown shared by both shows against the HF recipe and as a per-token rate that falls
with `--samples`, not in the streaming / mapping ratio.) Last, the resident memory of a streaming pass, sampled
along the way.
"""

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, ".")
from veomni.data import build_dataloader, build_dataset  # noqa: E402
from veomni.data.cache_writer import build_processes  # noqa: E402
from veomni.data.data_transform import encode_many, process_pretrain_example  # noqa: E402
from veomni.models import build_tokenizer  # noqa: E402
from veomni.utils.demo_assets import ensure_demo_assets  # noqa: E402

MAX_SEQ_LEN, MICRO_BATCH = 2048, 4
HF_BATCH = 8  # pieces per DataCollatorWithFlattening batch: ~1k tokens each, about one 4 x 2048 budget


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


def cpu_seconds():
    """User + system CPU time of this process and its finished children (loader workers): on a shared box,
    tokens per CPU-second is steadier than tokens per wall-second."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _packing_loader(dataset, workers: int = 0, dp_rank: int = 0, dp_size: int = 1):
    """The loader every row measures: dynamic packing to MICRO_BATCH * MAX_SEQ_LEN tokens, one slot per step."""
    return build_dataloader(
        dataset=dataset, micro_batch_size=MICRO_BATCH, max_seq_len=MAX_SEQ_LEN, dyn_bsz=True, dataloader_batch_size=1,
        num_workers=workers, dp_rank=dp_rank, dp_size=dp_size, drop_last=False,
    )  # fmt: skip


def run(path, tokenizer, kind="mapping", batched=True, workers=0, memory=False):
    fn = process_pretrain_example if batched else _one_at_a_time
    transform = partial(fn, tokenizer=tokenizer, max_seq_len=MAX_SEQ_LEN)
    tic, cpu = time.perf_counter(), cpu_seconds()
    # a fresh sample cache for mapping data, so the row measures its one transform, not a cache of an earlier run
    cache = {"cache_dir": tempfile.mkdtemp(prefix="bench-cache-")} if kind == "mapping" else {}
    dataset = build_dataset(train_path=path, datasets_type=kind, transform=transform, seed=0, **cache)
    loader = _packing_loader(dataset, workers=workers)
    loader.set_epoch(0)
    tokens = micro = 0
    rss = []
    for step in loader:
        for mb in step:
            tokens += mb["input_ids"].numel()
            micro += 1
        if memory and micro % 500 == 0:
            rss.append(rss_mb())
    elapsed, cpu = time.perf_counter() - tic, cpu_seconds() - cpu
    if cache:
        shutil.rmtree(cache["cache_dir"], ignore_errors=True)
    return tokens / elapsed, tokens / (micro * MICRO_BATCH * MAX_SEQ_LEN), tokens, elapsed, rss, tokens / cpu


def run_hf_recipe(path, tokenizer, workers=0):
    """The usual padding-free recipe: datasets map tokenisation + DataCollatorWithFlattening."""

    import torch
    from datasets import load_dataset
    from transformers import DataCollatorWithFlattening

    eos = tokenizer.eos_token_id

    def tokenize(batch):  # the same samples as ours: EOS per document, split into max_seq_len pieces
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        docs = [d + [eos] for d in ids] if eos is not None else ids
        pieces = [d[i : i + MAX_SEQ_LEN] for d in docs for i in range(0, len(d), MAX_SEQ_LEN)]
        return {"input_ids": [p for p in pieces if len(p) > 1]}

    with tempfile.TemporaryDirectory() as cache:
        tic, cpu = time.perf_counter(), cpu_seconds()
        dataset = load_dataset("json", data_files=path, split="train", cache_dir=cache)
        dataset = dataset.map(
            tokenize,
            batched=True,
            remove_columns=dataset.column_names,
            load_from_cache_file=False,
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=HF_BATCH,
            shuffle=True,
            collate_fn=DataCollatorWithFlattening(),
            num_workers=workers,
            generator=torch.Generator().manual_seed(0),
        )
        tokens = sum(batch["input_ids"].numel() for batch in loader)
        elapsed, cpu = time.perf_counter() - tic, cpu_seconds() - cpu
    return tokens / elapsed, tokens, elapsed, tokens / cpu


def _stream_reader(barrier, results, rank, path, tokenizer, readers):
    """One streaming reader (rank `rank` of `readers`), one thread, timed from opening the files to its last
    micro-batch; puts (rank, tokens, start, end, CPU seconds) on `results`."""
    import torch

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per reader: readers, not threads, use the cores
    torch.set_num_threads(1)
    transform = partial(process_pretrain_example, tokenizer=tokenizer, max_seq_len=MAX_SEQ_LEN)
    barrier.wait()
    tic, cpu = time.monotonic(), cpu_seconds()
    dataset = build_dataset(train_path=path, datasets_type="iterable", transform=transform, seed=0)
    loader = _packing_loader(dataset, dp_rank=rank, dp_size=readers)
    loader.set_epoch(0)
    tokens = sum(mb["input_ids"].numel() for step in loader for mb in step)
    results.put((rank, tokens, tic, time.monotonic(), cpu_seconds() - cpu))


def _tokenize_only(barrier, results, rank, texts, tokenizer, processes):
    """The tokenizer alone over this process's share of the texts (already decoded), as the cache build calls it:
    the ceiling of the raw-text first pass on this box."""
    barrier.wait()
    tic, cpu, tokens = time.monotonic(), cpu_seconds(), 0
    mine = texts[rank::processes]
    for i in range(0, len(mine), 512):
        tokens += sum(map(len, encode_many(tokenizer, mine[i : i + 512])))
    results.put((rank, tokens, tic, time.monotonic(), cpu_seconds() - cpu))


def _busy_loop(barrier, results, rank, steps=25_000_000):
    """A fixed amount of pure-Python work: what the box gives one process now."""
    barrier.wait()
    tic, cpu, x = time.monotonic(), cpu_seconds(), 0
    for i in range(steps):
        x += i * i
    results.put((rank, steps, tic, time.monotonic(), cpu_seconds() - cpu))


def at_once(target, processes, *args):
    """Runs `target(barrier, results, rank, *args)` in `processes` forked processes that start their timed work
    together. Returns (work per wall second of all together: first start to last end, the processes' results)."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(processes), ctx.SimpleQueue()
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # (set before the fork: no warning about a used thread pool)
    try:
        procs = [ctx.Process(target=target, args=(barrier, results, r, *args)) for r in range(processes)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    finally:
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    if any(proc.exitcode for proc in procs):
        sys.exit(f"{target.__name__} failed: exit codes {[proc.exitcode for proc in procs]}")
    done = sorted(results.get() for _ in procs)
    return sum(r[1] for r in done) / (max(r[3] for r in done) - min(r[2] for r in done)), done


def first_pass(a, tokenizer, raw, tok, texts, processes):
    """One repetition of the first-pass rows; prints them, returns the figures (and the per-row results)."""
    results = {}
    rows = [("raw text, batched tokenisation", raw, {}), ("raw text, one record at a time", raw, {"batched": False})]
    for name, path, kwargs in rows[: 1 if a.first_pass else 2] + [("pre-tokenised", tok, {})]:
        tps, eff, tokens, elapsed, _, per_cpu = run(path, tokenizer, workers=a.workers, **kwargs)
        results[name] = (tps, per_cpu)
        print(
            f"{name:34s} {tps:11.0f} packed tokens/s {per_cpu:11.0f} per CPU-s  pack efficiency {eff:.4f}  "
            f"({tokens} tokens, {elapsed:.1f} s)"
        )
    try:
        hf = run_hf_recipe(raw, tokenizer, a.workers)
    except ImportError as err:
        sys.exit(f"the Hugging Face peer needs `datasets` ({err}): pip install -e '.[bench]'")
    print(
        f"{'HF datasets.map + Flattening':34s} {hf[0]:11.0f} packed tokens/s {hf[3]:11.0f} per CPU-s  "
        f"({hf[1]} tokens, {hf[2]:.1f} s)"
    )
    ours = results["raw text, batched tokenisation"]
    print(f"raw text: ours / HF padding-free recipe = {ours[0] / hf[0]:.2f}x wall, {ours[1] / hf[3]:.2f}x CPU")
    ceiling, _ = at_once(_tokenize_only, processes, texts, tokenizer, processes)
    print(
        f"the tokenizer alone, {processes} process(es) as the cache build runs it: {ceiling:.0f} tokens/s "
        f"(ours {ours[0] / ceiling:.2f}x it, HF recipe {hf[0] / ceiling:.2f}x)"
    )
    figures = {
        "raw text tokens/s": ours[0], "pre-tokenised tokens/s": results["pre-tokenised"][0], "HF recipe tokens/s": hf[0],
        "tokenizer alone tokens/s": ceiling, "raw / HF (wall)": ours[0] / hf[0], "raw / HF (CPU)": ours[1] / hf[3],
        "raw / tokenizer alone": ours[0] / ceiling,
    }  # fmt: skip
    return figures, results, hf


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--first-pass", action="store_true", help="only the mapping rows and the HF recipe")
    parser.add_argument("--repeat", type=int, default=1, help="first-pass rows this many times, then the spread")
    a = parser.parse_args()
    ensure_demo_assets(".assets")
    tokenizer = build_tokenizer(".assets/tokenizer")
    raw, tok = make_data(f"outputs/bench_data_{a.samples}", tokenizer, a.samples)
    with open(raw) as f:
        texts = [json.loads(line)["text"] for line in f]
    processes = build_processes([raw], [None] * 1024)  # as many as the build forks

    print(f"{a.samples} records, 50-2000 tokens each; budget {MICRO_BATCH}x{MAX_SEQ_LEN} tokens per micro-batch")
    repetitions = []
    for r in range(a.repeat):
        if a.repeat > 1:
            print(f"-- repetition {r + 1} of {a.repeat} (load average {os.getloadavg()[0]:.2f})")
        figures, results, hf = first_pass(a, tokenizer, raw, tok, texts, processes)
        repetitions.append(figures)
    if a.repeat > 1:
        print(f"over {a.repeat} repetitions: median [min - max]")
        for key in repetitions[0]:
            values = sorted(rep[key] for rep in repetitions)
            fmt = "{:.2f}" if " / " in key else "{:,.0f}"
            spread = f"{fmt.format(values[len(values) // 2])} [{fmt.format(values[0])} - {fmt.format(values[-1])}]"
            print(f"  {key:28s} {spread}")
    ours = results["raw text, batched tokenisation"]
    if a.first_pass:
        return
    single = results["raw text, one record at a time"]
    print(f"raw text: ours / one-at-a-time = {ours[0] / single[0]:.2f}x wall, {ours[1] / single[1]:.2f}x CPU")
    load, together, per_cpu, box = os.getloadavg(), {}, {}, {}
    for readers in (1, 2, 4):
        box[readers] = at_once(_busy_loop, readers)[0]  # what N busy processes get from the box just now
        together[readers], done = at_once(_stream_reader, readers, raw, tokenizer, readers)
        per_cpu[readers] = sum(r[1] / r[4] for r in done) / readers
        print(
            f"streaming raw text, {readers} reader(s) at once: {together[readers]:11.0f} tokens/s together, "
            f"{together[readers] / together[1]:.2f}x 1 reader (the box: {box[readers] / box[1]:.2f}x for busy loops); "
            f"per CPU-s per reader {per_cpu[readers]:.0f} ({per_cpu[readers] / single[1]:.2f}x one-at-a-time mapping); "
            f"tokens per reader {', '.join(str(r[1]) for r in done)}"
        )
    print(
        f"streaming: 1 reader / one-at-a-time mapping = {per_cpu[1] / single[1]:.2f}x per CPU-s "
        f"(/ HF recipe {per_cpu[1] / hf[3]:.2f}x); "
        f"2 readers / 1 reader = {together[2] / together[1]:.2f}x per wall second (busy loops: "
        f"{box[2] / box[1]:.2f}x; load average {load[0]:.2f} before the streaming rows, {os.getloadavg()[0]:.2f} "
        f"after; {os.cpu_count()} cores)"
    )
    tps, eff, _, _, rss, _ = run(tok, tokenizer, kind="iterable", workers=a.workers, memory=True)
    print(
        f"iterable (streaming), pre-tokenised: {tps:.0f} tokens/s, efficiency {eff:.4f}; resident memory along "
        f"the pass (MB): {', '.join(f'{r:.0f}' for r in rss)}"
    )


if __name__ == "__main__":
    main()
