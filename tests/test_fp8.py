"""`train.fp8`: torchao float8 training of the linear layers large enough to gain, on CPU (torchao's float8 matmul
runs there through torch._scaled_mm; the speed is the GPU's business, benchmarks/gpu_speed.py).

* the layers converted are exactly the intended ones: on Qwen3-1.7B's real shapes (built on meta) per recipe, and
  never the output head;
* 20 trainer steps on real text (Shakespeare, the demo tokenizer) with fp8 tensorwise stay within 2% of the same
  run in bf16, step by step;
* rowwise: one converted layer's output and gradients against bf16 (the 20-step run would need > 1024-wide layers).
"""

import json
import os

import pytest
import torch
import yaml
from torch import nn

from helpers import REPO, launch_sequence, read_metrics
from veomni.distributed.fp8 import apply_fp8, fp8_layer_names

pytest.importorskip("torchao")  # in the dev extra: CI has it


def _meta_model(name):
    from veomni.models import build_foundation_model

    return build_foundation_model(
        os.path.join(REPO, "configs", "model", name), init_device="meta", torch_dtype="float32"
    )


# per layer of Qwen3-1.7B (hidden 2048, 16 x 128 query heads, 8 x 128 KV heads, intermediate 6144), weight N x K:
#   q_proj 2048x2048, k/v_proj 1024x2048, o_proj 2048x2048, gate/up 6144x2048, down 2048x6144, lm_head 151936x2048
INTENDED = {
    "tensorwise": {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"},
    "rowwise": {"mlp.gate_proj", "mlp.up_proj"},
}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_converted_layers_are_the_intended_ones(recipe):
    from torchao.float8.float8_linear import Float8Linear

    model = _meta_model("qwen3_1_7b")
    layers = model.config.num_hidden_layers
    want = {f"model.layers.{i}.{name}" for i in range(layers) for name in INTENDED[recipe]}
    assert set(fp8_layer_names(model, recipe)) == want
    counts = apply_fp8(model, recipe)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == want and counts["converted"] == len(want)
    assert type(model.lm_head) is nn.Linear  # the head keeps its precision (and is large enough to qualify)


def test_fp8_refusals_name_the_key():
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="train.fp8='fast'"):
        apply_fp8(model, "fast")
    with pytest.raises(ValueError, match="tensor parallel"):
        apply_fp8(model, "rowwise", tp_size=2)
    assert apply_fp8(model, "off") == {}


def test_rowwise_layer_follows_bf16():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(1088, 4160, bias=False))  # the smallest shape class rowwise converts
    fp8 = nn.Sequential(nn.Linear(1088, 4160, bias=False))
    fp8.load_state_dict(ref.state_dict())
    convert_to_float8_training(fp8, config=Float8LinearConfig.from_recipe_name("rowwise"))
    x = torch.randn(64, 1088)
    grads = []
    for model in (ref, fp8):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(leaf)
        out.float().square().mean().backward()
        grads.append((out.float(), leaf.grad, model[0].weight.grad))
    for want, got in zip(*grads):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 0.1, err  # float8 (e4m3) carries ~2 significant digits
    assert type(fp8[0]).__name__ == "Float8Linear"


def _real_text_config(tmp):
    from veomni.utils.demo_assets import ensure_demo_assets

    root = ensure_demo_assets(os.path.join(REPO, ".assets"), quiet=True)
    model = os.path.join(tmp, "model")
    os.makedirs(model)
    with open(os.path.join(REPO, "configs", "model", "demo_qwen3", "config.json")) as f:
        config = json.load(f)
    # intermediate 1088 > 1024: gate_proj and up_proj (1088 x 64) qualify for tensorwise; the rest are too small
    config.update(vocab_size=4096, intermediate_size=1088, num_hidden_layers=2, tie_word_embeddings=False)
    config.update(bos_token_id=None, eos_token_id=None)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    run = {
        "model": {"config_path": model, "tokenizer_path": f"{root}/tokenizer"},
        "data": {"train_path": f"{root}/shakespeare/valid.jsonl", "data_type": "plaintext", "text_keys": "text",
                 "max_seq_len": 128, "datasets_type": "mapping"},
        "train": {"seed": 0, "micro_batch_size": 2, "global_batch_size": 2, "dyn_bsz": True, "max_steps": 20,
                  "optimizer": {"lr": 3e-3, "lr_warmup_ratio": 0.1},
                  "accelerator": {"fsdp_config": {"mixed_precision": {"param_dtype": "bfloat16"}}},
                  "log_steps": 100},
    }  # fmt: skip
    path = os.path.join(tmp, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(run, f)
    return path


def test_twenty_steps_of_fp8_follow_bf16_on_real_text(tmp_path):
    config = _real_text_config(str(tmp_path))
    runs = [("plain", config, str(tmp_path / name), ["--train.fp8", name]) for name in ("off", "tensorwise")]
    proc = launch_sequence(1, runs)
    assert "train.fp8=tensorwise: 4 of 15 linear layers train in float8" in proc.stdout
    bf16, fp8 = read_metrics(str(tmp_path / "off")), read_metrics(str(tmp_path / "tensorwise"))
    assert len(bf16) == len(fp8) == 20
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(fp8, bf16))
    assert worst <= 0.02, [(round(a["loss"], 4), round(b["loss"], 4)) for a, b in zip(fp8, bf16)]
    assert bf16[-1]["loss"] < 0.9 * bf16[0]["loss"]  # it learns: the comparison is over a moving loss
    assert fp8 != bf16  # float8 really ran (the losses are not bit-identical)
