"""The CUDA paths, on a CUDA GPU (skipped elsewhere: CI has none; run `pytest tests/test_cuda.py` on a GPU machine,
or `bash benchmarks/gpu_all.sh`, which also runs the GPU benchmarks).

* every packed-attention kernel the device offers (torch varlen, flash-attn if installed, SDPA per
  document) equals per-document fp32 attention, forward and gradients, with GQA and a sliding window; the
  whole-row causal attention that crosses documents is shown to fail the same check;
* a packed micro-batch through a model equals its documents one by one (bf16 compute);
* the fused linear + cross-entropy loss equals the plain loss (bf16 head) and never holds the full logits: its
  peak memory is measured against the plain loss's;
* fused MoE experts (torch._grouped_mm) equal transformers' eager experts;
* the trainer on one GPU: fp32 equals the same run on CPU step by step, and bf16 compute follows it.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_QWEN3_MOE, read_metrics, run_text_task, tiny_run_config, write_model_config, write_moe_config
from veomni.data import MainCollator
from veomni.models import build_foundation_model
from veomni.ops import attention as attn
from veomni.ops import chunked_head_loss_sum, lm_loss_sum, shift_labels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

LENGTHS = [1, 300, 1024, 17, 655, 51]  # 2048 tokens: a 1-token document, odd lengths, one long one
BACKENDS = ["torch_varlen", "flash_attn", "sdpa_per_document"]


def _available(backend: str) -> bool:
    package = {"torch_varlen": "torch.nn.attention.varlen", "flash_attn": "flash_attn"}.get(backend)
    return package is None or attn._has_package(package)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _attention(backend, q, k, v, lengths, window=None):
    """veomni_varlen's forward with `backend` forced; q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D]."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=q.device, dtype=torch.int32)
    saved = attn.varlen_backend
    attn.varlen_backend = lambda device, dtype: backend
    try:
        out, _ = attn.varlen_attention_forward(
            None, q, k, v, None, scaling=q.shape[-1] ** -0.5, sliding_window=window, cu_seq_lens_q=cu
        )
    finally:
        attn.varlen_backend = saved
    return out


def _whole_row_causal(q, k, v, lengths, window=None):
    """The mistake the kernels must not make: one causal attention over the packed row, across documents."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def _errors(run, lengths, window):
    """Relative max error of `run`'s output and q/k/v gradients in bf16 against fp32 per-document attention."""
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, 16, total, 128, device="cuda", generator=g)
    k, v = (torch.randn(1, 4, total, 128, device="cuda", generator=g) for _ in range(2))
    grad_out = torch.randn(1, total, 16, 128, device="cuda", generator=g)
    results = []
    for dtype, fn in ((torch.float32, lambda *a: _attention("sdpa_per_document", *a)), (torch.bfloat16, run)):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, lengths, window)
        out.backward(grad_out.to(dtype))
        results.append([out, *(t.grad for t in leaves)])
    reference, got = results
    return [_relative_error(a, b) for a, b in zip(got, reference)]


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_attention_kernels_equal_per_document_attention(backend, window):
    if not _available(backend):
        pytest.skip(f"{backend} is not installed here")
    errors = _errors(lambda *a: _attention(backend, *a), LENGTHS, window)
    assert max(errors) < 2e-2, f"{backend}: output/dq/dk/dv relative errors {errors}"


def test_the_check_catches_attention_across_documents():
    errors = _errors(_whole_row_causal, LENGTHS, None)
    assert max(errors) > 0.1, errors  # the same tolerance would have let a cross-document kernel through otherwise


def _tiny_qwen3(folder, **overrides):
    return write_model_config(
        folder, architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=4096, hidden_size=256,
        intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64, **overrides,
    )  # fmt: skip


