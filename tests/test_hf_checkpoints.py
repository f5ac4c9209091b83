"""Checkpoints as users bring them from the hub and take to serving: every family the project builds, written by
transformers' own `save_pretrained`, loads with every tensor equal to `from_pretrained` and the same logits on a real
sample; the project's export holds exactly the keys and tensors transformers writes, and reloads in transformers.
Plus the ways a checkpoint can be wrong, each said in one line."""

import json
import os
import re

import pytest
import torch
from hf_families import FAMILIES, FULL_OMNI, family_config, hf_class, real_batch, thinker_of, transformers_load
from hf_families import write_checkpoint as write_hub_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import REPO, torchrun
from veomni.checkpoint import save_hf_model
from veomni.models import build_foundation_model
from veomni.models.loader import CheckpointFiles, WeightsMismatchError

PER_EXPERT = ("qwen3_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe")  # Qwen3-VL-MoE's hub keys are fused
SHARDED = ("qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_omni_moe_thinker")  # the others: one model.safetensors


def _tensors(folder: str) -> dict:
    with CheckpointFiles(folder) as files:
        return {key: files.read(key) for key in files.keys()}


def _assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (
        f"{what}: extra {sorted(set(got) - set(want))[:4]}, missing {sorted(set(want) - set(got))[:4]}"
    )
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, f"{what}: tensors differ: {unequal[:4]}"


def _logits(model, batch):
    with torch.no_grad():
        return model.eval()(**batch, use_cache=False).logits


@pytest.mark.parametrize("name", FAMILIES + FULL_OMNI)
def test_hub_checkpoint_loads_as_transformers_and_exports_as_it_saves(
    name, tmp_path, mm_assets, mm_processors, one_process_group
):
    folder = write_hub_checkpoint(name, str(tmp_path / "hub"), max_shard_size="300KB" if name in SHARDED else None)
    if name in SHARDED:
        assert os.path.isfile(tmp_path / "hub" / "model.safetensors.index.json")
    reference = transformers_load(name, folder)
    ours = build_foundation_model(folder, folder, torch_dtype="float32")
    _assert_same_tensors(ours.state_dict(), reference.state_dict(), f"{name} loaded")
    batch = real_batch(thinker_of(name), ours.config, mm_processors, mm_assets)
    torch.testing.assert_close(_logits(ours, batch), _logits(reference, batch), rtol=0, atol=0)

    save_hf_model(ours, str(tmp_path / "export"), max_shard_bytes=400_000)
    if name in FULL_OMNI:  # the thinker is trained and exported: as transformers saves a thinker of its own
        thinker = hf_class(ours.config).from_config(ours.config)
        thinker.load_state_dict(reference.state_dict())
        thinker.save_pretrained(str(tmp_path / "expected"))
        folder = str(tmp_path / "expected")
    _assert_same_tensors(_tensors(str(tmp_path / "export")), _tensors(folder), f"{name} export")
    reloaded = transformers_load(thinker_of(name), str(tmp_path / "export"))
    torch.testing.assert_close(_logits(reloaded, batch), _logits(reference, batch), rtol=0, atol=0)
    if name in PER_EXPERT:  # the hub's per-expert keys, never the fused tensors servers cannot read
        keys = _tensors(str(tmp_path / "export")).keys()
        assert not any(k.endswith("gate_up_proj") for k in keys)
        assert any(".experts.11.gate_proj" in k or ".experts.3.gate_proj" in k for k in keys), sorted(keys)[:5]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_moe"])
def test_the_models_own_layout_loads_too(name, tmp_path):
    """Current key names (model.language_model.*) and fused experts, as a checkpoint of the model's own state."""
    folder = write_hub_checkpoint(name, str(tmp_path / "hub"))
    reference = transformers_load(name, folder)
    own = str(tmp_path / "own")
    os.makedirs(own)
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    if reference.config.get_text_config().tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, os.path.join(own, "model.safetensors"))
    reference.config.save_pretrained(own)
    assert any("language_model" in k or "gate_up_proj" in k for k in state)
    ours = build_foundation_model(own, own, torch_dtype="float32")
    _assert_same_tensors(ours.state_dict(), reference.state_dict(), f"{name} own layout")


ROUND_TRIPS = (
    "qwen3_moe:fsdp2:local",  # per-expert keys fused on load, each rank reading its own slices
    "qwen2_5_vl:fsdp2:broadcast",  # hub names renamed, rank 0 reading and broadcasting
    "qwen3_moe:ep2:broadcast",
    "qwen3_moe:ep2:local",
    "qwen3:tp2:local",  # tied embeddings, vocab-parallel embedding and head
)


