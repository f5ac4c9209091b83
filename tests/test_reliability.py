"""What a hostile but realistic user hits, each refused or handled in one line before work is lost: two runs on one
output folder, bad images, a tokenizer larger than the model, a damaged checkpoint of the right length, a checkpoint
of another optimizer, a prompt-only chat template, a full disk, a huge record, a config naming custom code, a longer
schedule on resume, per-rank generators on a resume over more ranks, and rank 0 failing alone."""

import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from torch import nn

from helpers import REPO, child_env, read_metrics, tiny_run_config, torchrun, write_model_config, write_tokenizer
from veomni.checkpoint import Checkpointer, CheckpointError, RunDirError, resolve_checkpoint
from veomni.checkpoint.run_dir import lock_run_dir
from veomni.data.data_transform import DataFormatError

TRAIN = os.path.join(REPO, "tasks", "train_text.py")


# ------------------------------------------------------------------------------- one run per output folder
def test_a_second_run_on_a_folder_in_use_is_refused(tmp_path):
    out = str(tmp_path / "out")
    first = lock_run_dir(out)
    with pytest.raises(RunDirError, match=rf"in use by another run \(pid {os.getpid()} on "):
        lock_run_dir(out)
    first.close()  # the lock goes with its holder (the kernel drops it however the process ends)
    lock_run_dir(out).close()


def test_two_launches_on_one_output_dir_the_second_stops_before_writing(tmp_path):
    config = tiny_run_config(str(tmp_path))
    out = str(tmp_path / "out")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from veomni.checkpoint.run_dir import lock_run_dir; "
         "h = lock_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)", out],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = torchrun(TRAIN, [config, "--train.checkpoint.output_dir", out], 1, check=False)
    finally:
        holder.kill()
    assert proc.returncode == 1
    assert f"is in use by another run (pid {holder.pid}" in proc.stdout + proc.stderr
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # nothing of the first run was touched


