"""Models and datasets by hub name (veomni.utils.hub), with no hub reachable: caches laid out exactly as
`huggingface_hub` writes them (tests/hub_cache.py) and HF_HUB_OFFLINE=1."""

import json
import os
import subprocess
import sys

import pytest
from hub_cache import (
    COMMIT,
    DATA_COMMIT,
    NEW_TOKENS,
    PLAYS,
    PLAYS_COMMIT,
    PROMPTS,
    build_hub_cache,
    build_plays_cache,
    offline_env,
    trained_runs,
)

from helpers import REPO, read_metrics, run_python, torchrun_cmd


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


# ------------------------------------------------------------------------ hub datasets through `datasets`
def _plays_runs(plays, tmp_path) -> dict:
    """Four trainings in ONE process: the train parquet given as a local file and as `hf://datasets/...:train`,
    map-style and streamed. Returns {name: metrics}."""
    import yaml

    from helpers import write_model_config

    model = write_model_config(str(tmp_path / "model"), vocab_size=4096)  # the demo tokenizer's vocabulary
    runs, argv = {}, ["sequence"]
    for kind in ("mapping", "iterable"):
        for where, path in (("local", plays["train"]), ("hub", f"hf://datasets/{PLAYS}:train")):
            data = {"train_path": path, "datasets_type": kind, "max_seq_len": 48, "data_type": "plaintext"}
            train = {"seed": 0, "micro_batch_size": 2, "global_batch_size": 4, "dyn_bsz": False, "max_steps": 3}
            config = {"model": {"config_path": model, "tokenizer_path": plays["tokenizer"]}, "data": data}
            config["train"] = {**train, "init_device": "cpu", "log_steps": 1}
            name = f"{where}-{kind}"
            path_yaml, runs[name] = str(tmp_path / f"{name}.yaml"), str(tmp_path / name)
            with open(path_yaml, "w") as f:
                yaml.safe_dump(config, f)
            argv += (["::"] if len(argv) > 1 else []) + [
                "plain",
                path_yaml,
                "--train.checkpoint.output_dir",
                runs[name],
            ]
    env = {**offline_env(plays["cache"]), "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    cmd = [sys.executable, os.path.join(REPO, "tests", "dist", "trainer_scenarios.py"), *argv]  # a world of one
    proc = run_python(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: read_metrics(out) for name, out in runs.items()}


def test_a_hub_dataset_split_trains_as_its_parquet_map_style_and_streamed(tmp_path_factory, tmp_path):
    """`hf://datasets/org/name:train` through `datasets` (offline: the snapshot in the hub cache) gives the same
    batches, hence bit-identical losses, as the split's parquet file given as a local path: map-style (the split
    prepared by `load_dataset`, then our sample cache) and streamed (`datasets` streaming, its row groups the units)."""
    plays = build_plays_cache(tmp_path_factory)
    metrics = _plays_runs(plays, tmp_path)
    for kind in ("mapping", "iterable"):
        local, by_name = metrics[f"local-{kind}"], metrics[f"hub-{kind}"]
        assert [m["step"] for m in local] == [1, 2, 3], kind
        for key in ("loss", "grad_norm", "tokens"):  # what the batches hold and what they train to
            assert [m.get(key) for m in by_name] == [m.get(key) for m in local], (kind, key)
    assert metrics["local-mapping"][0]["loss"] != metrics["local-iterable"][0]["loss"]  # two different orders


def test_hub_dataset_errors_fingerprint_and_lazy_import(tmp_path_factory, tmp_path, monkeypatch):
    """A config or split typo: one line naming the key and what the repo has. The data fingerprint records the
    name, commit, config and split. Local data never imports `datasets`."""
    from huggingface_hub import constants

    from veomni.data import build_dataset
    from veomni.utils import hub

    plays = build_plays_cache(tmp_path_factory)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", plays["cache"])
    monkeypatch.setattr(hub, "data_entries", {})
    with monkeypatch.context() as without:  # local data needs no `datasets`; a hub split says how to get it
        without.setitem(sys.modules, "datasets", None)
        assert len(build_dataset(train_path=plays["train"], datasets_type="iterable").units) == 32
        with pytest.raises(hub.HubNameError, match=r"pip install 'veomni\[hub\]'"):
            build_dataset(train_path=f"hf://datasets/{PLAYS}:train", datasets_type="iterable")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "ds"))
    errors = {}
    for path in (f"hf://datasets/{PLAYS}:trian", f"hf://datasets/{PLAYS}/defualt:train", f"hf://datasets/{PLAYS}/x"):
        with pytest.raises(hub.HubNameError) as err:
            build_dataset(train_path=path, datasets_type="iterable")
        errors[path] = str(err.value)
    assert list(errors.values()) == [
        f"data.train_path: hf://datasets/{PLAYS}:trian: {PLAYS} (config default) has no split 'trian'; "
        "its splits: ['train', 'test']",
        f"data.train_path: hf://datasets/{PLAYS}/defualt:train: {PLAYS} has no config (nor file or folder) "
        "'defualt'; its configs: ['default']",
        f"data.train_path: hf://datasets/{PLAYS}/x: {PLAYS} has no config (nor file or folder) 'x'; its configs: "
        "['default']",
    ]
    source = f"{PLAYS}@{PLAYS_COMMIT} config=default split=test"
    for kind, path in (("iterable", f"hf://datasets/{PLAYS}:test"), ("mapping", f"hf://datasets/{PLAYS}/default:test")):
        dataset = build_dataset(train_path=path, datasets_type=kind, transform=_tokens, cache_dir=str(tmp_path / "c"))
        assert dataset.data_fingerprint()["source"] == source, kind
        assert len(list(dataset) if kind == "iterable" else dataset) == 8, kind  # the test split's 8 records
    # the file form stays: a path in the repo is read by our own readers
    files = build_dataset(train_path=hub.download(f"hf://datasets/{PLAYS}/data", data=True), datasets_type="iterable")
    assert len(files.files) == 2 and "source" not in files.data_fingerprint()


def _tokens(record):
    return {"input_ids": [ord(c) for c in record["text"][:8]]}
