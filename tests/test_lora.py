"""LoRA through PEFT on the demo-shaped model (configs/model/demo_qwen2: 4M parameters, tied embeddings) loaded from
an HF checkpoint, fp32 on CPU: 2-rank FSDP2 (built on meta) equals one process; a resume equals the uninterrupted
run bit for bit; the merged export is base + (alpha / r) * B @ A under the hub keys and loads in transformers; the
adapter export loads with `PeftModel.from_pretrained`; only adapters get gradients and optimizer state; DDP with
reentrant activation checkpointing equals one process, and bf16 mixed precision with checkpointing trains."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from helpers import (
    REPO,
    assert_close_series,
    read_metrics,
    torchrun,
    write_token_data,
    write_tokenizer,
)
from veomni.arguments import ConfigError, VeOmniArguments, parse_args
from veomni.checkpoint.safe_reader import SafeFileSystemReader

SCRIPT = os.path.join(REPO, "tests", "dist", "lora_scenarios.py")
DEMO_MODEL = os.path.join(REPO, "configs", "model", "demo_qwen2")
R, ALPHA, TARGETS = 8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
RTOL = 1e-5


def _write_base(folder: str) -> str:
    """The "pretrained" base: the demo model with a seeded random init, saved by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_MODEL), dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def _config(tmp: str, base: str) -> str:
    config = {
        "model": {
            "model_path": base,
            "tokenizer_path": write_tokenizer(os.path.join(tmp, "tokenizer")),
            "lora": {"enable": True, "r": R, "alpha": ALPHA, "target_modules": TARGETS},
        },
        "data": {"train_path": write_token_data(os.path.join(tmp, "data.jsonl"), vocab=4096), "max_seq_len": 64},
        "train": {
            "seed": 0,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "dyn_bsz": False,
            "max_steps": 10,
            "log_steps": 100,
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1},  # constant: a 4-step run follows a 10-step one
            "checkpoint": {"save_hf_weights": True},
        },
    }
    path = os.path.join(tmp, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def _launch(nproc: int, config: str, runs: dict) -> None:
    argv = []
    for i, (out, flags) in enumerate(runs.items()):
        argv += (["::"] if i else []) + [config, "--train.checkpoint.output_dir", out, *flags]
    torchrun(SCRIPT, argv, nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (merged export) and, in one 2-rank launch: FSDP2 built on meta (checkpoints at 5 and 10, adapter
    export), its resume from step 5, DDP with reentrant checkpointing, FSDP2 bf16 with checkpointing."""
    tmp = str(tmp_path_factory.mktemp("lora"))
    base = _write_base(os.path.join(tmp, "base"))
    config = _config(tmp, base)
    out = {name: os.path.join(tmp, name) for name in ("single", "fsdp2", "resumed", "ddp_ac", "bf16_ac")}
    _launch(1, config, {out["single"]: []})
    adapter = ["--model.lora.export", "adapter", "--train.checkpoint.save_steps", "5"]
    ac = ["--train.gradient_checkpointing.enable", "true"]
    resume_from = ["--train.checkpoint.load_path", os.path.join(out["fsdp2"], "checkpoints", "global_step_5")]
    short = ["--train.max_steps", "4", "--train.checkpoint.save_hf_weights", "false"]  # smoke tests of composition
    ddp = ["--train.accelerator.fsdp_config.fsdp_mode", "ddp"]
    bf16 = ["--train.accelerator.fsdp_config.mixed_precision.param_dtype", "bfloat16"]
    two_ranks = {
        out["fsdp2"]: ["--train.init_device", "meta", *adapter],
        out["resumed"]: ["--train.init_device", "meta", *adapter, *resume_from, *ac],  # recomputing changes no bit
        out["ddp_ac"]: [*ddp, *ac, *_flag("enable_reentrant"), *short],
        out["bf16_ac"]: [*bf16, *ac, *short],
    }
    _launch(2, config, two_ranks)
    return {"base": base, **out}


def _flag(name: str):
    return [f"--train.gradient_checkpointing.{name}", "true"]


def _losses(out: str):
    return [m["loss"] for m in read_metrics(out)]


def _report(out: str) -> dict:
    return torch.load(os.path.join(out, "lora_report.pt"))


def _checkpoint(out: str, step: int = 10) -> dict:
    """Every tensor of a DCP checkpoint (model.* and optim.*), read in this process."""
    folder = os.path.join(out, "checkpoints", f"global_step_{step}", "model_optimizer")
    saved = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()}
    state = {k: v for k, v in state.items() if isinstance(saved[k], TensorStorageMetadata)}
    dcp.load(state, storage_reader=SafeFileSystemReader(folder), no_dist=True)
    return state


def _model_tensors(out: str) -> dict:
    return {k[len("model.") :]: v for k, v in _checkpoint(out).items() if k.startswith("model.")}


def _adapters(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if ".lora_" in k}


def _base_weights(base: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(base, "model.safetensors"))


def _hf_name(key: str) -> str:
    return key.replace(".base_layer.", ".")


def _peft_model(base: str, adapters: dict):
    """transformers' base + PEFT's LoRA (get_peft_model) holding the trained adapters: the reference."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS))
    named = {k.replace(".default.", "."): v for k, v in adapters.items()}
    result = set_peft_model_state_dict(peft, {f"base_model.model.{k}": v for k, v in named.items()})
    assert not result.unexpected_keys
    return peft


def _logits(model, inputs: dict):
    with torch.no_grad():
        return model.eval()(**inputs, use_cache=False).logits.float()


# ------------------------------------------------------------------------------------------------- tests
def test_fsdp2_two_ranks_equal_one_process_and_base_stays_frozen(runs):
    single, fsdp2 = _losses(runs["single"]), _losses(runs["fsdp2"])
    assert len(single) == 10
    assert_close_series(single, fsdp2, RTOL, "2-rank FSDP2 vs 1 process loss")
    one, two = _model_tensors(runs["single"]), _model_tensors(runs["fsdp2"])
    assert sorted(_adapters(one)) == sorted(_adapters(two)) and len(_adapters(one)) == 2 * 5 * 4
    for name, value in _adapters(one).items():
        torch.testing.assert_close(two[name], value, rtol=RTOL, atol=1e-7, msg=name)
    # trained: B starts at zero (the loss of a random base barely moves in 10 steps, so it is not the signal)
    assert _adapters(one)["model.layers.0.self_attn.q_proj.lora_B.default.weight"].abs().max() > 1e-2
    for name in ("single", "fsdp2"):  # every frozen weight of the trained model, gathered, equals the base file's
        assert _report(runs[name])["base_changed"] == [], f"{name}: a base weight changed"
    for tensors in (one, two):  # the checkpoints hold the adapters, not the base they reference (next test)
        assert sorted(tensors) == sorted(_adapters(tensors))


def test_checkpoint_holds_adapters_and_optimizer_state_and_references_the_base(runs):
    """The DCP checkpoint: adapters, their Adam moments and the run state; meta.json names the base folder and the
    CRC-32 of its weights. Its size: adapters x 3 (weights, two moments) plus DCP's framing of each of its ~160
    tensors, 10% of the base here (40 adapters of r 8 on a 4M model), where it held the whole base before."""
    from veomni.checkpoint.integrity import file_crc32

    step = os.path.join(runs["fsdp2"], "checkpoints", "global_step_10")
    with open(os.path.join(step, "meta.json")) as f:
        record = json.load(f)["lora_base_model"]
    assert record["path"] == os.path.abspath(runs["base"])
    assert record["checksums"] == {"model.safetensors": file_crc32(os.path.join(runs["base"], "model.safetensors"))}
    saved = _checkpoint(runs["fsdp2"])
    adapters = {k: v for k, v in saved.items() if k.startswith("model.")}
    assert sorted(adapters) == sorted(_adapters(adapters))
    assert {k.split(".", 2)[1] for k in saved if k.startswith("optim.")} == {"optimizer"}
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    dcp_bytes = _folder_bytes(os.path.join(step, "model_optimizer"))
    base_bytes = os.path.getsize(os.path.join(runs["base"], "model.safetensors"))
    assert 3 * adapter_bytes < dcp_bytes < base_bytes / 8, (dcp_bytes, adapter_bytes, base_bytes)
    print(f"LoRA DCP checkpoint {dcp_bytes} bytes = {100 * dcp_bytes / base_bytes:.1f}% of the base ({base_bytes})")


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def test_sigkill_then_resume_repeats_the_run_bit_for_bit(runs, tmp_path):
    """The 2-rank FSDP2 run killed (SIGKILL to launcher and workers) after its step-5 checkpoint and resumed with
    load_path auto: steps 6-10 and the step-10 checkpoint (adapters and Adam state) equal the uninterrupted run's."""
    import sys
    import time

    from helpers import child_env, descendants, kill_tree, start_ranks

    out, config = str(tmp_path / "killed"), os.path.join(os.path.dirname(runs["base"]), "config.yaml")
    flags = ["--train.init_device", "meta", "--model.lora.export", "adapter", "--train.checkpoint.save_steps", "5"]
    cmd = [sys.executable, SCRIPT, "stall_at_6", config, "--train.checkpoint.output_dir", out, *flags]
    with open(os.devnull, "w") as null:
        ranks = start_ranks(cmd, 2, child_env(), null, null)
    latest, deadline = os.path.join(out, "checkpoints", "latest"), time.time() + 300
    while time.time() < deadline and not (os.path.isfile(latest) and open(latest).read() == "global_step_5"):
        assert all(rank.poll() is None for rank in ranks), "the run ended before its step-5 checkpoint"
        time.sleep(0.05)
    workers = [pid for rank in ranks for pid in [rank.pid, *descendants(rank.pid)]]
    for rank in ranks:
        kill_tree(rank.pid)  # every rank and its loader workers at once, as a node failure
    [rank.wait() for rank in ranks]
    for pid in workers:  # all gone before the resume starts
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            time.sleep(0.01)
    _launch(2, config, {out: [*flags, "--train.checkpoint.load_path", "auto"]})
    uninterrupted, resumed = read_metrics(runs["fsdp2"]), read_metrics(out)
    assert [m["step"] for m in resumed] == list(range(1, 11))
    for a, b in zip(uninterrupted[5:], resumed[5:]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)
    whole, again = _checkpoint(runs["fsdp2"]), _checkpoint(out)
    assert sorted(whole) == sorted(again) and [k for k in whole if not torch.equal(whole[k], again[k])] == []


def test_resume_equals_the_uninterrupted_run_exactly(runs):
    uninterrupted, resumed = read_metrics(runs["fsdp2"]), read_metrics(runs["resumed"])
    assert [m["step"] for m in resumed] == [6, 7, 8, 9, 10]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in uninterrupted[5:]]
    whole, again = _checkpoint(runs["fsdp2"]), _checkpoint(runs["resumed"])
    assert sorted(whole) == sorted(again) and any(k.startswith("optim.") for k in whole)
    assert [k for k in whole if not torch.equal(whole[k], again[k])] == []  # adapters, base and Adam state


def test_merged_export_is_base_plus_scaled_product_and_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    folder, base = os.path.join(runs["single"], "hf"), _base_weights(runs["base"])
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    exported = _base_weights(folder)
    assert sorted(exported) == sorted(base)  # the hub keys exactly (lm_head tied: not written)
    adapters = _adapters(_model_tensors(runs["single"]))
    for key in base:
        module = key[: -len(".weight")]
        a = adapters.get(f"{module}.lora_A.default.weight")
        expected = base[key] if a is None else base[key] + (ALPHA / R) * adapters[f"{module}.lora_B.default.weight"] @ a
        torch.testing.assert_close(exported[key], expected, rtol=1e-6, atol=1e-7, msg=key)
    report = _report(runs["single"])
    reference = _logits(_peft_model(runs["base"], adapters), report["inputs"])
    torch.testing.assert_close(_logits(merged, report["inputs"]), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(report["logits"], reference, rtol=1e-5, atol=1e-5)


def test_adapter_export_loads_with_peft_and_gives_the_trained_logits(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = os.path.join(runs["fsdp2"], "hf")
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (R, ALPHA, sorted(TARGETS))
    base = AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch.float32)
    model, report = PeftModel.from_pretrained(base, folder), _report(runs["fsdp2"])
    torch.testing.assert_close(_logits(model, report["inputs"]), report["logits"], rtol=1e-5, atol=1e-5)


def test_converting_a_lora_checkpoint_is_refused_naming_why(runs, tmp_path):
    from veomni.checkpoint.hf_export import dcp_to_hf

    checkpoint = os.path.join(runs["single"], "checkpoints", "global_step_10")
    with pytest.raises(ValueError, match="holds LoRA adapters"):
        dcp_to_hf(checkpoint, str(tmp_path / "hf"))


def test_only_adapters_get_gradients_and_optimizer_state(runs):
    adapters = sorted(_adapters(_model_tensors(runs["single"])))
    for name in ("single", "fsdp2", "ddp_ac"):
        report = _report(runs[name])
        assert report["grad_names"] == adapters, name
        assert report["optim_names"] == adapters, name
    numel = sum(v.numel() for v in _adapters(_model_tensors(runs["single"])).values())
    assert _report(runs["fsdp2"])["optim_bytes"] == 2 * 4 * numel  # Adam's two fp32 moments, adapters only
    assert numel < 0.03 * sum(v.numel() for v in _base_weights(runs["base"]).values())


def test_ddp_with_reentrant_checkpointing_equals_one_process_and_bf16_trains(runs):
    single = _losses(runs["single"])
    assert_close_series(single[:4], _losses(runs["ddp_ac"]), RTOL, "2-rank DDP + reentrant checkpointing loss")
    assert_close_series(single[:4], _losses(runs["bf16_ac"]), 2e-3, "2-rank FSDP2 bf16 + checkpointing loss")


# -------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "flags,key",
    [
        (["--model.lora.r", "0"], "model.lora.r"),
        (["--model.lora.alpha", "0"], "model.lora.alpha"),
        (["--model.lora.dropout", "1"], "model.lora.dropout"),
        (["--model.lora.target_modules", "[]"], "model.lora.target_modules"),
        (["--model.lora.target_modules", "[all-linear, q_proj]"], "model.lora.target_modules"),
        (["--model.lora.target_modules", "['re:(q_proj']"], "model.lora.target_modules"),
        (["--model.lora.export", "both"], "model.lora.export"),
        (["--train.accelerator.tp_size", "2"], "model.lora.enable"),
    ],
)
def test_bad_lora_settings_name_the_key(flags, key):
    with pytest.raises(ConfigError, match=rf"key '{key}'"):
        parse_args(VeOmniArguments, ["--model.lora.enable", "true", *flags])


def test_target_modules_forms_and_a_miss_names_the_key():
    from transformers import AutoConfig, AutoModelForCausalLM

    from veomni.models.lora import attach_lora

    def adapted(targets):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_MODEL))
        args = parse_args(VeOmniArguments, ["--model.lora.enable", "true", "--model.lora.target_modules", targets])
        return sorted({k.split(".lora_")[0] for k in attach_lora(model, args.model.lora, seed=0)})

    assert adapted("[q_proj, v_proj]") == [
        f"model.layers.{i}.self_attn.{m}" for i in range(4) for m in ("q_proj", "v_proj")
    ]
    assert len(adapted("[all-linear]")) == 7 * 4  # every linear of the 4 layers, not lm_head
    assert adapted("['re:.*layers\\.0\\..*gate_proj']") == ["model.layers.0.mlp.gate_proj"]
    with pytest.raises(ValueError, match=r"model.lora.target_modules=\['qkv'\].*q_proj"):
        adapted("[qkv]")
    with pytest.raises(ValueError, match=r"adapts lm_head, whose weight is tied"):
        adapted("[lm_head]")


def test_the_adapter_records_the_base_folder_absolute(tmp_path, monkeypatch):
    """A relative `model.model_path` (`outputs/sft_demo/hf`) was recorded as given: `AutoPeftModelForCausalLM
    .from_pretrained(adapter)` then failed from any other directory."""
    from veomni.arguments.arguments_types import LoraArguments
    from veomni.models.lora import lora_config

    monkeypatch.chdir(tmp_path)
    os.makedirs("outputs/sft_demo/hf")
    config = lora_config(LoraArguments(enable=True), "outputs/sft_demo/hf")
    assert config.base_model_name_or_path == str(tmp_path / "outputs" / "sft_demo" / "hf")
    assert lora_config(LoraArguments(enable=True), "Qwen/Qwen3-0.6B").base_model_name_or_path == "Qwen/Qwen3-0.6B"