def test_packed_micro_batch_equals_documents_one_by_one(tmp_path):
    """Through the model (its default veomni_varlen attention), bf16 compute as the trainer runs it on CUDA."""
    torch.manual_seed(0)
    model = build_foundation_model(_tiny_qwen3(str(tmp_path)), torch_dtype="float32", init_device="cuda")
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in LENGTHS]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        separate = []
        for d in docs:  # one document per forward: no packing, transformers' SDPA
            ids = torch.tensor([d], device="cuda")
            separate.append(lm_loss_sum(model(input_ids=ids).logits, shift_labels(ids))[0])
        one_by_one = torch.stack(separate).sum()
        one_by_one.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        batch = MainCollator()([{"input_ids": d, "labels": list(d)} for d in docs])
        batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
        labels = batch.pop("labels")
        packed, _ = lm_loss_sum(model(**batch).logits, labels)
    packed.backward()
    assert abs(packed.item() - one_by_one.item()) < 2e-3 * one_by_one.item()
    worst = max(_relative_error(p.grad, want[n]) for n, p in model.named_parameters())
    assert worst < 3e-2, worst


def test_fused_linear_cross_entropy_equals_plain_loss_without_the_logits():
    torch.manual_seed(0)
    tokens, hidden, vocab = 8192, 1024, 32768
    h = (torch.randn(tokens, hidden, device="cuda") * 0.5).to(torch.bfloat16)
    head = torch.nn.Linear(hidden, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (1, tokens), device="cuda")
    labels[0, ::7] = -100
    labels = shift_labels(labels)
    results, peaks = [], []
    for fused in (False, True):
        head.zero_grad()
        leaf = h.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        if fused:
            loss, _ = chunked_head_loss_sum(head, leaf[None], labels, chunk_size=1024)
        else:
            loss, _ = lm_loss_sum(head(leaf[None]), labels)
        (loss / 1000.0).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        results.append((loss.detach(), leaf.grad, head.weight.grad.clone()))
    (plain_loss, plain_dh, plain_dw), (fused_loss, fused_dh, fused_dw) = results
    assert abs(fused_loss.item() - plain_loss.item()) < 1e-4 * plain_loss.item()
    assert _relative_error(fused_dh, plain_dh) < 2e-2
    assert _relative_error(fused_dw, plain_dw) < 2e-2
    full_logits = tokens * vocab * 4  # the fp32 logits the plain loss materialises
    assert peaks[1] < peaks[0] - full_logits, f"peak {peaks[1] / 2**20:.0f} MiB vs plain {peaks[0] / 2**20:.0f} MiB"


