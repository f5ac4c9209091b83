"""Precision per device: fp32 master weights with bf16 compute on CUDA by default, fp32 on CPU and under DDP,
pure bf16 only when asked for (with a warning). The CUDA decisions are resolved here with device_type="cuda";
the lost-update effect itself is shown with FSDP2 on CPU (bf16 compute works there, only slowly)."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from veomni.arguments import MixedPrecisionArguments, VeOmniArguments, parse_args
from veomni.distributed import mixed_precision as mp


def _resolve(device_type, mode="fsdp2", **keys):
    return mp.resolve_precision(MixedPrecisionArguments(**keys), device_type, mode)


@pytest.fixture
def warnings_seen(monkeypatch):
    seen = []
    mp._warn_pure.cache_clear()
    monkeypatch.setattr(mp.logger, "warning", lambda message: seen.append(message))
    yield seen
    mp._warn_pure.cache_clear()


@pytest.mark.parametrize(
    "device_type,mode,keys,param_dtype,compute,reduce",
    [
        ("cuda", "fsdp2", {}, torch.float32, torch.bfloat16, torch.float32),  # the default on a GPU
        ("cpu", "fsdp2", {}, torch.float32, None, None),  # plain fp32 on CPU
        ("cuda", "ddp", {}, torch.float32, torch.bfloat16, torch.float32),  # DDP: autocast bf16 over fp32
        ("cpu", "fsdp2", {"param_dtype": "bfloat16"}, torch.float32, torch.bfloat16, torch.float32),
        ("cuda", "fsdp2", {"param_dtype": "float32"}, torch.float32, None, None),
        ("cuda", "fsdp2", {"reduce_dtype": "bfloat16"}, torch.float32, torch.bfloat16, torch.bfloat16),
        ("cuda", "fsdp2", {"enable": False}, torch.bfloat16, None, None),  # pure bf16: asked for
        ("cpu", "fsdp2", {"enable": False}, torch.float32, None, None),
        ("cuda", "fsdp2", {"enable": False, "param_dtype": "float16"}, torch.float16, None, None),
    ],
)
def test_resolved_precision(device_type, mode, keys, param_dtype, compute, reduce):
    got = _resolve(device_type, mode, **keys)
    assert got.param_dtype == param_dtype
    if compute is None:
        assert got.policy is None
    else:
        assert (got.policy.param_dtype, got.policy.reduce_dtype) == (compute, reduce)


def test_parsed_defaults_give_fp32_master_weights_on_cuda():
    args = parse_args(VeOmniArguments, [])
    fsdp = args.train.accelerator.fsdp_config
    got = mp.resolve_precision(fsdp.mixed_precision, "cuda", fsdp.fsdp_mode)
    assert got.param_dtype == torch.float32 and got.policy.param_dtype == torch.bfloat16
    assert fsdp.mixed_precision.param_dtype is None  # the saved config stays portable: resolved per machine


def test_pure_bf16_warns_and_default_does_not(warnings_seen):
    _resolve("cuda")
    _resolve("cpu", enable=False)
    assert warnings_seen == []
    _resolve("cuda", enable=False)
    assert len(warnings_seen) == 1 and "pure bfloat16" in warnings_seen[0] and "enable true" in warnings_seen[0]


def _fraction_unchanged_after_training(precision, steps=10, lr=5e-5) -> float:
    """Build like the trainer (model in precision.param_dtype, FSDP2 with its policy), take AdamW steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(precision.param_dtype)
    fully_shard(model, mp_policy=precision.policy or MixedPrecisionPolicy())
    before = [p.full_tensor().detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        x = torch.randn(16, 64, dtype=precision.param_dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    after = [p.full_tensor().detach().float() for p in model.parameters()]
    unchanged = sum(int((a == b).sum()) for a, b in zip(after, before))
    return unchanged / sum(b.numel() for b in before)


def test_default_keeps_small_updates_that_pure_bf16_loses(one_process_group):
    """lr 5e-5, 10 AdamW steps: with the CUDA default (fp32 master, bf16 compute) every weight moves; pure bf16
    leaves most of them unchanged (the H100 measurement: 47%)."""
    default = _fraction_unchanged_after_training(_resolve("cuda"))
    pure = _fraction_unchanged_after_training(_resolve("cuda", enable=False))
    assert default == 0.0, f"{default:.1%} of the weights never moved with fp32 master weights"
    assert pure > 0.3, f"pure bf16 lost only {pure:.1%} of the updates: the comparison shows nothing"


def test_ddp_computes_in_bf16_over_fp32_masters_like_fsdp2(tmp_path):
    """2 gloo ranks, the same data: DDP with param_dtype bfloat16 (autocast over fp32 parameters) follows FSDP2's
    bf16 policy within bf16 tolerance, step by step, while plain fp32 DDP is visibly elsewhere (so bf16 is on)."""
    from helpers import read_metrics, run_text_tasks, tiny_run_config

    config = tiny_run_config(str(tmp_path))
    bf16 = ["--train.accelerator.fsdp_config.mixed_precision.param_dtype", "bfloat16", "--train.max_steps", "4"]
    runs = {
        "fsdp2_bf16": bf16 + ["--train.accelerator.fsdp_config.fsdp_mode", "fsdp2"],
        "ddp_bf16": bf16 + ["--train.accelerator.fsdp_config.fsdp_mode", "ddp"],
        "ddp_fp32": ["--train.max_steps", "4", "--train.accelerator.fsdp_config.fsdp_mode", "ddp"],
    }
    run_text_tasks(2, [(config, str(tmp_path / name), flags) for name, flags in runs.items()])
    got = {name: read_metrics(str(tmp_path / name)) for name in runs}
    assert len(got["fsdp2_bf16"]) == len(got["ddp_bf16"]) == 4
    for step, (fsdp, ddp) in enumerate(zip(got["fsdp2_bf16"], got["ddp_bf16"]), 1):
        for key, tol in (("loss", 2e-3), ("grad_norm", 1e-2)):  # bf16: ~3 significant digits
            assert abs(ddp[key] - fsdp[key]) <= tol * abs(fsdp[key]), (step, key, ddp[key], fsdp[key])
    assert got["ddp_bf16"] != got["ddp_fp32"]  # (a tiny model at init: bf16 moves the loss by ~1e-5 only)


def test_ddp_forward_runs_in_bf16_with_fp32_parameters_and_gradients(one_process_group):
    """apply_ddp with a bf16 compute dtype: every linear computes in bf16, parameters and their gradients (what
    DDP all-reduces and AdamW updates) stay fp32."""
    from veomni.arguments import MixedPrecisionArguments
    from veomni.distributed.fsdp import apply_ddp
    from veomni.distributed.parallel_dims import ParallelDims
    from veomni.distributed.parallel_state import ParallelState

    state = ParallelState.from_dims(ParallelDims.resolve(1), mode="ddp")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    apply_ddp(model, state, MixedPrecisionArguments(param_dtype="bfloat16"))
    seen = []
    for layer in (model[0], model[2]):
        layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model(torch.randn(8, 16)).float().pow(2).mean().backward()
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
