"""Each step of `parallelize` on its own, on the demo models built on meta, on a fake 4-rank world (no processes):
what the step must leave behind, and nothing else. Numerics of the composed steps are the parity tests' job."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = os.path.join(REPO, "configs", "model", "demo_qwen2")
MOE = os.path.join(REPO, "configs", "model", "demo_qwen3_moe")


def _model(config_path, moe_implementation=None):
    from veomni.models import build_foundation_model

    return build_foundation_model(
        config_path, init_device="meta", torch_dtype="float32", moe_implementation=moe_implementation
    )


def _state(**sizes):
    from veomni.compat.torch import init_fake_process_group
    from veomni.distributed.parallel_dims import ParallelDims
    from veomni.distributed.parallel_state import ParallelState

    init_fake_process_group(1, 4)
    return ParallelState.from_dims(ParallelDims.resolve(4, **sizes))


def _leave():
    import torch.distributed as dist

    from veomni.compat.torch import clear_dtensor_sharding_caches

    clear_dtensor_sharding_caches()
    dist.destroy_process_group()


def check_sp():
    from veomni.compat.transformers import config_attn_implementation
    from veomni.distributed.sequence_parallel import apply_sp

    model = _model(DENSE)
    apply_sp(model, _state(ulysses_size=2))
    assert config_attn_implementation(model.config).startswith("veomni_ulysses:"), model.config
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())  # parameters stay replicated
    _leave()


def check_tp():
    from torch.distributed.tensor import DTensor, Shard

    from veomni.distributed.tensor_parallel import apply_tp

    model = _model(DENSE)
    state = _state(tp_size=2)
    apply_tp(model, state.tp_mesh)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.weight, DTensor) and layer.self_attn.q_proj.weight.placements == (
        Shard(0),
    )
    assert layer.self_attn.o_proj.weight.placements == (Shard(1),)
    assert not isinstance(layer.input_layernorm.weight, DTensor)  # norms stay plain, replicated
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the demo's tied embedding stays tied
    _leave()


def check_ep_and_fsdp():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from veomni.arguments import FSDPConfig
    from veomni.compat.transformers import config_experts_implementation
    from veomni.distributed.fsdp import apply_fsdp, no_split_module_names
    from veomni.distributed.parallel_plan import apply_ep
    from veomni.ops.moe import FUSED, expert_parallel_of

    model = _model(MOE, moe_implementation="fused")
    assert config_experts_implementation(model.config) == FUSED
    state = _state(extra_parallel_names=["ep"], extra_parallel_sizes=[2])
    experts = apply_ep(model, state)
    total = model.config.num_experts
    for module in experts:
        ep = expert_parallel_of(module)
        assert ep is not None and (ep.size, ep.rank, ep.grad_scale) == (2, 1, 0.5)
        assert isinstance(module.gate_up_proj, DTensor) and module.gate_up_proj.to_local().shape[0] == total // 2
    apply_fsdp(model, state, FSDPConfig(), no_split_module_names(model), experts)
    layers = list(model.model.layers)
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in layers)
    assert all(isinstance(module, FSDPModule) for module in experts)
    # experts: whole experts over ep (dim 0), then their hidden dim over ep_fsdp; the rest over all data ranks
    assert experts[0].gate_up_proj.device_mesh.mesh_dim_names == ("ep_fsdp", "ep")
    assert experts[0].gate_up_proj.placements == (Shard(1), Shard(0))
    assert layers[0].self_attn.q_proj.weight.device_mesh.mesh_dim_names == ("dp_shard",)
    _leave()


def check_ac():
    from veomni.distributed.activation_checkpointing import apply_ac

    model = _model(DENSE)
    apply_ac(model, reentrant=False)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_each_parallelize_step_on_a_fake_world():
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "STEPS_OK sp tp ep_and_fsdp ac" in proc.stdout


if __name__ == "__main__":
    for step in (check_sp, check_tp, check_ep_and_fsdp, check_ac):
        step()
    print("STEPS_OK sp tp ep_and_fsdp ac")
