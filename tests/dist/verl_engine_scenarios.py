"""Under torchrun (or plain python for one process): verl's own VeOmni engine, unchanged, trained on veomni.

argv: plan.json out.json. plan = {"runs": [run, ...]}, each run

  {"name", "kind": "lm" | "critic", "model": folder, "batches": path of a torch file with the global batches (lists
   of token-id lists, loss masks, the critic's prompt lengths, old values and returns), "ulysses": 1, "ep": 1,
   "steps": 3, "param_offload": false,
   "offload_before": [step, ...],        engine.to("cpu") then back to the device before these steps (0-based)
   "checkpoint": {"dir", "save_after": k}}  save after step k, train on, then load into a NEW engine and train the
                                            same steps again (its losses and grad norms must repeat bit for bit)

Each rank takes its data-parallel slice of every global batch. Rank 0 writes out.json: per run, per step, the
losses verl returned (every micro-batch of every rank) and the grad norm verl returned.

The one addition verl needs here is a CPU platform (verl ships CUDA, NPU and ROCm ones): `PlatformCPU` below, chosen
through verl's own `VERL_PLATFORM` switch when there is no CUDA device. Nothing in verl is patched.
"""

import json
import os
import sys
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402  (does not pick the platform yet)
from verl.plugin.platform.platform_manager import PlatformRegistry  # noqa: E402


