"""veomni_varlen attention: packed rows equal their documents run one by one (fp32, 1e-5), whatever tells the
boundaries (cu_seq_lens, position_ids, an all-ones mask on top); kernel choice and fallbacks; unpacked inputs."""

import pytest
import torch
import torch.nn.functional as F

from helpers import one_by_one, write_model_config
from veomni.data import MainCollator
from veomni.models import build_foundation_model
from veomni.ops import attention as attn
from veomni.ops import lm_loss_sum

LENGTHS = (17, 40, 5, 63, 40)  # two documents of equal length exercise the batched SDPA call


def _docs():
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]
    return [{"input_ids": d, "labels": list(d)} for d in docs]


def _check_packed(model, inputs, labels, total, grads):
    loss, _ = lm_loss_sum(model(**inputs, use_cache=False).logits, labels)
    loss.backward()
    assert abs(loss.item() - total) <= 1e-5 * total
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
    model.zero_grad()


@pytest.mark.parametrize("impl", ["veomni_varlen", "sdpa", "eager"])
def test_packed_batch_from_the_collator_never_attends_across_documents(tmp_path, impl):
    """Every choice the trainer can run, fed the collator's micro-batch (no attention_mask), equals one by one."""
    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32", attn_implementation=impl)
    docs = _docs()
    total, grads = one_by_one(model, docs)
    batch = MainCollator()(docs)
    assert "attention_mask" not in batch  # an all-ones mask would make transformers' sdpa/eager skip the block mask
    labels = batch.pop("labels")
    _check_packed(model, batch, labels, total, grads)


def test_varlen_boundaries_from_positions_and_despite_an_all_ones_mask(tmp_path):
    torch.manual_seed(0)
    model = build_foundation_model(write_model_config(str(tmp_path)), torch_dtype="float32")
    assert model.config._attn_implementation == "veomni_varlen"  # the default
    docs = _docs()
    total, grads = one_by_one(model, docs)
    batch = MainCollator()(docs)
    labels = batch.pop("labels")
    ones = torch.ones_like(batch["input_ids"])
    _check_packed(model, dict(batch, attention_mask=ones), labels, total, grads)
    positions_only = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": ones}
    _check_packed(model, positions_only, labels, total, grads)


def test_per_document_kernel_never_builds_a_full_mask(monkeypatch):
    """The CPU kernel's SDPA calls see one document (or a batch of equal-length ones) at a time."""
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[0], q.shape[2], attn_mask))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", spy)
    q, k, v = (torch.randn(1, 4, sum(LENGTHS), 8) for _ in range(3))
    attn._sdpa_per_document(q, k, v, list(LENGTHS), None, 0.0, None)
    assert sorted((b, n) for b, n, _ in seen) == [(1, 5), (1, 17), (1, 63), (2, 40)]
    assert all(mask is None for _, _, mask in seen)


def test_sliding_window_and_gqa_match_a_dense_reference():
    torch.manual_seed(0)
    lengths, window = [9, 30, 30, 4], 6
    total = sum(lengths)
    q = torch.randn(1, 4, total, 8)
    k, v = torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(total)
    mask = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = attn._sdpa_per_document(q, k, v, lengths, None, 0.0, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_unpacked_padded_batch_equals_transformers_sdpa(tmp_path):
    torch.manual_seed(0)
    config = write_model_config(str(tmp_path))
    ours = build_foundation_model(config, torch_dtype="float32")
    theirs = build_foundation_model(config, torch_dtype="float32", attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 512, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
        a, b = ours(**kwargs).logits, theirs(**kwargs).logits
        keep = kwargs.get("attention_mask", mask.new_ones(ids.shape)).bool()
        torch.testing.assert_close(a[keep], b[keep], rtol=1e-5, atol=1e-5)


def test_missing_flash_attn_falls_back_with_one_log_line(tmp_path, monkeypatch):
    monkeypatch.setattr(attn, "_has_package", lambda name: False)
    lines = []
    monkeypatch.setattr(attn.logger, "info", lines.append)
    attn._log_once.cache_clear()
    for _ in range(2):
        model = build_foundation_model(
            write_model_config(str(tmp_path)), torch_dtype="float32", attn_implementation="flash_attention_2"
        )
        assert model.config._attn_implementation == "veomni_varlen"
    assert len(lines) == 1 and "`flash_attn` is not installed; running veomni_varlen instead" in lines[0]
    assert attn.resolve_attn_implementation("sdpa") == "sdpa"


def test_kernel_choice_by_device_dtype_and_installed_packages(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert attn.varlen_backend(cpu, torch.bfloat16) == "sdpa_per_document"
    assert attn.varlen_backend(cuda, torch.float32) == "sdpa_per_document"  # flash kernels need 16-bit inputs
    for installed, expected in (
        ({"flash_attn", "torch.nn.attention.varlen"}, "flash_attn"),
        ({"torch.nn.attention.varlen"}, "torch_varlen"),
    ):
        monkeypatch.setattr(attn, "_has_package", lambda name, have=installed: name in have)
        assert attn.varlen_backend(cuda, torch.bfloat16) == expected
