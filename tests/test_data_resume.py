"""A checkpoint knows its data (#37): the loader state records the data fingerprint (files, transform, tokenizer)
and its position; resuming on changed data is refused in one line naming what changed and the key that accepts it
(`data.allow_changed_data`, which restarts the data order at the current epoch and says so)."""

import json
import logging
import os
import sys
from functools import partial

import pytest

from helpers import (
    REPO,
    child_env,
    document_starts,
    read_metrics,
    run_python,
    tiny_run_config,
    token_loader,
    write_token_data,
)
from veomni.data import build_dataset
from veomni.data.data_transform import DataFormatError, process_pretrain_example

MAX_LEN = 64


class CharTokenizer:
    """A tokenizer of one id per character, `offset` apart: another offset is another tokenizer."""

    eos_token_id = 0

    def __init__(self, offset: int = 1):
        self.offset = offset

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 400 + self.offset for c in text]

    def get_vocab(self):
        return {chr(i): i + self.offset for i in range(400)}


def _texts(path, n, start=0):
    with open(path, "w") as f:
        for r in range(start, start + n):
            f.write(json.dumps({"text": f"record {r} " + "words " * (r % 7 + 2)}) + "\n")
    return str(path)


def _loader(path, kind, tokenizer=None, max_len=MAX_LEN, **kw):
    transform = partial(process_pretrain_example, tokenizer=tokenizer or CharTokenizer(), max_seq_len=max_len)
    dataset = build_dataset(train_path=path, datasets_type=kind, transform=transform, seed=3)
    return token_loader(dataset, max_seq_len=MAX_LEN, micro=1, dlbs=2, **kw)


def _saved_after_two_steps(path, kind):
    loader = _loader(path, kind)
    loader.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    return loader.state_dict()


@pytest.mark.parametrize("kind", ["mapping", "iterable"])
def test_resume_on_changed_data_is_refused_naming_what_changed_and_the_key(tmp_path, kind):
    path = _texts(tmp_path / "data.jsonl", 100)
    state = _saved_after_two_steps(path, kind)
    assert state["veomni_data"]["fingerprint"]["files"] and state["veomni_data"]["epoch"] == 0
    _loader(path, kind).load_state_dict(state)  # the same data: accepted
    cases = {
        "data files": lambda: _loader(_texts(tmp_path / "data.jsonl", 10), kind),  # cut from 100 records to 10
        "transform": lambda: _loader(_texts(tmp_path / "data.jsonl", 100), kind, max_len=32),
        "tokenizer": lambda: _loader(path, kind, tokenizer=CharTokenizer(offset=5)),
    }
    for changed, make in cases.items():
        with pytest.raises(DataFormatError) as err:
            make().load_state_dict(state)
        message = str(err.value)
        assert "\n" not in message and f"the {changed} differ from the checkpoint's" in message, message
        assert "set --data.allow_changed_data true" in message and "restarting at the current epoch" in message


@pytest.mark.parametrize("kind", ["mapping", "iterable"])
def test_allow_changed_data_restarts_the_epoch_on_the_new_data_and_says_so(tmp_path, kind, caplog):
    path = _texts(tmp_path / "data.jsonl", 100)
    state = _saved_after_two_steps(path, kind)
    _texts(tmp_path / "data.jsonl", 10, start=500)  # other records
    loader = _loader(path, kind, allow_changed_data=True)
    with caplog.at_level(logging.WARNING):
        loader.load_state_dict(state)
    assert "the data files changed since the checkpoint" in caplog.text and "restarts at the start" in caplog.text
    loader.set_epoch(0)
    fresh = _loader(path, kind)
    fresh.set_epoch(0)
    assert [document_starts(mb) for step in loader for mb in step] == [
        document_starts(mb) for step in fresh for mb in step
    ]  # the new data's epoch from its start, not the saved position


def test_a_run_resumed_on_cut_data_is_refused_and_continues_with_the_key(tmp_path):
    """The trainer end to end: a checkpoint of 100 records, the file then replaced by 60 others."""
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=100, low=20, high=100)
    config, out = tiny_run_config(tmp), f"{tmp}/run"
    task = [sys.executable, os.path.join(REPO, "tasks", "train_text.py"), config, "--train.checkpoint.output_dir", out]

    def run(*extra):
        return run_python([*task, *extra], env=child_env(), timeout=300)

    first = run("--train.max_steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    write_token_data(f"{tmp}/data.jsonl", n=60, low=20, high=100, seed=1)
    refused = run("--train.max_steps", "4")
    lines = [line for line in refused.stderr.splitlines() if "resuming on changed data" in line]
    assert refused.returncode != 0 and len(lines) == 1, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "the data files differ" in lines[0] and "--data.allow_changed_data true" in lines[0]
    allowed = run("--train.max_steps", "4", "--data.allow_changed_data", "true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "data order restarts at the start of the current epoch" in allowed.stdout + allowed.stderr
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
