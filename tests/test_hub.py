"""Models and datasets by hub name (veomni.utils.hub), with no hub reachable: caches laid out exactly as
`huggingface_hub` writes them (tests/hub_cache.py) and HF_HUB_OFFLINE=1."""

import json
import os
import subprocess
import sys

import pytest
from hub_cache import COMMIT, DATA_COMMIT, NEW_TOKENS, PROMPTS, build_hub_cache, offline_env, trained_runs

from helpers import REPO, read_metrics, torchrun_cmd


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    return build_hub_cache(tmp_path_factory)


def test_download_runs_on_local_rank_0_while_the_other_waits(tmp_path):
    cache, work = str(tmp_path / "cache"), str(tmp_path)
    cmd = torchrun_cmd(2, os.path.join(REPO, "tests", "dist", "check_hub_download.py"), cache, work)
    proc = subprocess.run(cmd, cwd=REPO, env=offline_env(cache), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(os.path.join(work, f"rank{r}.json"))) for r in range(2)]
    # only local rank 0 called snapshot_download, once per name (with the revision); both ranks got its folder
    assert open(os.path.join(work, "calls.txt")).read().splitlines() == [
        "0 fetch-org/model v1",
        "0 fetch-org/broken raise",
    ]
    snapshot = os.path.join(cache, "models--fetch-org--model", "snapshots", "c" * 40)
    for report in ranks:
        assert report["download"] == {**report["download"], "found": {"model.model_path": snapshot}, "error": None}
    assert ranks[1]["download"]["returned"] >= ranks[0]["download_done"]  # rank 1 waited for the download
    # the raised error ends both ranks with the same one line naming the key, the model and the offline flag
    for report in ranks:
        error = report["raise"]["error"]
        assert report["raise"]["found"] is None and error == ranks[0]["raise"]["error"] and "\n" not in error
        assert error.startswith("model.tokenizer_path: fetch-org/broken ") and "HF_HUB_OFFLINE=1" in error
        missing = report["missing"]["error"]
        assert missing.startswith("model.model_path: nobody/nothing is neither a local path nor in the hub cache")
        assert cache in missing and "HF_HUB_OFFLINE=1" in missing


def test_trains_by_hub_name_and_revision_on_two_ranks(tmp_path_factory, tmp_path):
    """`org/name` weights, an `org/name@commit` tokenizer and `hf://datasets/org/name` data, all from the offline
    cache, on 2 ranks; LoRA, whose adapter records the hub name (not the cache path) as its base."""
    runs = trained_runs(tmp_path_factory)
    out, cache = runs["lora"], runs["cache"]
    snapshot = os.path.join(cache, "models--tiny-org--qwen3-tiny", "snapshots", COMMIT)
    assert f"loaded weights from {snapshot}" in runs["log"]
    assert "data cache built: " in runs["log"] and DATA_COMMIT in runs["log"]  # the snapshot's commit keys the cache
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    adapter = json.load(open(os.path.join(out, "hf", "adapter_config.json")))
    assert adapter["base_model_name_or_path"] == "tiny-org/qwen3-tiny"
    # veomni.chat on the adapter folder (its base by name, from the cache) answers as the sharded model did in training
    prompts, answers = str(tmp_path / "prompts.txt"), str(tmp_path / "answers.jsonl")
    open(prompts, "w").write("\n".join(PROMPTS) + "\n")
    chat = [sys.executable, "-m", "veomni.chat", os.path.join(out, "hf"), "--prompt-file", prompts, "--output", answers]
    chat += ["--max-new-tokens", str(NEW_TOKENS)]
    proc = subprocess.run(chat, cwd=REPO, env=offline_env(cache), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = read_metrics(out)[-1]["samples"]
    assert [json.loads(line) for line in open(answers)] == samples and len(samples) == len(PROMPTS)


def test_a_missing_name_offline_is_a_one_line_config_error(hub_cache, monkeypatch):
    """The trainer's check of the paths (before anything is built): a ConfigError, which the task says in one line."""
    from huggingface_hub import constants

    from veomni.arguments import ConfigError, VeOmniArguments, parse_args
    from veomni.trainer.preflight import check_paths

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache)
    argv = ["--model.config_path", "x/absent", "--model.tokenizer_path", "tiny-org/qwen3-tiny"]
    argv += ["--data.train_path", "hf://datasets/tiny-org/chats/data", "--data.eval_path", "null"]
    args = parse_args(VeOmniArguments, [os.path.join(REPO, "configs/text/demo.yaml"), *argv])
    with pytest.raises(ConfigError) as err:
        check_paths(args)
    assert str(err.value) == (
        f"model.config_path: x/absent is neither a local path nor in the hub cache {hub_cache} (HF_HUB_OFFLINE=1: "
        "nothing is downloaded; unset it to download, or set HF_HOME/HF_HUB_CACHE to the cache that holds it)"
    )
    args.model.config_path = f"tiny-org/qwen3-tiny@{COMMIT}"
    check_paths(args)  # found by revision, in place
    assert args.model.config_path == args.model.tokenizer_path  # (by name: refs/main holds that commit)
    assert args.model.config_path == os.path.join(hub_cache, "models--tiny-org--qwen3-tiny", "snapshots", COMMIT)
    assert args.data.train_path == os.path.join(
        hub_cache, "datasets--tiny-org--chats", "snapshots", DATA_COMMIT, "data"
    )