def test_fused_experts_equal_eager_experts(tmp_path):
    config = write_moe_config(str(tmp_path), **dict(TINY_QWEN3_MOE, hidden_size=256, moe_intermediate_size=128))
    models = {}
    for impl in ("eager", "fused"):
        torch.manual_seed(0)
        models[impl] = build_foundation_model(
            config, torch_dtype="float32", init_device="cuda", moe_implementation=impl
        )
    ids = torch.randint(0, 512, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    for impl, model in models.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = lm_loss_sum(model(input_ids=ids).logits, shift_labels(ids))
        loss.backward()
        results[impl] = loss.item(), {n: p.grad for n, p in model.named_parameters()}
    (eager_loss, eager_grads), (fused_loss, fused_grads) = results["eager"], results["fused"]
    assert abs(fused_loss - eager_loss) < 2e-3 * eager_loss
    worst = max(_relative_error(fused_grads[n], g) for n, g in eager_grads.items())
    assert worst < 3e-2, worst


def test_trainer_on_one_gpu_equals_the_cpu_run(tmp_path):
    config = tiny_run_config(str(tmp_path))
    fp32 = ["--train.accelerator.fsdp_config.mixed_precision.param_dtype", "float32"]
    gpu = run_text_task(config, 1, str(tmp_path / "gpu"), fp32)
    gpu_bf16 = run_text_task(config, 1, str(tmp_path / "gpu_bf16"))
    os.environ["VEOMNI_DEVICE"] = "cpu"
    try:
        cpu = run_text_task(config, 1, str(tmp_path / "cpu"), fp32)
    finally:
        del os.environ["VEOMNI_DEVICE"]
    assert len(gpu) == len(cpu) == 10
    for a, b, c in zip(gpu, cpu, gpu_bf16):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(c["loss"] - b["loss"]) < 2e-2 * b["loss"], (c["step"], c["loss"], b["loss"])
    assert read_metrics(str(tmp_path / "gpu"))[-1]["loss"] < cpu[0]["loss"]


def test_compiled_decoder_layers_equal_eager(tmp_path):
    """ops_implementation.compile: the same loss and gradients as eager (fp32: only the order of sums differs)."""
    from veomni.distributed.compile import compile_basic_modules
    from veomni.distributed.torch_parallelize import basic_module_instances

    config = _tiny_qwen3(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in LENGTHS]
    batch = MainCollator()([{"input_ids": d, "labels": list(d)} for d in docs])
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    labels = batch.pop("labels")
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_foundation_model(config, torch_dtype="float32", init_device="cuda")
        if compiled:
            compile_basic_modules(basic_module_instances(model, ["Qwen3DecoderLayer"]))
        loss, _ = lm_loss_sum(model(**batch).logits, labels)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert abs(compiled_loss - eager_loss) < 1e-5 * eager_loss
    worst = max(_relative_error(compiled_grads[n], g) for n, g in eager_grads.items())
    assert worst < 1e-4, worst


# ------------------------------------------------------------------------------------ liger kernels, fp8 (bf16)
def _liger_or_skip():
    from veomni.ops.kernels import liger_available

    if not liger_available():  # benchmarks/gpu_speed.py carries the wheel (.whl)
        pytest.skip("liger-kernel is not installed here")


def _bf16_errors(fused, eager, inputs):
    """Relative errors of fused (bf16) and of eager (bf16) against eager in fp32: outputs and input gradients."""
    results = []
    for fn, dtype in ((eager, torch.float32), (eager, torch.bfloat16), (fused, torch.bfloat16)):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.float().sum() * (i + 1) for i, o in enumerate(outs)).backward()
        results.append([*outs, *(t.grad for t in leaves)])
    reference, eager_bf16, fused_bf16 = results
    return [_relative_error(a, r) for a, r in zip(fused_bf16, reference)], [
        _relative_error(a, r) for a, r in zip(eager_bf16, reference)
    ]


