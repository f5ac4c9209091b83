"""Fused kernels bound per model instance (`model.ops_implementation.kernels`), proven on CPU.

liger-kernel's Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, fp32), in a subprocess started
for it (tests/dist/check_kernels.py; the interpreter is chosen when triton is first imported):
  * RMSNorm, RoPE, vision RoPE, SwiGLU and the fused linear cross-entropy, forward and every gradient, equal
    transformers' modules / functions (and veomni's chunked loss) to a relative 1e-5;
  * a bound tiny Qwen3, Llama and Qwen2.5-VL (M-RoPE) equal an unbound model built in the same process (loss and
    every parameter gradient, 1e-5), and the unbound one launches no Triton kernel;
  * one 2-rank FSDP2 trainer step with kernels=liger equals kernels=eager (loss and grad norm, 1e-5).
In this process: the canary (each attention class still calls the RoPE function by the name we rebind, and
binding one instance leaves its class and other instances alone) and the `auto | liger | eager` decision.
bf16 parity is on the GPU (tests/test_cuda.py): the interpreter computes bf16 wrongly.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, child_env, read_metrics, run_python, tiny_run_config, torchrun_cmd, write_model_config
from veomni.compat.transformers import bind_forward_with_global, forward_calls_global
from veomni.ops import kernels
from veomni.ops.kernels.liger import FAMILIES

TOL = 1e-5
CHECK = os.path.join(REPO, "tests", "dist", "check_kernels.py")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every check of tests/dist/check_kernels.py, in one interpreter process: {check: result}."""
    out = str(tmp_path_factory.mktemp("kernels") / "checks.json")
    env = dict(child_env(), TRITON_INTERPRET="1", PYTHONPATH=REPO)
    proc = run_python([sys.executable, CHECK, out], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def _passed(result):
    assert "failed" not in result, result.get("failed")
    worst = max(result["errors"], key=result["errors"].get)
    assert result["errors"][worst] <= TOL, f"{worst}: {result['errors'][worst]:.2e} (all: {result['errors']})"


@pytest.mark.parametrize("check", ["rms_norm", "rope", "vision_rope", "swiglu", "fused_linear_cross_entropy"])
def test_kernel_equals_transformers_forward_and_backward(interpreted, check):
    _passed(interpreted[check])


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2_5_vl"])
def test_bound_model_equals_unbound_copy_in_the_same_process(interpreted, family):
    result = interpreted[f"model_{family}"]
    _passed(result)
    bound = result["bound"]
    layers = 2
    assert bound["rope"] >= layers and bound["swiglu"] >= layers and bound["rms_norm"] >= 2 * layers + 1, bound
    assert result["launches"] > 0, "the bound model ran no Triton kernel"
    assert result["unbound_launches"] == 0, "the unbound model ran Triton kernels: the binding leaked"
    assert "LigerRMSNorm" in result["module_classes"]


# ------------------------------------------------------------------------------------------ canary (no Triton)
@pytest.mark.parametrize("family", FAMILIES)
def test_canary_each_attention_calls_the_rope_function_we_rebind(family):
    """Red when transformers moves or renames the RoPE function an attention forward calls: the liger RoPE would
    then silently not run."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    text = [getattr(module, n) for n in dir(module) if n.endswith("Attention") and "Vision" not in n]
    text = [c for c in text if isinstance(c, type) and c.__module__ == module.__name__]
    assert text, f"{family}: no attention class in {module.__name__}"
    for cls in text:
        assert forward_calls_global(cls, "apply_rotary_pos_emb"), f"{cls.__name__} no longer calls apply_rotary_pos_emb"
    if family in ("qwen2_5_vl", "qwen3_vl"):
        vision = [getattr(module, n) for n in dir(module) if n.endswith("VisionAttention")]
        assert vision and all(forward_calls_global(c, "apply_rotary_pos_emb_vision") for c in vision)


def test_binding_one_instance_leaves_the_class_and_other_instances_alone():
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3

    config = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    bound, plain = modeling_qwen3.Qwen3Attention(config, 0), modeling_qwen3.Qwen3Attention(config, 0)
    plain.load_state_dict(bound.state_dict())
    calls = []

    def spy(q, k, cos, sin, *args, **kwargs):
        calls.append(q.shape)
        return modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs)

    original = modeling_qwen3.apply_rotary_pos_emb
    bind_forward_with_global(bound, "apply_rotary_pos_emb", spy)
    x = torch.randn(1, 5, 32)
    cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    out_plain, _ = plain(x, (cos, sin), None)
    assert calls == []  # the other instance runs the file's function
    out_bound, _ = bound(x, (cos, sin), None)
    assert len(calls) == 1  # this one runs the bound function, inside the class's own forward code
    assert torch.equal(out_bound, out_plain)
    assert modeling_qwen3.apply_rotary_pos_emb is original and "forward" not in vars(plain)


def test_bound_and_unbound_twins_compile_side_by_side(monkeypatch):
    """A bound attention and its unbound twin, both compiled, with a graph break inside (as veomni's attention makes):
    each runs and equals the other. Sharing one code object, the second to run found the first's compiled frame and
    looked its resume function up in the wrong globals (NameError `__compiled_fn_...`, kernels=liger + compile on a
    GPU); the bound forward now has a code object of its own."""
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3

    def breaking_attention(module, query, key, value, attention_mask, **kwargs):
        torch._dynamo.graph_break()
        return modeling_qwen3.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(modeling_qwen3.ALL_ATTENTION_FUNCTIONS, "breaking", breaking_attention)
    config = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    config._attn_implementation = "breaking"
    plain, bound = modeling_qwen3.Qwen3Attention(config, 0), modeling_qwen3.Qwen3Attention(config, 0)
    bound.load_state_dict(plain.state_dict())
    bind_forward_with_global(
        bound, "apply_rotary_pos_emb", lambda *a, **k: modeling_qwen3.apply_rotary_pos_emb(*a, **k)
    )
    torch._dynamo.reset()
    x, cos, sin = torch.randn(1, 5, 32), torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    outs = [torch.compile(m, backend="eager")(x, (cos, sin), None)[0] for m in (plain, bound)]
    torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])


def test_binding_refuses_a_forward_that_no_longer_calls_the_function(monkeypatch):
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3

    class Moved(modeling_qwen3.Qwen3Attention):  # as if transformers renamed the function it calls
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            return hidden_states, None

    config = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(AttributeError, match="no longer calls the global `apply_rotary_pos_emb`"):
        bind_forward_with_global(Moved(config, 0), "apply_rotary_pos_emb", lambda *a: a)


# ------------------------------------------------------------------------------------------ the key
def test_auto_is_liger_on_cuda_when_installed_and_eager_otherwise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "liger_available", lambda: True)
    assert kernels.resolve_kernels("auto", "cuda") == "liger"
    assert kernels.resolve_kernels("auto", "cpu") == "eager"
    assert kernels.resolve_kernels("auto", "cuda", tp_size=2) == "eager"
    assert kernels.resolve_kernels("auto", "cuda", compiled=True) == "eager"  # inductor fuses better (H200)
    assert kernels.resolve_kernels("liger", "cuda", compiled=True) == "liger"  # asked for: as asked
    assert kernels.resolve_kernels("eager", "cuda") == "eager"
    monkeypatch.setattr(kernels, "liger_available", lambda: False)
    assert kernels.resolve_kernels("auto", "cuda") == "eager"


def test_loss_auto_is_liger_on_cuda_when_installed_and_chunked_otherwise(monkeypatch):
    monkeypatch.setattr(kernels, "liger_available", lambda: True)
    assert kernels.resolve_loss_implementation("auto", "cuda") == "liger"
    assert kernels.resolve_loss_implementation("auto", "cpu") == "chunked"
    assert kernels.resolve_loss_implementation("auto", "cuda", tp_size=2) == "chunked"
    assert kernels.resolve_loss_implementation("chunked", "cuda") == "chunked"
    with pytest.raises(ValueError, match="loss_implementation=liger needs a CUDA GPU"):
        kernels.resolve_loss_implementation("liger", "cpu")
    with pytest.raises(ValueError, match="loss_implementation='fused': choose auto, chunked or liger"):
        kernels.resolve_loss_implementation("fused", "cuda")
    monkeypatch.setattr(kernels, "liger_available", lambda: False)
    assert kernels.resolve_loss_implementation("auto", "cuda") == "chunked"


def test_liger_where_it_cannot_run_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "liger_available", lambda: True)
    with pytest.raises(ValueError, match="model.ops_implementation.kernels=liger needs a CUDA GPU"):
        kernels.resolve_kernels("liger", "cpu")
    with pytest.raises(ValueError, match="tensor parallel"):
        kernels.resolve_kernels("liger", "cuda", tp_size=2)
    with pytest.raises(ValueError, match="choose one of auto, liger, eager"):
        kernels.resolve_kernels("fast", "cuda")
    monkeypatch.setattr(kernels, "liger_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install veomni\[kernels\]"):
        kernels.resolve_kernels("liger", "cuda")


def test_eager_binds_nothing(tmp_path):
    from veomni.models import build_foundation_model

    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32")
    before = {n: type(m) for n, m in model.named_modules()}
    assert kernels.bind_kernels(model, "eager", "cuda") == {}
    assert {n: type(m) for n, m in model.named_modules()} == before


# ------------------------------------------------------------------------------------------ the trainer
def test_fsdp2_trainer_step_with_kernels_equals_eager(tmp_path):
    """2 gloo ranks, FSDP2, a tiny Qwen3: 2 steps with kernels=liger (Triton's interpreter) and kernels=eager in one
    launch; loss and grad norm agree to 1e-5."""
    config = tiny_run_config(str(tmp_path))
    write_model_config(
        str(tmp_path / "model"), architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=32,
        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    small = ["--data.max_seq_len", "16", "--train.micro_batch_size", "1", "--train.global_batch_size", "2"]
    small += ["--train.max_steps", "2", "--train.checkpoint.save_steps", "0"]
    runs = []
    for choice in ("liger", "eager"):
        out = str(tmp_path / choice)
        runs += [*(["::"] if runs else []), "plain", config, "--train.checkpoint.output_dir", out]
        runs += [*small, "--model.ops_implementation.kernels", choice]
    env = dict(child_env(), TRITON_INTERPRET="1")
    script = os.path.join(REPO, "tests", "dist", "kernel_trainer.py")
    cmd = torchrun_cmd(2, "--master_port=0", script, "sequence", *runs)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "model.ops_implementation.kernels=liger: liger" in proc.stdout
    liger, eager = read_metrics(str(tmp_path / "liger")), read_metrics(str(tmp_path / "eager"))
    assert len(liger) == len(eager) == 2
    for a, b in zip(liger, eager):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(b[key]), (key, a[key], b[key])