def test_sharded_load_and_both_exports_round_trip_on_two_ranks(tmp_path):
    """FSDP2, EP 2 and TP 2 on 2 ranks: loaded equal to from_pretrained; the live export and the DCP checkpoint's
    export (dcp_to_hf) both hold exactly the hub folder's keys and tensors."""
    script = os.path.join(REPO, "tests", "dist", "check_hf_round_trip.py")
    proc = torchrun(script, [str(tmp_path), *ROUND_TRIPS], 2, timeout=600)
    for case in ROUND_TRIPS:
        assert f"HF_ROUND_TRIP_OK {case}" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"read [1-9]\d* of \d+ tensors as this rank's slice only", proc.stdout + proc.stderr)


# --------------------------------------------------------------------------------------- bad checkpoints
@pytest.fixture(scope="module")
def moe_hub(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("moe"))
    return write_hub_checkpoint("qwen3_moe", folder), _tensors(folder)


def _rewrite(src: str, dst, state: dict) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(state, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_bad_checkpoints_are_named_in_one_line(moe_hub, tmp_path):
    folder, state = moe_hub
    expert = "model.layers.1.mlp.experts.7.down_proj.weight"
    missing = {k: v for k, v in state.items() if k != expert}
    with pytest.raises(WeightsMismatchError, match=r"'model.layers.1.mlp.experts.down_proj' has shape \(11,"):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "a", missing), torch_dtype="float32")

    norm = "model.layers.2.post_attention_layernorm.weight"
    missing = {k: v for k, v in state.items() if k != norm}
    with pytest.raises(WeightsMismatchError, match=f"no tensor for the model's '{norm}'.*model.safetensors"):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "b", missing), torch_dtype="float32")

    extra = dict(state, **{"model.layers.0.mlp.bogus.weight": torch.zeros(2)})
    with pytest.raises(WeightsMismatchError, match="'model.layers.0.mlp.bogus.weight' matches no parameter"):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "c", extra), torch_dtype="float32")

    shaped = dict(state, **{norm: torch.zeros(7)})
    with pytest.raises(WeightsMismatchError, match=rf"'{norm}' has shape \(7,\), the model expects \(192,\)"):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "d", shaped), torch_dtype="float32")

    typed = dict(state, **{norm: torch.zeros(192, dtype=torch.int32)})
    with pytest.raises(WeightsMismatchError, match=f"'{norm}' is integer in the checkpoint"):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "e", typed), torch_dtype="float32")

    embed = state["model.embed_tokens.weight"]
    bigger = dict(state, **{"model.embed_tokens.weight": torch.cat([embed, embed[:10]])})
    with pytest.raises(
        WeightsMismatchError, match="vocabulary has 4106 rows and the model's config says vocab_size=4096"
    ):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "f", bigger), torch_dtype="float32")


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    folder = write_hub_checkpoint("qwen3", str(tmp_path / "hub"), max_shard_size="300KB")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    index["weight_map"]["model.norm.extra"] = index["weight_map"]["model.norm.weight"]
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(WeightsMismatchError, match="lists 'model.norm.extra' in .*, which does not hold it"):
        build_foundation_model(folder, folder, torch_dtype="float32")


def test_default_dtype_is_bf16_and_float32_is_exact(tmp_path):
    """build_foundation_model defaults to bf16 (the training dtype on GPUs): say it, and keep fp32 exact."""
    folder = write_hub_checkpoint("qwen3", str(tmp_path / "hub"))
    model = build_foundation_model(folder, folder)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert "bfloat16" in build_foundation_model.__doc__ and "float32" in build_foundation_model.__doc__
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.norm.weight")
    assert torch.equal(model.model.norm.weight, norm.to(torch.bfloat16))
    assert family_config("qwen3").tie_word_embeddings and "lm_head.weight" not in _tensors(folder)


