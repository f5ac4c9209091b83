"""The VeOmni calls a client makes, as the seed's pull request (verl's VeOmni engine, its moe_merge / moe_split
scripts) and verl 0.9.1 write them: each one runs here, in one process (no verl needed; tests/test_verl_engine.py
runs verl itself)."""

import logging
import os
from dataclasses import fields

import pytest
import torch
from safetensors.torch import load_file

from helpers import write_moe_config, write_tokenizer

# ------------------------------------------------------------------------------------------- arguments


def test_veomni_config_names_are_our_argument_groups():
    from veomni import arguments as a

    pairs = {
        "AcceleratorConfig": a.AcceleratorArguments,
        "CheckpointConfig": a.CheckpointArguments,
        "DataloaderConfig": a.DataloaderArguments,
        "GradientCheckpointingConfig": a.GradientCheckpointingArguments,
        "MixedPrecisionConfig": a.MixedPrecisionArguments,
        "OpsImplementationConfig": a.OpsImplementation,
        "OptimizerConfig": a.OptimizerArguments,
        "WandbConfig": a.WandbArguments,
    }
    for name, ours in pairs.items():
        assert getattr(a, name) is ours and name in a.__all__, name
    # verl builds these two from its engine config, with keywords of VeOmni's dataclasses
    assert a.MixedPrecisionConfig(enable=True).enable
    ops = a.OpsImplementationConfig(attn_implementation="veomni_flash_attention_2_with_sp", moe_implementation="fused")
    assert {f.name for f in fields(ops)} >= {"attn_implementation", "moe_implementation"}


# ------------------------------------------------------------------------------------------ parallel state
@pytest.fixture
def fake_world():
    import torch.distributed as dist

    from veomni.compat import init_fake_process_group
    from veomni.distributed import destroy_parallel_state

    def start(rank: int, world: int):
        init_fake_process_group(rank, world)

    yield start
    destroy_parallel_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_parallel_state_takes_the_seed_keywords_ep_size_and_dp_mode(fake_world):
    from veomni.distributed.parallel_state import get_parallel_state, init_parallel_state

    fake_world(1, 4)
    init_parallel_state(  # the seed pull request's call, keyword for keyword
        dp_size=2, dp_replicate_size=1, dp_shard_size=2, tp_size=1, ep_size=2, pp_size=1, cp_size=1,
        ulysses_size=2, dp_mode="fsdp2",
    )  # fmt: skip
    state = get_parallel_state()
    assert (state.ep_size, state.dp_mode, state.ulysses_size, state.dp_size) == (2, "fsdp2", 2, 2)
    assert state.extra_parallel_names == ["ep"] and state.ep_enabled
    mesh = state.device_mesh  # what verl reads: flattened groups by name on the device mesh
    assert mesh["sp"].mesh.tolist() == [0, 1] and mesh["dp"].mesh.tolist() == [1, 3]
    assert mesh["dp_sp"].mesh.tolist() == [0, 1, 2, 3] and mesh["dp_shard_sp"].mesh.tolist() == [0, 1, 2, 3]
    assert mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("sp") == 1 and mesh["ulysses"].get_local_rank() == 1


def test_init_parallel_state_names_unnamed_extra_sizes_ep_as_verl_passes_them(fake_world):
    from veomni.distributed.parallel_state import init_parallel_state

    fake_world(0, 2)
    state = init_parallel_state(dp_size=2, dp_shard_size=2, extra_parallel_sizes=(2,), ulysses_size=1, dp_mode="ddp")
    assert state.extra_parallel_names == ["ep"] and state.ep_size == 2 and state.mode == "ddp"


def test_init_parallel_state_refuses_contradicting_veomni_keywords():
    from veomni.distributed.parallel_state import veomni_keywords

    with pytest.raises(ValueError, match="dp_mode"):
        veomni_keywords("ddp", "fsdp2", None, None, None)
    with pytest.raises(ValueError, match="ep_size or extra_parallel_sizes"):
        veomni_keywords("fsdp2", None, 2, [2], ["ep"])