def test_liger_kernels_in_bf16_are_as_close_to_fp32_as_transformers_bf16():
    _liger_or_skip()
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from veomni.ops.kernels.liger_ops import rms_norm, rotary_pos_emb, swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    x, w = torch.randn(4096, 2048, device="cuda", generator=g), torch.randn(2048, device="cuda", generator=g)
    q, k = torch.randn(1, 16, 4096, 128, device="cuda", generator=g), torch.randn(1, 8, 4096, 128, device="cuda")
    angles = torch.randn(1, 4096, 64, device="cuda", generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    a, b = torch.randn(4096, 6144, device="cuda", generator=g), torch.randn(4096, 6144, device="cuda", generator=g)

    def eager_norm(h, weight):
        h32 = h.float()
        return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    cases = {
        "rms_norm": (lambda h, weight: rms_norm(h, weight, 1e-6), eager_norm, [x, w]),
        "rope": (lambda a_, b_: rotary_pos_emb(a_, b_, cos.bfloat16(), sin.bfloat16()),
                 lambda a_, b_: apply_rotary_pos_emb(a_, b_, cos.to(a_.dtype), sin.to(a_.dtype)), [q, k]),
        "swiglu": (swiglu, lambda a_, b_: F.silu(a_) * b_, [a, b]),
    }  # fmt: skip
    for name, (fused, eager, inputs) in cases.items():
        fused_err, eager_err = _bf16_errors(fused, eager, inputs)
        for f, e in zip(fused_err, eager_err):
            assert f <= 2 * e + 1e-3, f"{name}: fused bf16 {fused_err} vs transformers bf16 {eager_err}"


def _triton_launches():
    """A context counting Triton kernel launches (JITFunction.run)."""
    import contextlib

    from triton.runtime.jit import JITFunction

    @contextlib.contextmanager
    def counting():
        run, box = JITFunction.run, [0]

        def counted(self, *args, **kwargs):
            box[0] += 1
            return run(self, *args, **kwargs)

        JITFunction.run = counted
        try:
            yield box
        finally:
            JITFunction.run = run

    return counting()


@pytest.mark.parametrize("compiled", [False, True])
def test_bound_model_in_bf16_follows_an_unbound_one_in_the_same_process(tmp_path, compiled):
    """kernels=liger on one model, eager on its twin (and compiled with inductor: liger's custom ops inside the
    compiled layers, no fallback): bf16 loss and gradients agree; the twin launches no Triton kernel eagerly."""
    _liger_or_skip()
    from veomni.distributed.compile import compile_basic_modules
    from veomni.distributed.torch_parallelize import basic_module_instances
    from veomni.ops.kernels import bind_kernels

    config = _tiny_qwen3(str(tmp_path), num_hidden_layers=2)
    models = []
    for bind in (True, False):
        torch.manual_seed(0)
        model = build_foundation_model(config, torch_dtype="float32", init_device="cuda")
        if bind:
            assert bind_kernels(model, "liger", "cuda")["rms_norm"] == 2 * 4 + 1
        if compiled:
            compile_basic_modules(basic_module_instances(model, ["Qwen3DecoderLayer"]))
        models.append(model)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in LENGTHS]
    batch = MainCollator()([{"input_ids": d, "labels": list(d)} for d in docs])
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    labels = batch.pop("labels")
    results = []
    for model in models:
        with _triton_launches() as launches, torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = lm_loss_sum(model(**batch).logits, labels)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}, launches[0]))
    (bound_loss, bound_grads, bound_launches), (loss, grads, launches) = results
    assert abs(bound_loss - loss) < 5e-3 * loss
    worst = max(_relative_error(bound_grads[n], g) for n, g in grads.items())
    assert worst < 5e-2, worst
    if not compiled:  # (compiled, inductor's own Triton kernels run in both)
        assert bound_launches > 0 and launches == 0, (bound_launches, launches)


def test_liger_fused_linear_cross_entropy_equals_the_chunked_loss_in_bf16():
    """The "liger" head-loss backend against the "chunked" one, bf16 head; prints both peaks for the default's decision."""
    _liger_or_skip()

    torch.manual_seed(0)
    tokens, hidden, vocab = 8192, 1024, 32768
    h = (torch.randn(tokens, hidden, device="cuda") * 0.5).to(torch.bfloat16)
    head = torch.nn.Linear(hidden, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (1, tokens), device="cuda")
    labels[0, ::7] = -100
    results, peaks = [], {}
    for name in ("chunked", "liger"):
        head.zero_grad()
        leaf = h.clone()[None].requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, count = chunked_head_loss_sum(head, leaf, labels, 1024, backend=name)
        (loss / 1000.0).backward()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
        results.append((loss.detach(), int(count), leaf.grad, head.weight.grad.clone()))
    print(f"peak MiB above inputs: {peaks}")
    (c_loss, c_count, c_dh, c_dw), (l_loss, l_count, l_dh, l_dw) = results
    assert c_count == l_count
    assert abs(l_loss.item() - c_loss.item()) < 1e-3 * c_loss.item()
    assert _relative_error(l_dh, c_dh) < 2e-2 and _relative_error(l_dw, c_dw) < 2e-2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_follows_bf16_on_the_gpu(recipe):
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 (Ada, Hopper) or newer")
    from veomni.distributed.fp8 import apply_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 8192, bias=False), torch.nn.Linear(8192, 4096, bias=False))
    model = model.cuda()
    twin = __import__("copy").deepcopy(model)
    assert apply_fp8(model, recipe)["converted"] == 2  # both shapes are large enough for either recipe
    x = torch.randn(8192, 4096, device="cuda")
    outs = []
    for m in (model, twin):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(leaf)
        out.float().square().mean().backward()
        outs.append((out.float(), leaf.grad, m[0].weight.grad))
    for got, want in zip(*outs):
        assert ((got - want).norm() / want.norm()).item() < 0.1
