"""configs/text real-model recipes: each parses, and its model (architecture typed from the public config.json)
builds on the meta device with the published parameter count."""

import glob
import os

import pytest

from helpers import REPO
from veomni.arguments import VeOmniArguments, parse_args
from veomni.models import build_foundation_model

# published sizes (billions of parameters, embeddings counted once when tied)
PUBLISHED = {"qwen2_5": 7.62, "qwen3": 8.19, "qwen3_moe": 30.53, "llama3": 8.03}
SIZES = {"qwen3_0_6b": 0.60, "qwen3_1_7b": 1.72, "qwen3_4b": 4.02}


def _num_params(config_path, moe_implementation=None):
    model = build_foundation_model(config_path=config_path, init_device="meta", moe_implementation=moe_implementation)
    return sum(p.numel() for p in model.parameters()) / 1e9


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_recipe_parses_and_its_model_builds_on_meta(recipe):
    path = os.path.join(REPO, "configs", "text", f"{recipe}.yaml")
    args = parse_args(VeOmniArguments, [path])
    assert args.model.model_path.startswith("/path/to/")  # the user's own weights, never a hub download
    assert args.model.ops_implementation.attn_implementation == "veomni_varlen"
    size = _num_params(os.path.join(REPO, args.model.config_path), args.model.ops_implementation.moe_implementation)
    assert abs(size - PUBLISHED[recipe]) <= 0.02 * PUBLISHED[recipe], (recipe, size)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_other_qwen3_sizes_build_with_their_published_size(name):
    size = _num_params(os.path.join(REPO, "configs", "model", name))
    assert abs(size - SIZES[name]) <= 0.02 * SIZES[name], (name, size)


def test_every_model_config_is_used():
    folders = {os.path.basename(os.path.dirname(p)) for p in glob.glob(f"{REPO}/configs/model/*/config.json")}
    recipes = " ".join(open(p).read() for p in glob.glob(f"{REPO}/configs/**/*.yaml", recursive=True))
    assert all(f"configs/model/{name}" in recipes or name in SIZES for name in folders)