# ------------------------------------------------------------------------------------------------ models
def test_build_foundation_model_takes_a_config_object_ops_implementation_and_a_token_classification_head(tmp_path):
    from transformers import AutoConfig

    from veomni.arguments import OpsImplementationConfig
    from veomni.models import build_foundation_model

    config = AutoConfig.from_pretrained(write_moe_config(str(tmp_path / "moe")))
    config.num_labels, config.architectures = 1, ["Qwen3MoeForTokenClassification"]  # as verl's critic rewrites it
    config.use_cache = True  # the build turns it off on its own copy
    ops = OpsImplementationConfig(attn_implementation="veomni_flash_attention_2_with_sp", moe_implementation="eager")
    model = build_foundation_model(config_path=config, torch_dtype="float32", ops_implementation=ops)
    assert type(model).__name__ == "Qwen3MoeForTokenClassification" and model.score.out_features == 1
    assert model.config._attn_implementation == "veomni_varlen"  # VeOmni's name for flash + Ulysses, mapped
    assert model.config._experts_implementation == "eager" and config.use_cache is True  # caller's object kept
    with pytest.raises(ValueError, match="attn_implementation='sdpa' but ops_implementation"):
        build_foundation_model(config_path=config, attn_implementation="sdpa", ops_implementation=ops)


def test_prepare_fa_kwargs_from_position_ids_gives_the_packed_row_boundaries():
    from veomni.utils.seqlen_pos_transform_utils import prepare_fa_kwargs_from_position_ids

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]])  # verl pads a packed row with a document of its own
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    assert cu_q.tolist() == [0, 3, 5, 9, 10] and cu_q.dtype == torch.int32 and cu_k is cu_q
    assert (max_q, max_k) == (4, 4)


def test_no_model_registers_a_checkpoint_tensor_converter_unless_it_asks(tmp_path):
    from veomni.models import build_foundation_model
    from veomni.models.checkpoint_tensor_loading import get_checkpoint_tensor_converter

    model = build_foundation_model(write_moe_config(str(tmp_path / "moe")), init_device="meta")
    assert get_checkpoint_tensor_converter(model) is None

    class Converter:
        def can_handle(self, name):
            return True

        def convert(self, name, tensor):
            return tensor

    model._create_checkpoint_tensor_converter = lambda m: Converter()
    assert isinstance(get_checkpoint_tensor_converter(model), Converter)


def _seed_moe_merge(state: dict, config) -> dict:
    """moe_merge.py of the seed pull request: per-expert keys stacked into one tensor per projection."""
    for i in range(config.num_hidden_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            experts = [state.pop(f"model.layers.{i}.mlp.experts.{j}.{proj}.weight") for j in range(config.num_experts)]
            state[f"model.layers.{i}.mlp.experts.{proj}"] = torch.stack(experts)
    return state


def _seed_moe_split(state: dict, config) -> dict:
    """moe_split.py: the reverse; each expert a view of the stacked tensor."""
    for i in range(config.num_hidden_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = state.pop(f"model.layers.{i}.mlp.experts.{proj}")
            for j in range(config.num_experts):
                state[f"model.layers.{i}.mlp.experts.{j}.{proj}.weight"] = stacked[j]
    return state


def _read_folder(folder: str) -> dict:
    return {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors") for k, v in load_file(os.path.join(folder, f)).items()}  # fmt: skip


def test_save_model_weights_runs_the_seed_moe_merge_and_split_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from veomni.models import build_tokenizer, save_model_weights

    config = AutoConfig.from_pretrained(write_moe_config(str(tmp_path / "cfg")))
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    original.save_pretrained(tmp_path / "hf")  # transformers writes per-expert keys
    tokenizer = build_tokenizer(write_tokenizer(str(tmp_path / "hf")))
    raw = _read_folder(str(tmp_path / "hf"))

    merged = _seed_moe_merge(dict(raw), config)
    save_model_weights(str(tmp_path / "merged"), merged, model_assets=[config, tokenizer], shard_size=200_000)
    saved = _read_folder(str(tmp_path / "merged"))
    assert os.path.isfile(tmp_path / "merged" / "model.safetensors.index.json")  # sharded, with transformers' index
    assert os.path.isfile(tmp_path / "merged" / "config.json") and os.path.isfile(
        tmp_path / "merged" / "tokenizer.json"
    )
    assert saved.keys() == merged.keys() and all(t.dtype == torch.bfloat16 for t in saved.values())  # VeOmni's default
    assert all(torch.equal(saved[k], merged[k].to(torch.bfloat16)) for k in merged)

    split = _seed_moe_split({k: v.float() for k, v in _read_folder(str(tmp_path / "merged")).items()}, config)
    save_model_weights(str(tmp_path / "split"), split, save_dtype=None, model_assets=[config, tokenizer])
    assert _read_folder(str(tmp_path / "split")).keys() == raw.keys()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "split", dtype=torch.float32)
    for name, tensor in original.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16).float()), name


# ----------------------------------------------------------------------------------- activation offload
def _tiny_mlp_grads(fwd, bwd):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(32, 64)
    with fwd:
        loss = net(x).square().mean()
    with bwd:
        loss.backward()
    return [p.grad.clone() for p in net.parameters()]


