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