class _HostMemory:
    """`torch.cpu` plus what verl calls on a device module: `empty_cache` after an offload and memory statistics for
    its logs (nothing to do on the host), the generator state for its checkpoints (the host's)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, *args) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, *args) -> None:
        pass

    def mem_get_info(self, *args):
        return 0, 0

    def get_rng_state(self):  # verl's checkpoints save "the device's" generator: here the host's
        return torch.get_rng_state()

    def set_rng_state(self, state) -> None:
        torch.set_rng_state(state)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl on a machine without an accelerator: tensors stay on the host, collectives run over gloo."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _HostMemory()

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"  # verl moves tensors with `.to(get_device_id())`: an index would mean a CUDA device

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


if not torch.cuda.is_available():
    os.environ["VERL_PLATFORM"] = "cpu"

from tensordict import TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import HFModelConfig, VeOmniEngineConfig, VeOmniOptimizerConfig  # noqa: E402
from verl.utils.device import get_device_id  # noqa: E402
from verl.workers.engine.veomni import VeOmniEngineWithLMHead, VeOmniEngineWithValueHead  # noqa: E402
from verl.workers.engine.veomni.utils import (  # noqa: E402
    load_veomni_model_to_gpu,
    load_veomni_optimizer,
    offload_veomni_model_to_cpu,
    offload_veomni_optimizer,
)
from verl.workers.utils.losses import sft_loss, value_loss  # noqa: E402

LR = 1e-3
CLIPRANGE_VALUE = 0.5


def make_engine(run: dict, world: int):
    model_config = HFModelConfig(path=run["model"], load_tokenizer=False, use_remove_padding=True)
    engine_config = VeOmniEngineConfig(
        ulysses_parallel_size=run.get("ulysses", 1),
        expert_parallel_size=run.get("ep", 1),
        mixed_precision=True,  # fp32 master weights (and fp32 compute on CPU)
        param_offload=run.get("param_offload", False),
        optimizer_offload=run.get("param_offload", False),
        use_torch_compile=False,
        use_dynamic_bsz=False,
    )
    optimizer_config = VeOmniOptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, total_training_steps=run["steps"])
    checkpoint_config = CheckpointConfig()
    engine_class = VeOmniEngineWithValueHead if run["kind"] == "critic" else VeOmniEngineWithLMHead
    engine = engine_class(model_config, engine_config, optimizer_config, checkpoint_config)
    engine.initialize()
    return engine


def local_batch(batch: dict, engine) -> TensorDict:
    """This rank's data-parallel slice of one global batch, as verl's trainers hand it to the engine (jagged)."""
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    per_rank = len(batch["input_ids"]) // dp_size
    rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ids = [torch.tensor(batch["input_ids"][i]) for i in rows]
    mask = [torch.tensor(batch["loss_mask"][i], dtype=torch.float32) for i in rows]
    jagged = partial(torch.nested.as_nested_tensor, layout=torch.jagged)
    tensors = {
        "input_ids": jagged(ids),
        "position_ids": jagged([torch.arange(len(t)) for t in ids]),
        "loss_mask": jagged(mask),
    }
    if "values" in batch:  # the critic's PPO fields: prompt / response split, old values and returns per response
        prompt_lens = [batch["prompt_len"][i] for i in rows]
        tensors["prompts"] = jagged([t[:p] for t, p in zip(ids, prompt_lens)])
        tensors["responses"] = jagged([t[p:] for t, p in zip(ids, prompt_lens)])
        tensors["response_mask"] = jagged([torch.ones(len(t) - p) for t, p in zip(ids, prompt_lens)])
        tensors["values"] = jagged([torch.tensor(batch["values"][i]) for i in rows])
        tensors["returns"] = jagged([torch.tensor(batch["returns"][i]) for i in rows])
    data = TensorDict(tensors, batch_size=[len(ids)])
    tu.assign_non_tensor(
        data,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=len(ids),
        temperature=1.0,
        pad_mode="no_padding",
        global_batch_size=len(batch["input_ids"]),
    )
    return data


def train_steps(engine, run: dict, batches: list, first: int, last: int) -> list:
    loss_fn = partial(sft_loss, None) if run["kind"] == "lm" else partial(value_loss, critic_config())
    steps = []
    for step in range(first, last):
        if step in run.get("offload_before", ()):
            offload_and_back(engine)
        with engine.train_mode():
            out = engine.train_batch(local_batch(batches[step], engine), loss_function=loss_fn)
        engine.lr_scheduler_step()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"loss": out["loss"], "grad_norm": out["metrics"].get("grad_norm")})
        steps.append(gathered)
    return steps


def offload_and_back(engine) -> None:
    """verl's offload of our FSDP2 model and optimizer state to the host, then back onto the device: the functions
    `engine.to("cpu")` / `engine.to(device)` call (called directly: on a CPU platform `engine.to("cpu")` takes its
    on-device branch, the device being "cpu")."""
    offload_veomni_model_to_cpu(engine.module)
    offload_veomni_optimizer(engine.optimizer)
    load_veomni_model_to_gpu(engine.module)
    load_veomni_optimizer(engine.optimizer, get_device_id())


def critic_config():
    from verl.workers.config import CriticConfig

    return CriticConfig(
        strategy="veomni", ppo_micro_batch_size_per_gpu=1, cliprange_value=CLIPRANGE_VALUE, loss_agg_mode="token-mean"
    )


def run_one(run: dict, batches: list) -> dict:
    world = dist.get_world_size()
    engine = make_engine(run, world)
    checkpoint = run.get("checkpoint")
    if checkpoint is None:
        return {"steps": train_steps(engine, run, batches, 0, run["steps"])}
    k = checkpoint["save_after"]
    steps = train_steps(engine, run, batches, 0, k)
    engine.save_checkpoint(checkpoint["dir"], global_step=k)
    steps += train_steps(engine, run, batches, k, run["steps"])
    del engine
    resumed = make_engine(run, world)
    resumed.load_checkpoint(checkpoint["dir"])
    return {"steps": steps, "resumed": train_steps(resumed, run, batches, k, run["steps"])}


def main() -> None:
    plan_path, out_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    if not dist.is_initialized():
        from veomni.distributed import init_distributed

        init_distributed()
    results = {}
    for run in plan["runs"]:
        torch.manual_seed(0)
        results[run["name"]] = run_one(run, torch.load(run["batches"]))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