def test_transformers_conversion_machinery_is_where_we_use_it():
    """veomni/models/hf_conversion.py drives transformers' (non-public) checkpoint conversion: if an upgrade moves
    or changes what it uses, this fails first, naming the piece, instead of a family test failing obscurely."""
    import inspect

    from transformers import conversion_mapping, core_model_loading

    assert callable(conversion_mapping.get_model_conversion_mapping), "get_model_conversion_mapping moved"
    assert "add_legacy" in inspect.signature(conversion_mapping.get_model_conversion_mapping).parameters
    for name in ("WeightRenaming", "WeightConverter", "PrefixChange", "Concatenate", "dot_natural_key"):
        assert hasattr(core_model_loading, name), f"transformers.core_model_loading.{name} moved"
    for method in ("rename_source_key", "reverse_transform", "add_tensor", "convert"):
        assert hasattr(core_model_loading.WeightTransform, method) or hasattr(
            core_model_loading.WeightConverter, method
        ), f"WeightTransform.{method} moved"
    convert = inspect.signature(core_model_loading.WeightConverter.convert).parameters
    assert {"layer_name", "model", "config"} <= set(convert), f"WeightConverter.convert now takes {list(convert)}"
    # behaviour: the MoE rule fuses per-expert keys, and reversed it splits them again
    from veomni.models.hf_conversion import convert_group, plan_load, plan_save

    with torch.device("meta"):
        model = hf_class(family_config("qwen3_moe")).from_config(family_config("qwen3_moe"))
    keys = [
        f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(12) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    plan = plan_load(model, keys, model.state_dict().keys())
    assert sorted(g.target for g in plan.groups) == [
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.1.mlp.experts.gate_up_proj",
    ]
    gate_up = next(g for g in plan.groups if g.target.endswith("gate_up_proj"))
    tensors = {k: torch.full((128, 192), float(i)) for i, k in enumerate(gate_up.keys)}
    fused = convert_group(gate_up, tensors, model)["model.layers.1.mlp.experts.gate_up_proj"]
    assert (
        fused.shape == (12, 256, 192)
        and fused[10, 0, 0] == tensors["model.layers.1.mlp.experts.10.gate_proj.weight"][0, 0]
    )
    (back,) = [g for g in plan_save(model, ["model.layers.1.mlp.experts.gate_up_proj"])]
    split = convert_group(back, {"model.layers.1.mlp.experts.gate_up_proj": fused}, model)
    assert torch.equal(
        split["model.layers.1.mlp.experts.10.up_proj.weight"], tensors["model.layers.1.mlp.experts.10.up_proj.weight"]
    )


# ------------------------------------------------------------------------- what from_pretrained tolerates
def _rewrite_hub(src: str, dst: str, state: dict, **config_overrides) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(dict(config, **config_overrides), f)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"))
    return dst


def test_tied_checkpoints_load_as_transformers_ties_them(tmp_path):
    """A tied model whose checkpoint holds only lm_head ties to it; one holding both, different, is refused (transformers
    would untie them, which this model is not built to do)."""
    hub = write_hub_checkpoint("qwen3", str(tmp_path / "hub"))  # tied, lm_head not saved
    state = _tensors(hub)
    only_head = {k: v for k, v in state.items() if k != "model.embed_tokens.weight"}
    only_head["lm_head.weight"] = state["model.embed_tokens.weight"]
    folder = _rewrite_hub(hub, str(tmp_path / "head"), only_head)
    _assert_same_tensors(build_foundation_model(folder, folder, torch_dtype="float32").state_dict(),
                         transformers_load("qwen3", folder).state_dict(), "only lm_head")  # fmt: skip
    both = dict(state, **{"lm_head.weight": torch.randn_like(state["model.embed_tokens.weight"])})
    folder = _rewrite_hub(hub, str(tmp_path / "both"), both)
    with pytest.raises(WeightsMismatchError, match="holds both with different values .* tie_word_embeddings=false"):
        build_foundation_model(folder, folder, torch_dtype="float32")


def test_keys_transformers_ignores_on_purpose_load(tmp_path):
    """An old checkpoint with per-layer rotary `inv_freq` buffers loads, as in from_pretrained."""
    hub = write_hub_checkpoint("llama", str(tmp_path / "hub"))
    state = _tensors(hub)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    folder = _rewrite_hub(hub, str(tmp_path / "old"), state)
    _assert_same_tensors(build_foundation_model(folder, folder, torch_dtype="float32").state_dict(),
                         transformers_load("llama", folder).state_dict(), "old llama")  # fmt: skip


def test_a_converted_group_that_does_not_convert_is_named(moe_hub, tmp_path):
    folder, state = moe_hub
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    bad = dict(state, **{key: torch.zeros(state[key].shape[0], state[key].shape[1] + 1)})
    with pytest.raises(
        WeightsMismatchError, match=r"model.safetensors \(12 tensors from .*do not convert to .*experts.down_proj"
    ):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "x", bad), torch_dtype="float32")
    gate = "model.layers.1.mlp.experts.3.gate_proj.weight"  # one expert's gate missing: counts differ per pattern
    with pytest.raises(WeightsMismatchError, match="converted from .* checkpoint keys per pattern"):
        build_foundation_model(folder, _rewrite(folder, tmp_path / "y", {k: v for k, v in state.items() if k != gate}))


@pytest.mark.usefixtures("one_process_group")
def test_exporting_twice_into_one_folder_leaves_no_stale_shards(tmp_path):
    from veomni.checkpoint import Checkpointer, dcp_to_hf
    from veomni.checkpoint.hf_export import architecture_of, export_config

    hub = write_hub_checkpoint("qwen3", str(tmp_path / "hub"))
    model = build_foundation_model(hub, hub, torch_dtype="float32")
    run = Checkpointer(str(tmp_path / "run"))
    attach = lambda folder: export_config(model.config, os.path.join(folder, "hf_config"), architecture_of(model))  # noqa: E731
    path = run.save(1, model, torch.optim.AdamW(model.parameters()), {}, {}, attach=attach)
    out = str(tmp_path / "hf")
    dcp_to_hf(path, out, max_shard_bytes=300_000)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    dcp_to_hf(path, out)  # one file now: the earlier shards and index must be gone, or a reader takes them
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