# ------------------------------------------------------------------------------------------- bad images
@pytest.fixture
def bad_images(tmp_path, mm_assets):
    from PIL import Image

    good = mm_assets["images"]["astronaut"]["path"]
    with open(good, "rb") as f:
        data = f.read()
    paths = {"good": good}
    paths["truncated"] = str(tmp_path / "truncated.png")
    open(paths["truncated"], "wb").write(data[: len(data) // 3])
    paths["text"] = str(tmp_path / "notes.png")
    open(paths["text"], "w").write("not an image at all\n")
    paths["huge"] = str(tmp_path / "huge.png")  # a small file that would decode to 12000 x 12000 pixels
    Image.new("1", (12000, 12000)).save(paths["huge"], optimize=True)
    assert os.path.getsize(paths["huge"]) < 100_000
    return paths


def _vl_record(image: str) -> dict:
    content = [{"type": "image", "image": image}, {"type": "text", "text": "What is in the picture?"}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A photo."}]}


def test_a_bad_image_is_a_bad_sample_naming_file_and_record(tmp_path, bad_images, mm_processors):
    from veomni.data import build_dataset, build_multimodal_chat_template
    from veomni.data.multimodal import process_sample_qwen2_5_vl

    processor = mm_processors["qwen2_5_vl"]
    transform = partial(
        process_sample_qwen2_5_vl, processor=processor, position_id_func=_flat_positions,
        chat_template=build_multimodal_chat_template("qwen2_5_vl", processor.tokenizer),
    )  # fmt: skip
    for kind, what in (("truncated", "unreadable image"), ("text", "unreadable image"), ("huge", "is 12000 x 12000")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(_vl_record(bad_images[k])) + "\n" for k in ("good", kind)))
        dataset = build_dataset(
            train_path=str(path), datasets_type="mapping", transform=transform, cache_dir=str(tmp_path / "c")
        )
        with pytest.raises(DataFormatError, match=rf"{path}:2: .*{what}.*skip_bad_samples") as err:
            len(dataset)  # the first use transforms every record once
        assert bad_images[kind] in str(err.value)
    path = tmp_path / "mixed.jsonl"
    order = ["good", "truncated", "good", "text", "huge", "good"]
    path.write_text("".join(json.dumps(_vl_record(bad_images[k])) + "\n" for k in order))
    skipping = build_dataset(
        train_path=str(path), datasets_type="mapping", transform=transform, skip_bad_samples=True,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert len(skipping) == 6 and skipping.skipped == 3
    assert [len(skipping[r]) for r in range(6)] == [1, 0, 1, 0, 0, 1]


def _flat_positions(input_ids, **kwargs):
    return torch.zeros(3, len(input_ids), dtype=torch.long)


# ----------------------------------------------------------------------------------- pre-flight checks
def test_a_tokenizer_larger_than_the_model_is_refused_before_the_model_is_built(tmp_path):
    from veomni.arguments import ConfigError
    from veomni.trainer.preflight import check_vocab

    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(write_tokenizer(str(tmp_path / "tok")))
    model = write_model_config(str(tmp_path / "model"), vocab_size=len(tokenizer) - 10)

    class Args:
        config_path, model_path, tokenizer_path, trust_remote_code = model, None, str(tmp_path / "tok"), False

    with pytest.raises(
        ConfigError, match=rf"has {len(tokenizer)} tokens but the model's vocab_size is {len(tokenizer) - 10}"
    ):
        check_vocab(tokenizer, Args)
    Args.config_path = write_model_config(str(tmp_path / "model2"), vocab_size=len(tokenizer))
    check_vocab(tokenizer, Args)


def test_a_known_model_type_naming_custom_code_is_refused(tmp_path):
    from veomni.models import build_config, build_tokenizer
    from veomni.models.auto import CustomCodeError

    folder = write_model_config(str(tmp_path / "m"), auto_map={"AutoConfig": "custom.Cfg"})  # model_type qwen2
    with pytest.raises(CustomCodeError, match="names custom code .* set model.trust_remote_code true"):
        build_config(folder)
    tok = write_tokenizer(str(tmp_path / "t"))
    config = json.load(open(os.path.join(tok, "tokenizer_config.json")))
    json.dump(
        dict(config, auto_map={"AutoTokenizer": [None, "custom.Tok"]}),
        open(os.path.join(tok, "tokenizer_config.json"), "w"),
    )
    with pytest.raises(CustomCodeError, match="tokenizer_config.json names custom code"):
        build_tokenizer(tok)


def test_a_template_that_never_renders_the_reply_says_so(tmp_path):
    from transformers import AutoTokenizer

    from veomni.data import build_chat_template
    from veomni.data.chat_template import ChatTemplateError

    tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(str(tmp_path / "tok")))
    tokenizer.chat_template = (  # renders the questions and a generation prompt, never the assistant's answers
        "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="does not render the assistant's reply; use data.chat_template chatml"):
        build_chat_template("tokenizer", tokenizer)


def test_a_huge_record_is_said_in_the_log(tmp_path, monkeypatch, caplog):
    import veomni.data.readers as readers

    monkeypatch.setattr(readers, "BIG_RECORD_BYTES", 1 << 10)
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b" * 4000}) + "\n")
    with caplog.at_level("WARNING"):
        readers.RecordFiles([str(path)]).first(2)
    assert f"{path}:2: a record of 0 MB" in caplog.text


# ------------------------------------------------------------------------------------------- checkpoints
uses_group = pytest.mark.usefixtures("one_process_group")  # the Checkpointer is collective (conftest.py)


def _checkpoint(out: str, model: nn.Module, optimizer) -> str:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    Checkpointer(out).save(1, model, optimizer, {"trainer": {}, "rng": {}}, {})
    Checkpointer(out).save(2, model, optimizer, {"trainer": {}, "rng": {}}, {})
    return resolve_checkpoint("auto", out)


@uses_group
def test_a_checkpoint_damaged_in_place_is_refused_naming_file_and_the_earlier_one(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 3))
    path = _checkpoint(str(tmp_path / "run"), model, torch.optim.AdamW(model.parameters()))
    shard = next(f for f in os.listdir(os.path.join(path, "model_optimizer")) if f.endswith(".distcp"))
    with open(os.path.join(path, "model_optimizer", shard), "r+b") as f:  # 64 bytes overwritten, size unchanged
        f.seek(200)
        f.write(b"\x7f" * 64)
    with pytest.raises(
        CheckpointError, match=rf"{shard} does not match its checksum; the previous complete .*global_step_1"
    ):
        Checkpointer(str(tmp_path / "run")).load(path, model, torch.optim.AdamW(model.parameters()))


@uses_group
def test_a_checkpoint_of_another_optimizer_or_model_says_how_to_go_on(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 3))
    path = _checkpoint(str(tmp_path / "run"), model, torch.optim.AdamW(model.parameters()))
    other = nn.Sequential(nn.Linear(4, 32), nn.Linear(32, 3))
    with pytest.raises(
        CheckpointError, match=r"another model or optimizer: '.*' has shape \(64, 4\) in it, \(32, 4\)"
    ) as err:
        Checkpointer(str(tmp_path / "run")).load(path, other, torch.optim.AdamW(other.parameters()))
    assert "previous complete checkpoint" not in str(err.value)  # an older checkpoint would not fit either
    assert "another train.checkpoint.output_dir, or --train.checkpoint.overwrite true" in str(err.value)


def test_a_full_disk_is_named_when_torch_only_says_unexpected_pos(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from veomni.checkpoint.checkpointer import _save_failure

    inner = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (inner, None)})
    message = str(_save_failure(wrapped, str(tmp_path / "checkpoints" / "global_step_3.tmp")))
    assert "most likely a full disk or quota" in message and "MiB free there" in message
    assert "ranks:dict_keys" not in message


