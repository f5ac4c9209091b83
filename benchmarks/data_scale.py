"""Start-up and memory against the size of map-style data: the first run builds the sample cache, later runs map it.

    python benchmarks/data_scale.py [--records 10000 100000 1000000] [--ranks 1] [--vl 200 2000]

For each size, real text paragraphs (the demo's Shakespeare, cycled) are written as jsonl, then two fresh processes
(or `--ranks` torchrun ranks) each time the set-up a trainer does before step 1: the tokenizer, `build_dataset`,
`build_dataloader`, the step count (the loader's own plan) and the first global batch. The first run builds the cache
(into a folder of this benchmark), the second finds it. Printed per size: records, tokens, seconds to step 1 and
peak RSS of each run, and the cache build rate in tokens per CPU-second per reader; then the ratios between sizes.

`--vl N ...`: the same for vision-language data, N real images (easy-vqa, 64x64) through the Qwen2.5-VL processor
and transform (length mode: pixels are decoded in the loader, never cached): peak RSS per size.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def write_text(path: str, records: int) -> None:
    if os.path.isfile(path):
        return
    from veomni.utils.demo_assets import ensure_demo_assets

    root = ensure_demo_assets(os.path.join(REPO, ".assets"), quiet=True)
    with open(os.path.join(root, "shakespeare", "train.jsonl")) as f:
        paragraphs = [p.strip() for line in f for p in json.loads(line)["text"].split("\n\n") if len(p.strip()) > 40]
    with open(path + ".tmp", "w") as out:
        for i in range(records):
            out.write(json.dumps({"text": paragraphs[i % len(paragraphs)], "id": i}) + "\n")
    os.replace(path + ".tmp", path)


def write_vl(path: str, images: int) -> None:
    if os.path.isfile(path):
        return
    from veomni.data.multimodal.demo_data import write_easy_vqa_jsonl

    write_easy_vqa_jsonl(path, "train", limit=images)


def worker(args) -> dict:
    """One run's set-up, timed from the first import of veomni to the first global batch."""
    start, cpu = time.perf_counter(), _cpu_seconds()
    sys.path.insert(0, REPO)
    from functools import partial

    import torch.distributed as dist

    from veomni.data import build_dataloader, build_dataset
    from veomni.data.data_transform import process_pretrain_example
    from veomni.distributed import init_parallel_state
    from veomni.models import build_tokenizer

    state = init_parallel_state()
    if args.kind == "vl":
        transform = _vl_transform()
    else:
        tokenizer = build_tokenizer(os.path.join(REPO, ".assets", "tokenizer"))
        transform = partial(process_pretrain_example, tokenizer=tokenizer, max_seq_len=2048)
    dataset = build_dataset(train_path=args.data, datasets_type="mapping", transform=transform, cache_dir=args.cache)
    loader = build_dataloader(
        dataset=dataset, micro_batch_size=4, max_seq_len=2048, dyn_bsz=True, dataloader_batch_size=1,
        dp_rank=state.dp_rank, dp_size=state.dp_size, drop_last=False,
        **({"collate_fn": _vl_collate()} if args.kind == "vl" else {}),
    )  # fmt: skip
    steps = loader.num_batches()
    loader.set_epoch(0)
    next(iter(loader))
    result = {"seconds": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu, "rss_mb": _peak_rss_mb()}
    manifest = dataset.cache.manifest
    result.update(records=len(dataset), steps=steps, tokens=manifest["tokens"])
    result["build_rate"] = [p["tokens"] / max(p.get("cpu_seconds", 0), 1e-9) for p in manifest["parts"]]
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def _vl_transform():
    from functools import partial

    from transformers import AutoConfig

    from veomni.data import build_multimodal_chat_template
    from veomni.data.multimodal import process_sample_qwen2_5_vl
    from veomni.models import build_processor
    from veomni.models.position_ids import build_position_id_func

    processor = build_processor(os.path.join(REPO, ".assets", "vlm", "processor"))
    config = AutoConfig.from_pretrained(os.path.join(REPO, "configs", "multimodal", "qwen2_5_vl", "demo_model"))
    template = build_multimodal_chat_template("qwen2_5_vl", processor.tokenizer)
    return partial(
        process_sample_qwen2_5_vl, processor=processor, chat_template=template,
        position_id_func=build_position_id_func(config),
    )  # fmt: skip


def _vl_collate():
    from veomni.data import MainCollator
    from veomni.trainer.vlm_trainer import build_data_collate_info

    return MainCollator(collate_infos=build_data_collate_info(), max_seq_len=2048)


def _launch(argv, ranks: int) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    me = os.path.abspath(__file__)
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_port=0"]
        cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", me, *argv]
    else:
        cmd = [sys.executable, me, *argv]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def measure(kind: str, sizes, ranks: int, root: str) -> None:
    rows = []
    for n in sizes:
        data = os.path.join(root, f"{kind}_{n}.jsonl")
        (write_vl if kind == "vl" else write_text)(data, n)
        cache = tempfile.mkdtemp(prefix="cache-", dir=root)
        argv = ["--worker", "--kind", kind, "--data", data, "--cache", cache]
        first, second = _launch(argv, ranks), _launch(argv, ranks)
        rates = first[0]["build_rate"]  # tokens per CPU-second of each reader's own build (from the manifest)
        rows.append((n, first, second))
        print(
            f"{kind} {n:>9,} records: {first[0]['tokens']:>12,} tokens, {first[0]['steps']:>6} steps | first run "
            f"{max(r['seconds'] for r in first):7.1f} s, {max(r['rss_mb'] for r in first):7.0f} MB | second run "
            f"{max(r['seconds'] for r in second):6.1f} s, {max(r['rss_mb'] for r in second):6.0f} MB | cache build "
            f"{', '.join(f'{r:,.0f}' for r in rates)} tokens per CPU-second per reader ({ranks} reader(s))",
            flush=True,
        )
    base = rows[0]
    for n, first, second in rows[1:]:
        ratio = lambda run, ref, k: max(r[k] for r in run) / max(r[k] for r in ref)  # noqa: E731
        print(
            f"{kind} {n:,} vs {base[0]:,} records: second run set-up x{ratio(second, base[2], 'seconds'):.2f}, "
            f"peak RSS x{ratio(second, base[2], 'rss_mb'):.2f}; first run set-up x{ratio(first, base[1], 'seconds'):.2f}, "
            f"peak RSS x{ratio(first, base[1], 'rss_mb'):.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--vl", type=int, nargs="*", default=[])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--root", default=os.path.join(REPO, "outputs", "bench_data_scale"))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--kind", default="text")
    parser.add_argument("--data")
    parser.add_argument("--cache")
    args = parser.parse_args()
    if args.worker:
        results = worker(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(results), flush=True)
        return
    os.makedirs(args.root, exist_ok=True)
    if args.records:
        measure("text", args.records, args.ranks, args.root)
    if args.vl:
        from veomni.data.multimodal.processor_builder import build_qwen_processor_folder

        folder = os.path.join(REPO, ".assets", "vlm", "processor")
        if not os.path.isdir(folder):
            build_qwen_processor_folder("qwen2_5_vl", folder, min_pixels=56 * 56, max_pixels=112 * 112)
        measure("vl", args.vl, args.ranks, args.root)


if __name__ == "__main__":
    main()