def test_activation_offloading_context_is_a_noop_on_cpu_with_the_same_gradients():
    from contextlib import nullcontext

    from veomni.distributed.offloading import build_activation_offloading_context

    expected = _tiny_mlp_grads(nullcontext(), nullcontext())
    for checkpointing in (False, True):  # the seed's positional call
        fwd, bwd = build_activation_offloading_context(True, checkpointing, 0.0)
        assert isinstance(fwd, nullcontext) and isinstance(bwd, nullcontext)  # nothing to offload to
        assert all(torch.equal(a, b) for a, b in zip(_tiny_mlp_grads(fwd, bwd), expected))
    off = build_activation_offloading_context(False, False, 0.0)
    assert all(isinstance(c, nullcontext) for c in off)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="activation offload moves activations off a CUDA device")
def test_activation_offload_moves_saved_activations_to_host_on_cuda():
    from veomni.distributed.offloading import ActivationOffload, build_activation_offloading_context

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(8)])
    net = net.cuda()
    x = torch.randn(2048, 1024, device="cuda")

    def run(fwd, bwd):
        net.zero_grad()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with fwd:
            loss = net(x).square().mean()
        held = torch.cuda.memory_allocated() - before  # activations kept for backward
        with bwd:
            loss.backward()
        return held, [p.grad.clone() for p in net.parameters()]

    from contextlib import nullcontext

    plain_held, plain_grads = run(nullcontext(), nullcontext())
    fwd, bwd = build_activation_offloading_context(True, False, 0.0)
    assert isinstance(fwd, ActivationOffload)
    held, grads = run(fwd, bwd)
    assert fwd.offloaded_bytes > 8 * 2048 * 1024 * 4  # at least every layer's input went to the host
    assert held < plain_held / 4, (held, plain_held)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


# -------------------------------------------------------------------------------------------- parallelize
def test_build_parallelize_model_takes_the_seed_keywords_and_gives_clip_grad_norm(tmp_path, fake_world, caplog):
    from veomni.distributed.parallel_state import init_parallel_state
    from veomni.distributed.torch_parallelize import build_parallelize_model
    from veomni.models import build_foundation_model

    folder = write_moe_config(str(tmp_path / "moe"))
    fake_world(0, 1)  # FSDP2 on one rank: its collectives are no-ops
    init_parallel_state(dp_size=1, ep_size=1, dp_mode="fsdp2")
    torch.manual_seed(0)
    plain = build_foundation_model(folder, torch_dtype="float32", moe_implementation="eager")
    torch.manual_seed(0)
    module = build_foundation_model(folder, torch_dtype="float32", moe_implementation="eager")
    logger = logging.getLogger("veomni.distributed.torch_parallelize")  # ours writes to stdout, not to the root
    logger.addHandler(caplog.handler)
    try:
        model = build_parallelize_model(  # the seed pull request's call, keyword for keyword
            module,
            init_device="cpu",
            weights_path=None,
            enable_full_shard=False,
            enable_mixed_precision=True,
            enable_gradient_checkpointing=True,
            enable_fsdp_offload=False,
            basic_modules=list(module._no_split_modules),  # a set in transformers 5
            enable_reentrant=False,
            enable_forward_prefetch=True,
            fqn_to_index_mapping={},  # VeOmni's (verl 0.9.1 passes it): accepted with a warning
        )
    finally:
        logger.removeHandler(caplog.handler)
    assert "ignores ['fqn_to_index_mapping']" in caplog.text
    ids = torch.randint(0, 512, (1, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # verl wraps every forward so; fp32 compute is kept
        loss = model(input_ids=ids, labels=ids).loss
    plain_loss = plain(input_ids=ids, labels=ids).loss
    assert torch.allclose(loss, plain_loss, rtol=1e-6, atol=0), (loss, plain_loss)
    loss.backward()
    plain_loss.backward()
    norm = model.clip_grad_norm_(1.0)
    expected = torch.nn.utils.get_total_norm([p.grad.double() for p in plain.parameters()])
    assert torch.is_tensor(norm) and abs(norm.item() - expected.item()) <= 1e-5 * expected.item()
    with pytest.raises(ValueError, match="not both"):
        build_parallelize_model(module, enable_mixed_precision=True, mixed_precision=True)


def test_multi_optimizer_has_veomni_interface():
    from veomni.optim import MultiOptimizer

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = MultiOptimizer({"adamw": torch.optim.AdamW([a]), "muon": torch.optim.SGD([b], lr=0.1)})
    assert opt._is_multi_optimizer and opt.key_names == ["adamw", "muon"]
