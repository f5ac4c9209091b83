"""What dynamo makes of a 10-layer tiny Qwen3 under FSDP2 (one gloo rank) with the bf16 policy, compiled per layer
as `model.ops_implementation.compile` does, with the kernels `eager` or `liger` (then under Triton's interpreter:
run with TRITON_INTERPRET=1). Backend `aot_eager`: dynamo and AOT autograd trace for real, inductor's minutes-long
CPU compile is left out. Run by tests/test_compile_structure.py.

    TRITON_INTERPRET=1 python tests/dist/check_compile_structure.py OUT.json eager|liger

Writes per step: graphs compiled so far (frames), ops captured, graph breaks by reason, recompiles; and what the
kernel binding bound.
"""

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
if sys.argv[2] == "liger":
    import triton_interpreter  # noqa: F401  (before anything imports triton)

import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from veomni.data import MainCollator  # noqa: E402
from veomni.distributed.compile import compile_basic_modules  # noqa: E402
from veomni.distributed.fsdp import basic_module_instances, no_split_module_names  # noqa: E402
from veomni.models import build_foundation_model  # noqa: E402
from veomni.ops import lm_loss_sum  # noqa: E402
from veomni.ops.kernels import bind_kernels  # noqa: E402

LAYERS = 10  # more than dynamo's cache_size_limit (8): a per-layer recompile could not hide behind it
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "use_cache": False, "hidden_act": "silu",
}  # fmt: skip


def main():
    out, kernels = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    folder = tempfile.mkdtemp(prefix="compile_structure_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    torch.manual_seed(0)
    model = build_foundation_model(folder, torch_dtype="float32")
    bound = bind_kernels(model, kernels, "cpu")
    counter = CompileCounterWithBackend("aot_eager")
    torch.compile = functools.partial(torch.compile, backend=counter)
    units = basic_module_instances(model, no_split_module_names(model))
    compile_basic_modules(units)  # what model.ops_implementation.compile does, before sharding
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    steps = []
    for lengths in ((7, 5), (9, 3)):  # two steps, other document lengths, the same total
        ids = list(range(3, 3 + sum(lengths)))
        docs = [ids[: lengths[0]], ids[lengths[0] :]]
        batch = MainCollator()([{"input_ids": d, "labels": d} for d in docs])
        labels = batch.pop("labels")
        loss, _ = lm_loss_sum(model(**batch, use_cache=False).logits, labels)
        loss.backward()
        breaks = {}
        for reason, n in counters["graph_break"].items():  # by kind and the function it is about
            about = reason.split("Developer debug context: ")[-1].split(" at 0x")[0].split("\n")[0]
            key = f"{reason.splitlines()[0][:80]} | {about[:80]}"
            breaks[key] = breaks.get(key, 0) + n
        steps.append({"frames": counter.frame_count, "ops": counter.op_count, "graph_breaks": breaks,
                      "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
                      "unique_graphs": counters["stats"]["unique_graphs"]})  # fmt: skip
    with open(out, "w") as f:
        json.dump({"bound": bound, "units": len(units), "steps": steps}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
