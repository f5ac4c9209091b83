"""build_parallelize_model options on 2 gloo ranks: activation checkpointing (reentrant or not), CPU offload and
meta init change nothing numerically; bf16 mixed precision trains close to fp32."""

import pytest

from helpers import assert_close_series, run_text_tasks, tiny_run_config

STEPS = ["--train.max_steps", "4"]


OPTIONS = {
    "checkpointing": ["--train.gradient_checkpointing.enable", "true"],
    "reentrant": [
        "--train.gradient_checkpointing.enable",
        "true",
        "--train.gradient_checkpointing.enable_reentrant",
        "true",
    ],
    "offload": ["--train.accelerator.fsdp_config.offload", "true"],
    "meta_init": ["--train.init_device", "meta"],
    "bf16": ["--train.accelerator.fsdp_config.mixed_precision.param_dtype", "bfloat16"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The baseline and every option, one after another in a single 2-rank launch: {name: metrics}."""
    tmp = str(tmp_path_factory.mktemp("options"))
    config = tiny_run_config(tmp)
    names = ["base", *OPTIONS]
    metrics = run_text_tasks(2, [(config, f"{tmp}/{name}", STEPS + OPTIONS.get(name, [])) for name in names])
    return dict(zip(names, metrics))


@pytest.mark.parametrize("name", ["checkpointing", "reentrant", "offload", "meta_init"])
def test_option_is_numerically_transparent(runs, name):
    base, got = runs["base"], runs[name]
    if name == "meta_init":  # rank 0 initialises from the same seed and broadcasts: same start
        got_first = got[0]["loss"]
        assert abs(got_first - base[0]["loss"]) <= 1e-5 * base[0]["loss"]
    assert_close_series([m["loss"] for m in base], [m["loss"] for m in got], 1e-5, f"{name} loss")
    assert_close_series([m["grad_norm"] for m in base], [m["grad_norm"] for m in got], 1e-5, f"{name} grad_norm")


def test_bf16_mixed_precision_tracks_fp32(runs):
    base, got = runs["base"], runs["bf16"]
    diffs = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, base)]
    assert max(diffs) < 2e-2  # bf16 compute: close, not equal
    assert max(diffs) > 0  # and it really ran in bf16


def _layer_run(tmp_path, checkpointing, compiled):
    """Loss, gradients and the number of tensors saved for backward of the tiny model under FSDP2 (one rank)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from helpers import write_model_config
    from veomni.distributed.activation_checkpointing import apply_ac
    from veomni.distributed.compile import compile_basic_modules
    from veomni.distributed.fsdp import basic_module_instances, no_split_module_names
    from veomni.models import build_foundation_model

    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32")
    if checkpointing:
        apply_ac(model, reentrant=False)
    if compiled:
        compile_basic_modules(basic_module_instances(model, no_split_module_names(model)))
    for layer in model.model.layers:  # the FSDP<Layer> class swap comes after, as in build_parallelize_model
        fully_shard(layer)
    fully_shard(model)
    model.train()
    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    ids = torch.randint(3, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}, saved[0]


def test_compiled_layers_keep_activation_checkpointing_and_numerics(tmp_path, monkeypatch):
    """ops_implementation.compile under FSDP2 with checkpointing: the compiled forward is checkpointed (as few
    tensors saved as eager checkpointing; transformers' own wrapper would be skipped), and loss and gradients equal
    eager. dynamo traces for real; its `eager` backend stands in for inductor, whose cold CPU compile (~1 min) is
    kept out of CI (inductor is checked against eager on a GPU in tests/test_cuda.py)."""
    import functools

    import torch
    import torch.distributed as dist
    from test_loss import _free_port

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        no_ckpt = _layer_run(tmp_path / "a", checkpointing=False, compiled=False)
        eager = _layer_run(tmp_path / "b", checkpointing=True, compiled=False)
        compiled = _layer_run(tmp_path / "c", checkpointing=True, compiled=True)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    assert compiled[2] == eager[2] < no_ckpt[2] / 2, (compiled[2], eager[2], no_ckpt[2])
    assert abs(compiled[0] - eager[0]) <= 1e-6 * eager[0]
    for name, grad in eager[1].items():
        torch.testing.assert_close(compiled[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    args = parse_args_with_compile(tmp_path)
    assert args.model.ops_implementation.compile is True


def parse_args_with_compile(tmp_path):
    from veomni.arguments import VeOmniArguments, parse_args

    argv = ["--model.config_path", str(tmp_path / "a"), "--data.train_path", str(tmp_path / "a"),
            "--model.ops_implementation.compile", "true"]  # fmt: skip
    return parse_args(VeOmniArguments, argv)
