"""The planner's default MFU: measured, not assumed. The newest record in `benchmarks/results/<gpu>_<date>.jsonl`
(`kind: step`, written by benchmarks/gpu_mfu.py and gpu_speed.py) of the benchmarked model nearest in size to the
planned one, on that GPU; `--mfu` overrides it. Without a record for the GPU (or without the repository's
benchmarks folder, e.g. an installed wheel) it falls back to MEASURED_FLOOR and says so."""

import glob
import json
import math
import os
import re
from typing import Optional, Tuple

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "results"
)
MEASURED_FLOOR = 0.2  # about the middle of the 11-29% our H100 step benchmarks measured (qwen3 0.6B-4B, 30B-A3B)


def benchmark_billions(model: str) -> Optional[float]:
    """Total parameters in billions from a benchmark's model name: qwen3_0_6b -> 0.6, qwen3_30b_a3b -> 30."""
    match = re.search(r"_(\d+)(?:_(\d+))?b(?:_|$)", model)
    if not match:
        return None
    return float(f"{match[1]}.{match[2]}" if match[2] else match[1])


def _record_mfu(record: dict, peak_tflops: float) -> Optional[float]:
    if record.get("mfu"):
        return float(record["mfu"])
    if record.get("flops") and record.get("trainer_s"):
        return record["flops"] / record["trainer_s"] / (peak_tflops * 1e12)
    return None


def measured_mfu(gpu: str, billions: float, peak_tflops: float, results: str = RESULTS) -> Tuple[float, str]:
    """(MFU, where it comes from, in words) for a `billions`-parameter model on `gpu` (h100, h200, a100)."""
    files = sorted(glob.glob(os.path.join(results, f"{gpu}_*.jsonl")))
    if not files:
        return MEASURED_FLOOR, f"no benchmarks/results/{gpu}_*.jsonl: assumed {MEASURED_FLOOR}"
    records = []
    for order, line in enumerate(open(files[-1])):
        record = json.loads(line) if line.strip() else {}
        size = benchmark_billions(record.get("model", ""))
        mfu = _record_mfu(record, peak_tflops) if record.get("kind") == "step" and not record.get("oom") else None
        if size and mfu:
            records.append((abs(math.log(size / billions)), -order, mfu, record["model"], record.get("tokens")))
    if not records:
        return MEASURED_FLOOR, f"no step record in {os.path.basename(files[-1])}: assumed {MEASURED_FLOOR}"
    _, _, mfu, model, tokens = min(records)  # the nearest size, then the newest record
    return mfu, f"measured: {model}, {tokens:,} tokens a step, in benchmarks/results/{os.path.basename(files[-1])}"
