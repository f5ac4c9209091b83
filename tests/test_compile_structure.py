"""torch.compile of the decoder layers, kernels on and off: the structure dynamo builds, pinned (a 10-layer tiny
Qwen3 under FSDP2 with the bf16 policy, one gloo rank; backend aot_eager, see tests/dist/check_compile_structure.py).

  * one code for all 10 layers: 4 graphs whatever the depth (a layer's forward up to the attention call, the
    attention's projections and RoPE, the attention after the kernel, the layer's rest);
  * the graph breaks are the deliberate ones only, their count pinned: veomni's varlen attention runs outside the graph
    (`torch.compiler.disable`); the liger kernels add none (they are custom ops, veomni/ops/kernels/liger_ops.py);
  * a second step with other document lengths recompiles nothing.
"""

import json
import os
import sys

import pytest

from helpers import REPO, child_env, run_python

CHECK = os.path.join(REPO, "tests", "dist", "check_compile_structure.py")
LAYERS = 10  # tests/dist/check_compile_structure.py
GRAPHS = 4  # per layer code, shared by the layers
VARLEN_BREAK = "Skip calling `torch.compiler.disable()`d function | <function varlen_attention_forward"
# break events as dynamo counts them (every trace that meets the disabled attention, restarts included): all at the
# varlen attention; one fewer with the fused kernels (dynamo retraces the attention frame once less), same graphs
BREAKS = {"eager": 4, "liger": 3}


@pytest.mark.parametrize("kernels", ["eager", "liger"])
def test_compiled_layers_share_one_code_without_recompiles(tmp_path, kernels):
    out = str(tmp_path / "structure.json")
    env = dict(child_env(), TRITON_INTERPRET="1", PYTHONPATH=REPO)
    done = run_python([sys.executable, CHECK, out, kernels], env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(out) as f:
        got = json.load(f)
    assert got["units"] == LAYERS
    if kernels == "liger":
        assert got["bound"] == {"rms_norm": LAYERS * 4 + 1, "swiglu": LAYERS, "rope": LAYERS}
    first, second = got["steps"]
    assert first["frames"] == first["unique_graphs"] == GRAPHS, first
    assert second["frames"] == first["frames"] and second["recompiles"] == 0, (first, second)
    assert first["graph_breaks"] == {VARLEN_BREAK: BREAKS[kernels]}, first["graph_breaks"]
    assert second["graph_breaks"] == first["graph_breaks"]
