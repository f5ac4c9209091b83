"""Loading HF safetensors (single file and sharded index) and meta-init + rank-0 broadcast."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from helpers import REPO, torchrun, write_model_config
from veomni.models import build_foundation_model, iter_safetensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with random weights saved as a 2-shard safetensors checkpoint with an index."""
    folder = str(tmp_path_factory.mktemp("ckpt"))
    write_model_config(folder, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = build_foundation_model(folder, init_device="cpu", torch_dtype="float32")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, os.path.join(folder, file))
        weight_map.update({k: file for k in keys})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder, state


def test_sharded_index_load_is_exact(model_dir):
    folder, state = model_dir
    model = build_foundation_model(folder, folder, init_device="cpu", torch_dtype="float32")
    loaded = model.state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie survives loading
    assert len(dict(iter_safetensors(folder))) == len(state)


def test_single_file_and_bad_checkpoint_errors(model_dir, tmp_path):
    folder, state = model_dir
    write_model_config(str(tmp_path), tie_word_embeddings=True)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = build_foundation_model(str(tmp_path), str(tmp_path), torch_dtype="float32")
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
    bad = dict(state)
    bad["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="gate_proj.weight' has shape"):
        build_foundation_model(str(tmp_path), str(tmp_path), torch_dtype="float32")
    del bad["model.layers.0.mlp.gate_proj.weight"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor for the model.s .model.layers.0.mlp.gate_proj.weight"):
        build_foundation_model(str(tmp_path), str(tmp_path), torch_dtype="float32")


def test_meta_init_keeps_rope_buffers_real(model_dir):
    folder, _ = model_dir
    model = build_foundation_model(folder, init_device="meta", torch_dtype="float32")
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta


META_CASES = ["fsdp2:broadcast", "fsdp2:local", "ddp:broadcast"]


@pytest.fixture(scope="module")
def meta_broadcast_output(model_dir):
    """Every case checked in one 2-rank launch (a launch's start-up costs more than a case): its stdout."""
    folder, _ = model_dir
    return torchrun(os.path.join(REPO, "tests", "dist", "check_meta_broadcast.py"), [folder, *META_CASES], 2).stdout


@pytest.mark.parametrize("case", META_CASES)
def test_meta_init_then_rank0_broadcast_equals_plain_load(meta_broadcast_output, case):
    assert meta_broadcast_output.count(f"META_BROADCAST_OK {case} ") == 2


@pytest.mark.parametrize(
    "family",
    [
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16},
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    ],
)
def test_families_load_like_transformers(tmp_path, family):
    """Llama, Qwen3 and Qwen2 checkpoints saved by transformers load into our builder with identical logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = write_model_config(str(tmp_path), **family)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    reference.save_pretrained(folder)
    ours = build_foundation_model(folder, folder, torch_dtype="float32")
    assert type(ours).__name__ == family["architectures"][0]
    ids = torch.randint(3, 500, (1, 30))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, reference(input_ids=ids).logits)
