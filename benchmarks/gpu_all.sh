#!/usr/bin/env bash
# Everything a GPU machine checks and measures, stage by stage, so that a short loan of one is used in few calls:
#
#   bash benchmarks/gpu_all.sh STAGE...      (from the repository root; results and logs go to $OUT or outputs/gpu)
#
#   env      the GPU, torch, transformers, which packed-attention kernels exist here
#   tests    tests/test_cuda.py: every CUDA kernel path against its reference (skipped on CI, which has no GPU)
#   mfu      benchmarks/gpu_mfu.py: Qwen3-0.6B/1.7B/4B and a 4-layer Qwen3-30B-A3B, 8k and 32k tokens per
#            micro-batch, trainer vs bare loop, plus one MoE layer's experts (eager / grouped_mm / ours)
#   context  the longest context that trains (Qwen3-0.6B and 1.7B, with and without activation checkpointing)
#
# A stage that fails is reported and the next one still runs; the exit status is the number of failed stages.
set -u
out=${OUT:-outputs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
failed=0

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v " INFO " || true
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "=== $name FAILED (exit $rc)"; failed=$((failed + 1)); }
}

for s in "$@"; do
    case $s in
    env)
        stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
            python -c "import torch, transformers, importlib.util as u; print(\"torch\", torch.__version__,
            \"transformers\", transformers.__version__, \"flash_attn\", u.find_spec(\"flash_attn\") is not None,
            \"torch varlen\", u.find_spec(\"torch.nn.attention.varlen\") is not None)"'
        ;;
    tests) stage tests 420 python -m pytest tests/test_cuda.py -q -p no:cacheprovider -rs ;;
    mfu)
        stage mfu 540 python benchmarks/gpu_mfu.py --models "${MFU_MODELS:-qwen3_0_6b,qwen3_1_7b,qwen3_4b,qwen3_30b_a3b}" \
            --tokens 8192,32768 --moe-block 8192 --json "$out/mfu.jsonl"
        ;;
    context)
        stage context 540 python benchmarks/gpu_mfu.py --models qwen3_0_6b,qwen3_1_7b --checkpointing both \
            --tokens 40960,65536,98304,131072 --steps 3 --warmup 1 --trainer-only --json "$out/context.jsonl"
        ;;
    *) echo "unknown stage $s (env, tests, mfu, context)"; failed=$((failed + 1)) ;;
    esac
done
exit $failed
