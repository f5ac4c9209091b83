"""liger-kernel under Triton's interpreter on CPU (fp32), against transformers; run by tests/test_kernels.py.

    TRITON_INTERPRET=1 python tests/dist/check_kernels.py OUT.json [CHECK ...]

Each check writes {"errors": {what: max |got - want| / max |want|}, "seconds": s, ...} or {"failed": traceback}.
Kernel checks: RMSNorm, RoPE, vision RoPE, SwiGLU, fused linear cross-entropy (forward and every gradient).
Model checks (qwen3, llama, qwen2_5_vl): a bound model equals its unbound copy built in the same process (loss
and every parameter gradient), and the copy launches no Triton kernel while the bound one does.
Shapes are tiny: the interpreter runs each Triton program in Python (seconds per call at ~100 rows).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from triton_interpreter import Launches  # noqa: E402  (before anything imports triton)

import copy  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

from veomni.ops import chunked_head_loss_sum, lm_loss_sum, shift_labels  # noqa: E402
from veomni.ops.kernels import bind_kernels  # noqa: E402
from veomni.ops.kernels.liger import _liger_rms_norm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_TEXT = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "use_cache": False, "attention_dropout": 0.0, "hidden_act": "silu",
}  # fmt: skip


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.detach().float() - want.detach().float()).abs().max() / want.detach().float().abs().max()).item()


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def forward_backward(fn, inputs, grad_seed=0):
    """fn(*leaves) -> output(s); backward of a fixed random projection; (outputs, input grads)."""
    leaves = [leaf(t) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(grad_seed)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    return outs, [t.grad for t in leaves]


def compare(pair_got, pair_want, names):
    (outs, grads), (want_outs, want_grads) = pair_got, pair_want
    errors = {f"{names[0]}{i}": rel(a, b) for i, (a, b) in enumerate(zip(outs, want_outs))}
    errors.update({f"d{names[1]}{i}": rel(a, b) for i, (a, b) in enumerate(zip(grads, want_grads))})
    return errors


# ---------------------------------------------------------------------------------------------------- kernels
def check_rms_norm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    errors = {}
    for shape in ((24, 32), (1, 6, 2, 16)):  # hidden states; per-head q/k norm input
        torch.manual_seed(0)
        eager = Qwen3RMSNorm(shape[-1], eps=1e-6)
        with torch.no_grad():
            eager.weight.normal_()
        fused = _liger_rms_norm(copy.deepcopy(eager))
        x = torch.randn(shape)
        got = forward_backward(lambda h: fused(h), [x])
        want = forward_backward(lambda h: eager(h), [x])
        errors.update({f"{k}@{len(shape)}d": v for k, v in compare(got, want, ("y", "x")).items()})
        errors[f"dweight@{len(shape)}d"] = rel(fused.weight.grad, eager.weight.grad)
        assert fused.weight is not eager.weight  # two copies, each with its own gradient
    return {"errors": errors}


def _cos_sin(position_ids, head_dim=16):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(**TINY_TEXT)
    return Qwen3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), position_ids)


def check_rope():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from veomni.ops.kernels.liger_ops import rotary_pos_emb as liger_rotary_pos_emb

    torch.manual_seed(0)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])  # two packed documents
    cos, sin = _cos_sin(position_ids)
    # q as the attention makes it: a transpose of [batch, seq, heads, dim]; k plainly contiguous
    q, k = torch.randn(1, 10, 2, 16).transpose(1, 2), torch.randn(1, 1, 10, 16)
    got = forward_backward(lambda a, b: liger_rotary_pos_emb(a, b, cos, sin), [q, k])
    want = forward_backward(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin), [q, k])
    return {"errors": compare(got, want, ("qk", "qk"))}


def check_vision_rope():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    from veomni.ops.kernels.liger_ops import rotary_pos_emb_vision as liger_rotary_pos_emb_vision

    torch.manual_seed(0)
    q, k = torch.randn(12, 2, 16), torch.randn(12, 2, 16)  # (patches, heads, head_dim)
    angles = torch.randn(12, 8)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    got = forward_backward(lambda a, b: liger_rotary_pos_emb_vision(a, b, cos, sin), [q, k])
    want = forward_backward(lambda a, b: apply_rotary_pos_emb_vision(a, b, cos, sin), [q, k])
    return {"errors": compare(got, want, ("qk", "qk"))}


def check_swiglu():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    torch.manual_seed(0)
    eager = Qwen3MLP(Qwen3Config(**TINY_TEXT))
    holder = torch.nn.Module()
    holder.mlp = copy.deepcopy(eager)
    from veomni.ops.kernels.liger import bind_liger

    counts = bind_liger(holder)
    x = torch.randn(1, 12, 32)
    got = forward_backward(lambda h: holder.mlp(h), [x])
    want = forward_backward(lambda h: eager(h), [x])
    errors = compare(got, want, ("y", "x"))
    for name, p in eager.named_parameters():
        errors[f"d{name}"] = rel(holder.mlp.get_parameter(name).grad, p.grad)
    return {"errors": errors, "bound": counts}


def check_fused_linear_cross_entropy():
    torch.manual_seed(0)
    hidden, vocab = 32, 96
    h = torch.randn(2, 12, hidden)
    labels = torch.randint(0, vocab, (2, 12))
    labels[0, :4] = -100  # a prompt
    labels[1, 7] = -100
    errors, seconds = {}, {}
    for bias in (False, True):  # labels are targets (the collator's shifted convention)
        head = torch.nn.Linear(hidden, vocab, bias=bias)
        runs = {}
        for backend in ("liger", "chunked"):
            head.zero_grad()
            x = leaf(h)
            tic = time.perf_counter()
            loss, tokens = chunked_head_loss_sum(head, x, labels, 8, backend=backend)
            (loss * 0.37).backward()  # a non-unit incoming gradient, as the trainer's 1 / tokens scale
            seconds[backend] = time.perf_counter() - tic
            runs[backend] = (loss, tokens, x.grad, *(p.grad.clone() for p in head.parameters()))
        head.zero_grad()
        x = leaf(h)
        loss, tokens = lm_loss_sum(head(x), labels)
        (loss * 0.37).backward()
        plain = (loss, tokens, x.grad, *(p.grad for p in head.parameters()))
        tag = "bias" if bias else "nobias"
        for what, got, chunked, want in zip(("loss", "tokens", "dhidden", "dweight", "dbias"), *runs.values(), plain):
            if what == "tokens":
                assert int(got) == int(want) == int(chunked), (what, tag, got, want, chunked)
                continue
            errors[f"{what} vs plain,{tag}"] = rel(got, want)
            errors[f"{what} vs chunked,{tag}"] = rel(got, chunked)
    return {"errors": errors}


# ----------------------------------------------------------------------------------------------------- models
def _text_model(model_type, architecture):
    from veomni.models import build_foundation_model

    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"veomni_kernels_{model_type}_{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**TINY_TEXT, "model_type": model_type, "architectures": [architecture]}, f)
    model = build_foundation_model(folder, torch_dtype="float32", attn_implementation="veomni_varlen")
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (14,), generator=torch.Generator().manual_seed(1)).tolist()
    from veomni.data import MainCollator

    batch = MainCollator()([{"input_ids": ids[:9], "labels": ids[:9]}, {"input_ids": ids[9:], "labels": ids[9:]}])
    return model, batch


def _vl_model():
    from vlm_inputs import TINY, make_sample, one_sample_batch

    from veomni.models import build_foundation_model

    model = build_foundation_model(TINY["qwen2_5_vl"], torch_dtype="float32", moe_implementation="eager")
    sample = make_sample(model, 3, [(4, 4)], torch.Generator().manual_seed(0))
    batch = one_sample_batch(sample)
    batch["labels"] = shift_labels(sample["labels"][None])  # (one document: the shift is the whole rule)
    return model, batch


def _loss_and_grads(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model.zero_grad()
    with Launches() as launches:
        loss, _ = lm_loss_sum(model(**inputs, use_cache=False).logits, batch["labels"])
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, launches.count


def check_model(family):
    build = {
        "qwen3": lambda: _text_model("qwen3", "Qwen3ForCausalLM"),
        "llama": lambda: _text_model("llama", "LlamaForCausalLM"),
        "qwen2_5_vl": _vl_model,
    }[family]
    # two models built in this process, the same weights; one is bound (not a deepcopy: veomni's VL models hold a
    # forward closure over their own instance, which a deepcopy would share)
    model, batch = build()
    unbound, _ = build()
    unbound.load_state_dict(model.state_dict())
    model.train()
    unbound.train()
    counts = bind_kernels(model, "liger", "cpu")
    tic = time.perf_counter()
    loss, grads, launches = _loss_and_grads(model, batch)
    bound_seconds = time.perf_counter() - tic
    want_loss, want_grads, unbound_launches = _loss_and_grads(unbound, batch)
    missing = sorted(set(want_grads) ^ set(grads)) + sorted(n for n, _ in model.named_parameters() if n not in grads)
    assert not missing, f"parameters without a gradient in one of the two models: {missing}"
    errors = {"loss": rel(loss, want_loss)}
    errors.update({f"d{name}": rel(grads[name], want_grads[name]) for name in want_grads})
    kinds = {type(m).__name__ for m in unbound.modules()} | {type(m).__name__ for m in model.modules()}
    return {
        "errors": errors,
        "bound": counts,
        "launches": launches,
        "unbound_launches": unbound_launches,
        "bound_seconds": bound_seconds,
        "module_classes": sorted(kinds),
    }


CHECKS = {
    "rms_norm": check_rms_norm,
    "rope": check_rope,
    "vision_rope": check_vision_rope,
    "swiglu": check_swiglu,
    "fused_linear_cross_entropy": check_fused_linear_cross_entropy,
    "model_qwen3": lambda: check_model("qwen3"),
    "model_llama": lambda: check_model("llama"),
    "model_qwen2_5_vl": lambda: check_model("qwen2_5_vl"),
}


def main():
    out, names = sys.argv[1], sys.argv[2:] or list(CHECKS)
    results = {}
    for name in names:
        tic = time.perf_counter()
        try:
            results[name] = CHECKS[name]()
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - tic
        print(f"{name}: {time.perf_counter() - tic:.1f} s", flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
