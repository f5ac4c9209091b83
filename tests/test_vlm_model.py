"""Vision-language models in one process: packed rows equal samples run one by one (loss and every gradient,
fp32, 1e-5), text-only micro-batches still give every encoder parameter a gradient, towers freeze, and an HF
export reloads with from_pretrained and the same logits, with the processor files beside it."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from vlm_inputs import TINY, make_sample, one_sample_batch, pack

from veomni.distributed.sequence_parallel.multimodal import enable_multimodal_sequence_parallel
from veomni.models import build_config, build_foundation_model
from veomni.models.multimodal import freeze_encoders
from veomni.ops import lm_loss_sum, shift_labels


def _build(name: str):
    torch.manual_seed(0)
    model = build_foundation_model(TINY[name], torch_dtype="float32", moe_implementation="eager")
    return model.train()


def _loss_and_grads(model, batches):
    model.zero_grad(set_to_none=True)
    total, tokens = 0.0, 0
    for batch in batches:
        labels = batch.pop("labels")
        loss_sum, n = lm_loss_sum(model(**batch, use_cache=False).logits, labels)
        loss_sum.backward()
        total, tokens = total + loss_sum.item(), tokens + int(n)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total / tokens, grads


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "qwen2_5_omni_thinker"])
def test_packed_row_equals_one_by_one(name):
    model = _build(name)
    g = torch.Generator().manual_seed(1)
    # text-only first (the collator takes keys from every sample), then one image, then two images of different
    # shapes: visual tokens concatenated in order
    samples = [
        make_sample(model, 5, [], g),
        make_sample(model, 7, [(4, 4)], g),
        make_sample(model, 4, [(4, 8), (8, 4)], g),
    ]
    ref_loss, ref_grads = _loss_and_grads(
        model, [dict(one_sample_batch(s), labels=shift_labels(s["labels"][None])) for s in samples]
    )
    packed_loss, packed_grads = _loss_and_grads(model, [pack(samples)])
    assert abs(packed_loss - ref_loss) < 1e-5, (packed_loss, ref_loss)
    assert ref_grads.keys() == packed_grads.keys()
    for key, ref in ref_grads.items():
        torch.testing.assert_close(packed_grads[key], ref, atol=1e-5, rtol=1e-5, msg=key)
    visual = [k for k in ref_grads if ".visual." in k]
    assert visual and any(ref_grads[k].abs().sum() > 0 for k in visual)  # the vision tower really trains


def test_text_only_batch_gives_every_encoder_param_a_gradient():
    """FSDP2 all-gathers and reduce-scatters a unit only if it runs: a rank without images must run the vision
    (and audio) tower too, and hand back zero gradients, never None."""
    model = _build("qwen2_5_omni_thinker")
    g = torch.Generator().manual_seed(2)
    _, grads = _loss_and_grads(model, [pack([make_sample(model, 9, [], g), make_sample(model, 6, [], g)])])
    unused = {"model.audio_tower.audio_bos_eos_token.weight"}  # HF never uses it in forward
    encoders = [n for n, _ in model.named_parameters() if (".visual." in n or ".audio_tower." in n) and n not in unused]
    assert encoders and all(n in grads for n in encoders), [n for n in encoders if n not in grads][:3]
    assert all(grads[n].abs().sum() == 0 for n in encoders)


def test_freeze_vit_keeps_the_tower_out_of_training():
    model = _build("qwen2_5_vl")
    assert freeze_encoders(model, freeze_vit=True) == ["vit"]
    g = torch.Generator().manual_seed(3)
    _, grads = _loss_and_grads(model, [pack([make_sample(model, 5, [(4, 4)], g)])])
    assert not any(".visual." in k for k in grads) and any("language_model" in k for k in grads)
    with pytest.raises(ValueError, match="no such tower"):
        freeze_encoders(model, freeze_audio_tower=True)


def test_hf_export_reloads_with_same_logits(tmp_path):
    from transformers import AutoModelForImageTextToText

    from veomni.checkpoint import save_hf_model

    model = _build("qwen3_vl")
    g = torch.Generator().manual_seed(4)
    sample = make_sample(model, 6, [(4, 4)], g)
    processor_dir = tmp_path / "processor"
    processor_dir.mkdir()
    for name in ("preprocessor_config.json", "tokenizer_config.json"):
        (processor_dir / name).write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_hf_model(model, str(tmp_path / "hf"), str(processor_dir))
    finally:
        if started:
            dist.destroy_process_group()
    assert os.path.isfile(tmp_path / "hf" / "preprocessor_config.json")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model.eval()
    batch = one_sample_batch(sample)
    with torch.no_grad():
        ours = model(**batch, use_cache=False).logits
        theirs = reloaded(**batch, use_cache=False).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_sequence_parallel_refuses_omni_thinkers_at_build_time(name):
    """Their audio embeddings are not sharded over Ulysses ranks yet: say so before any step runs."""

    class Model:
        config = build_config(TINY[name])

    with pytest.raises(NotImplementedError, match=name):
        enable_multimodal_sequence_parallel(Model(), group=None)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_output_holds_no_tower_outputs(name):
    """The towers' per-image outputs (views) are not returned: FSDP2 would hook each and warn about views."""
    model = _build(name)
    sample = make_sample(model, 7, [(4, 4), (8, 4)], torch.Generator().manual_seed(3))
    output = model(**one_sample_batch(sample), use_cache=False)
    assert output.logits is not None
    views = [k for k, v in output.items() if torch.is_tensor(v) and v.requires_grad and v._base is not None]
    assert not any(k.endswith("_outputs") for k in output.keys()) and not views, list(output.keys())
