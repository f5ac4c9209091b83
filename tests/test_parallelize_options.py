"""build_parallelize_model options on 2 gloo ranks: activation checkpointing (reentrant or not), CPU offload and
meta init change nothing numerically; bf16 mixed precision trains close to fp32."""

import pytest

from helpers import assert_close_series, run_text_task, tiny_run_config

STEPS = ["--train.max_steps", "4"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("options"))
    config = tiny_run_config(tmp)
    return config, tmp, run_text_task(config, 2, f"{tmp}/base", STEPS)


@pytest.mark.parametrize(
    "name,flags",
    [
        ("checkpointing", ["--train.gradient_checkpointing.enable", "true"]),
        (
            "reentrant",
            [
                "--train.gradient_checkpointing.enable",
                "true",
                "--train.gradient_checkpointing.enable_reentrant",
                "true",
            ],
        ),
        ("offload", ["--train.accelerator.fsdp_config.offload", "true"]),
        ("meta_init", ["--train.init_device", "meta"]),
    ],
)
def test_option_is_numerically_transparent(baseline, name, flags):
    config, tmp, base = baseline
    got = run_text_task(config, 2, f"{tmp}/{name}", STEPS + flags)
    if name == "meta_init":  # rank 0 initialises from the same seed and broadcasts: same start
        got_first = got[0]["loss"]
        assert abs(got_first - base[0]["loss"]) <= 1e-5 * base[0]["loss"]
    assert_close_series([m["loss"] for m in base], [m["loss"] for m in got], 1e-5, f"{name} loss")
    assert_close_series([m["grad_norm"] for m in base], [m["grad_norm"] for m in got], 1e-5, f"{name} grad_norm")


def test_bf16_mixed_precision_tracks_fp32(baseline):
    config, tmp, base = baseline
    got = run_text_task(
        config, 2, f"{tmp}/bf16", STEPS + ["--train.accelerator.fsdp_config.mixed_precision.param_dtype", "bfloat16"]
    )
    diffs = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, base)]
    assert max(diffs) < 2e-2  # bf16 compute: close, not equal
    assert max(diffs) > 0  # and it really ran in bf16