@uses_group
def test_a_same_size_resume_reads_only_its_own_extra_state(tmp_path, monkeypatch):
    import veomni.checkpoint.checkpointer as ckpt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8))
    path = _checkpoint(str(tmp_path / "run"), model, torch.optim.AdamW(model.parameters()))
    read = []
    monkeypatch.setattr(ckpt, "_load_extra", lambda file, checkpoint: read.append(file) or {"trainer": {}})
    loaded = Checkpointer(str(tmp_path / "run")).load(path, model, torch.optim.AdamW(model.parameters()))
    assert read == [] and loaded["extra_states"][0] == {"trainer": {}} and len(read) == 1


# --------------------------------------------------------------------------------------- trainer resumes
def test_raising_max_steps_on_resume_takes_the_new_schedule_from_its_first_step(tmp_path):
    from veomni.optim.lr_scheduler import lr_at

    config = tiny_run_config(str(tmp_path))
    out = str(tmp_path / "out")
    torchrun(
        TRAIN, [config, "--train.checkpoint.output_dir", out, "--train.max_steps", "4", "--train.log_steps", "1"], 1
    )
    torchrun(
        TRAIN, [config, "--train.checkpoint.output_dir", out, "--train.max_steps", "8", "--train.log_steps", "1"], 1
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    for m in metrics[4:]:  # the cosine of 8 steps (warmup 0.2), from step 5 on
        assert m["lr"] == pytest.approx(lr_at(m["step"] - 1, 8, 3e-3, 1e-7, 0.0, 0.2, "cosine", 1.0), rel=1e-9)


def test_more_ranks_after_a_resume_each_keep_generators_of_their_own():
    """A rank that saved gets its own generators back; a rank new to the run gets a seed of its own, not rank 0's
    state (which would give every rank the same dropout masks)."""
    from veomni.checkpoint import rng_state
    from veomni.trainer.checkpointing import restore_rank_rng

    torch.manual_seed(7)
    saved = [{"rng": rng_state()}]  # a 1-rank checkpoint
    draws = []
    for rank in range(2):
        torch.manual_seed(123)  # whatever state the new process had
        restore_rank_rng(saved, rank, seed=0, step=5)
        draws.append(torch.rand(3).tolist())
    torch.manual_seed(7)
    assert draws[0] == torch.rand(3).tolist()  # rank 0: exactly its saved stream
    assert draws[1] != draws[0]
    torch.manual_seed(999)
    restore_rank_rng(saved, 1, seed=0, step=5)
    assert torch.rand(3).tolist() == draws[1]  # rank 1's stream is reproducible


def test_rank0_failing_alone_ends_every_rank_at_once(tmp_path):
    """Rank 0's file work before a collective fails (here: a checkpoint folder it cannot create): the other rank
    raises the same error at once instead of waiting in a barrier for the collective timeout."""
    script = os.path.join(REPO, "tests", "dist", "check_rank_failures.py")
    proc = torchrun(script, ["rank0_fails", str(tmp_path)], 2, timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stdout.count("RANK_SAW_THE_ERROR") == 2, proc.stdout + proc.stderr[-3000:]
