"""LoRA vs full fine-tuning: optimizer-state bytes, gradient bytes and peak memory of the same training steps.

    python benchmarks/lora_memory.py [--config configs/model/demo_qwen2] [--hidden 1024 --layers 8 --vocab 32000]
                                     [--r 8] [--targets q_proj,k_proj,v_proj,o_proj] [--steps 3] [--row 256]

The driver runs itself once per mode, each in a fresh process (peak memory is per process): the model built as the
trainer builds it (veomni.models.lora.attach_lora, FSDP2 over one rank, AdamW from build_optimizer, fp32), then
`--steps` steps on 2 packed rows of `--row` random tokens. Reported: trainable parameters, AdamW state and
gradient bytes after the first step, and peak memory: on CUDA `max_memory_allocated`; on CPU the process's peak
resident size (ru_maxrss) and its growth over the resident size before the first step (gradients, optimizer state,
activations; the shared libraries and the model itself are in both modes alike).
"""

import argparse
import json
import os
import resource
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size() if local.dim() > 0 else 0


def build(args, lora: bool):
    """The model and optimizer, as BaseTrainer.build_model / build_optimizer make them."""
    from veomni.arguments import LoraArguments
    from veomni.distributed.torch_parallelize import build_parallelize_model, no_split_module_names
    from veomni.models import build_foundation_model
    from veomni.models.lora import attach_lora, base_checkpoint_names, place_adapters
    from veomni.optim import build_optimizer

    overrides = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "vocab_size": args.vocab}
    if args.layers:  # the config lists one attention type per layer
        overrides["layer_types"] = ["full_attention"] * args.layers
    if args.hidden:
        overrides.update(intermediate_size=args.hidden * 11 // 4, num_attention_heads=args.hidden // 64)
        overrides.update(num_key_value_heads=max(args.hidden // 128, 1))
    config_kwargs = {k: v for k, v in overrides.items() if v}
    model = build_foundation_model(config_path=args.config, torch_dtype="float32", config_kwargs=config_kwargs)
    settings = LoraArguments(enable=lora, r=args.r, alpha=2.0 * args.r, target_modules=args.targets.split(","))
    adapters = attach_lora(model, settings, seed=0)
    with base_checkpoint_names(model, adapters):
        model = build_parallelize_model(model, basic_modules=no_split_module_names(model))
    place_adapters(model, adapters)
    return model, build_optimizer(model, lr=1e-4, weight_decay=0.01)


def worker(args, mode: str) -> None:
    import torch

    from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state
    from veomni.ops import CausalLMLoss, shift_labels
    from veomni.utils.device import get_device

    init_parallel_state(dp_size=1)
    torch.manual_seed(0)
    model, optimizer = build(args, lora=mode == "lora")
    device, cuda = get_device(), get_device().type == "cuda"
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    rows = [torch.randint(3, vocab, (1, args.row), generator=g).to(device) for _ in range(2)]
    before = _rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        for ids in rows:
            loss = CausalLMLoss(model, 1024)(shift_labels(ids), input_ids=ids, use_cache=False).loss_sum
            (loss / ids.numel()).backward()
        grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            optim_bytes, first_grad_bytes = sum(_local_bytes(v) for v in state), grad_bytes
    result = {
        "mode": mode,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optim_bytes": optim_bytes,
        "grad_bytes": first_grad_bytes,
        "peak_bytes": torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "growth_bytes": None if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
        "device": device.type,
    }
    print("RESULT " + json.dumps(result), flush=True)
    destroy_parallel_state()


def _print(full: dict, lora: dict) -> None:
    print(f"model: {full['params']:,} parameters on {full['device']}; LoRA trains {lora['trainable']:,} of them")
    print(f"{'':24s}{'full':>12s}{'lora':>12s}{'lora/full':>12s}")
    keys = [("optimizer state", "optim_bytes"), ("gradients", "grad_bytes"), ("peak memory", "peak_bytes")]
    if full["growth_bytes"] is not None:
        keys.append(("peak growth in training", "growth_bytes"))
    for label, key in keys:
        a, b = full[key], lora[key]
        print(f"{label + ' (MiB)':24s}{a / MiB:12.2f}{b / MiB:12.2f}{b / a:12.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "model", "demo_qwen2"))
    parser.add_argument("--hidden", type=int, default=None, help="override hidden_size (heads, MLP follow)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--row", type=int, default=256)
    parser.add_argument("--mode", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)  # a worker
    args = parser.parse_args()
    if args.mode:
        return worker(args, args.mode)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONPATH=REPO)
    results = {}
    for mode in ("full", "lora"):
        command = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        results[mode] = json.loads(line[len("RESULT ") :])
    _print(results["full"], results["lora"])


if __name__ == "__main__":
    main()
