"""Multimodal collation and batching: MainCollator packing of mixed image / text samples (and its sequence-parallel
slices), dynamic batches that count image placeholders, and M-RoPE position ids for the MoE / Qwen3-Omni configs.
Real media and processors come from the session fixtures in conftest.py."""

import pickle

import torch
import transformers as tf
from mm_helpers import TINY_TEXT, TINY_VISION, qwen2_5_vl_transform
from mm_helpers import meta_model as _meta_model

from veomni.data import MainCollator, build_dataset
from veomni.data.data_transform import IGNORE_INDEX
from veomni.data.multimodal import demo_data, multimodal_collate_infos
from veomni.models.position_ids import build_position_id_func


def test_collation_packs_mixed_image_and_text_samples(mm_assets, mm_processors):
    processor = mm_processors["qwen2_5_vl"]
    transform = qwen2_5_vl_transform(processor)
    vqa = mm_assets["vqa"]

    def image_sample(q):
        return transform(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": q["image"]}, {"type": "text", "text": q["question"]}],
                    },
                    {"role": "assistant", "content": q["answer"]},
                ]
            }
        )

    text_only = transform(
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi"}]}
    )
    plain_text = {k: text_only[k] for k in ("input_ids", "labels")}  # e.g. from a text transform: no masks, no M-RoPE
    samples = [image_sample(vqa[0]), text_only, image_sample(vqa[1]), plain_text]
    lengths = [len(s["input_ids"]) for s in samples]
    total = sum(lengths)
    batch = MainCollator(collate_infos=multimodal_collate_infos(), sp_size=1)(samples)
    assert batch["input_ids"].shape == (1, total) and batch["labels"].shape == (1, total)
    assert batch["position_ids"].shape == (3, 1, total)
    patches = samples[0]["pixel_values"].shape[0] + samples[2]["pixel_values"].shape[0]
    assert batch["pixel_values"].shape == (patches, 1176) and batch["image_grid_thw"].shape == (2, 3)
    assert batch["image_mask"].shape == (1, total) and batch["image_mask"].dtype == torch.bool
    assert int(batch["image_mask"].sum()) == patches // 4  # one token per merged 2x2 patch, in order
    assert torch.equal(batch["pixel_values"], torch.cat([samples[0]["pixel_values"], samples[2]["pixel_values"]]))
    at = lengths[0] + lengths[1]
    assert torch.equal(batch["position_ids"][:, 0, at : at + lengths[2]], samples[2]["position_ids"])
    tail = batch["position_ids"][:, 0, total - lengths[3] :]
    assert torch.equal(tail, torch.arange(lengths[3]).expand(3, -1))  # plain positions for the text sample
    assert batch["labels"][0, at - 1] == IGNORE_INDEX and batch["cu_seq_lens_q"].tolist()[-1] == total  # (shifted)

    # sequence parallel (2 ranks): sequence fields sliced, masks / vision fields whole on every rank
    for rank in range(2):
        sp = MainCollator(collate_infos=multimodal_collate_infos(), sp_size=2, sp_rank=rank)(samples)
        padded = total + total % 2
        assert sp["input_ids"].shape == (1, padded // 2) and sp["position_ids"].shape == (3, 1, padded // 2)
        assert sp["image_mask"].shape == (1, padded) and sp["pixel_values"].shape == (patches, 1176)


def test_position_ids_for_qwen3_omni_and_moe_configs():
    """The adapter runs the Qwen3-VL-MoE and Qwen3-Omni-MoE thinker classes' own get_rope_index too."""
    text = dict(TINY_TEXT, head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32)
    vl_moe = tf.Qwen3VLMoeConfig(text_config=text, vision_config=dict(TINY_VISION, patch_size=16))
    image = [vl_moe.vision_start_token_id] + [vl_moe.image_token_id] * 6 + [vl_moe.vision_end_token_id]
    ids = torch.tensor([1, 2, *image, 3, 4])
    grid = torch.tensor([[1, 4, 6]])
    expected, _ = _meta_model(tf.Qwen3VLMoeModel, vl_moe).get_rope_index(
        ids[None], (ids == vl_moe.image_token_id).int()[None], grid
    )
    assert torch.equal(build_position_id_func(vl_moe)(ids, image_grid_thw=grid), expected[:, 0])

    omni = tf.Qwen3OmniMoeThinkerConfig(vision_start_token_id=151652)
    audio_frames = torch.tensor([230])  # 2.3 s of features: 2 chunks of 100 frames + 30
    n_audio = int(_get_qwen3_omni_audio_tokens(audio_frames))
    ids = torch.tensor(
        [1, 151652, *[omni.image_token_id] * 6, 151653, omni.audio_start_token_id]
        + [omni.audio_token_id] * n_audio
        + [omni.audio_start_token_id + 1, 5]
    )
    model = _meta_model(tf.Qwen3OmniMoeThinkerForConditionalGeneration, omni)
    expected, _ = model.get_rope_index(ids[None], grid, None, torch.ones_like(ids)[None], False, audio_frames)
    got = pickle.loads(pickle.dumps(build_position_id_func(omni)))(ids, image_grid_thw=grid, audio_seqlens=audio_frames)
    assert torch.equal(got, expected[:, 0])


def _get_qwen3_omni_audio_tokens(frames):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    return _get_feat_extract_output_lengths(frames)


def test_dynamic_batches_count_placeholder_tokens(mm_assets, mm_processors, tmp_path):
    """The loader's token budget counts each sample with its image placeholders; easy-vqa jsonl via demo_data."""
    from veomni.data import build_dataloader

    processor = mm_processors["qwen2_5_vl"]
    path = demo_data.write_easy_vqa_jsonl(str(tmp_path / "vqa.jsonl"), split="test", limit=12)
    transform = qwen2_5_vl_transform(processor)
    dataset = build_dataset(train_path=path, transform=transform)
    loader = build_dataloader(
        dataset=dataset,
        micro_batch_size=2,
        global_batch_size=2,
        max_seq_len=80,
        dyn_bsz=True,
        train_steps=4,
        collate_fn_kwargs={"collate_infos": multimodal_collate_infos(), "sp_size": 1},
        dp_rank=0,
        dp_size=1,
    )
    seen = 0
    for step in loader:
        for batch in step:
            tokens = batch["input_ids"].shape[-1]
            assert tokens <= 2 * 80  # the budget: micro_batch_size * max_seq_len, placeholders included
            merged = int((batch["image_grid_thw"].prod(-1) // 4).sum())
            assert int(batch["image_mask"].sum()) == merged > 0 and batch["position_ids"].shape == (3, 1, tokens)
            seen += batch["image_grid_thw"].shape[0]
    assert seen >= 8
