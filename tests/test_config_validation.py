"""Parse-time range checks: every numeric key given a zero, negative, out-of-range or non-dividing value fails in
`parse_args` with a message naming the key and where the value came from; valid edge values pass."""

import dataclasses
import glob
import os
import sys
import typing

import pytest

from helpers import REPO, child_env, run_python, tiny_run_config, write_token_data
from veomni.arguments import ConfigError, VeOmniArguments, parse_args
from veomni.arguments.parser import _all_keys, _field_types
from veomni.arguments.validation import RULES

# (key, a bad value): each key of RULES appears at least once
BAD = [
    ("data.max_seq_len", "0"),
    ("data.max_seq_len", "-5"),
    ("data.train_size", "0"),
    ("data.train_sample", "-1"),
    ("data.shuffle_buffer_size", "0"),
    ("data.dataloader.num_workers", "-1"),
    ("data.dataloader.prefetch_factor", "0"),
    ("train.seed", "-1"),
    ("train.micro_batch_size", "0"),
    ("train.micro_batch_size", "-2"),
    ("train.global_batch_size", "0"),
    ("train.num_train_epochs", "0"),
    ("train.max_steps", "0"),
    ("train.max_steps", "-3"),
    ("train.bsz_warmup_ratio", "1.5"),
    ("train.bsz_warmup_init_mbtoken", "0"),
    ("train.dyn_bsz_buffer_size", "0"),
    ("train.log_steps", "0"),
    ("train.eval_steps", "-1"),
    ("train.eval_max_new_tokens", "0"),
    ("train.early_stopping_patience", "-1"),
    ("train.accelerator.dist_timeout_minutes", "0"),
    ("train.plan_check_memory_gib", "0"),
    ("model.ops_implementation.loss_chunk_size", "-1"),
    ("model.lora.r", "0"),
    ("model.lora.alpha", "0"),
    ("model.lora.dropout", "1"),
    ("train.optimizer.lr", "-1e-4"),
    ("train.optimizer.lr", "0"),
    ("train.optimizer.lr", "nan"),
    ("train.optimizer.lr", "inf"),
    ("train.optimizer.lr_min", "-1e-7"),
    ("train.optimizer.lr_start", "-0.1"),
    ("train.optimizer.lr_warmup_ratio", "-0.1"),
    ("train.optimizer.lr_warmup_ratio", "1.1"),
    ("train.optimizer.lr_decay_ratio", "2"),
    ("train.optimizer.weight_decay", "-0.01"),
    ("train.optimizer.betas", "0.9,1.0"),
    ("train.optimizer.betas", "0.9"),
    ("train.optimizer.eps", "-1e-8"),
    ("train.optimizer.max_grad_norm", "nan"),
    ("train.optimizer.muon_lr", "0"),
    ("train.optimizer.muon_momentum", "1"),
    ("train.optimizer.muon_weight_decay", "-1"),
    ("train.optimizer.muon_ns_steps", "0"),
    ("train.optimizer.muon_ns_coefficients", "1,2"),
    ("train.optimizer.muon_eps", "-1"),
    ("train.accelerator.dp_size", "0"),
    ("train.accelerator.dp_size", "-2"),
    ("train.accelerator.dp_replicate_size", "0"),
    ("train.accelerator.dp_shard_size", "-3"),
    ("train.accelerator.tp_size", "0"),
    ("train.accelerator.pp_size", "0"),
    ("train.accelerator.cp_size", "2"),
    ("train.accelerator.ulysses_size", "0"),
    ("train.accelerator.extra_parallel_sizes", "0"),
    ("train.accelerator.fsdp_config.max_load_broadcast_size", "0"),
    ("train.checkpoint.save_steps", "-1"),
    ("train.checkpoint.save_total_limit", "-1"),
]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_bad_value_fails_at_parse_time_naming_the_key(key, value):
    argv = [f"--{key}", value]
    if key == "train.accelerator.extra_parallel_sizes":
        argv += ["--train.accelerator.extra_parallel_names", "ep"]
    with pytest.raises(ConfigError, match=rf"^command line: key '{key}': value .* must be"):
        parse_args(VeOmniArguments, argv)


def test_every_rule_has_a_failing_example():
    assert set(RULES) <= {k for k, _ in BAD}


def _is_numeric(tp) -> bool:
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, list, typing.List):
        return any(_is_numeric(a) for a in targs if a is not type(None))
    return tp in (int, float)


def _numeric_keys(cls, prefix=""):
    types = _field_types(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = types[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_keys(tp, f"{prefix}{f.name}.")
        elif _is_numeric(tp):
            yield f"{prefix}{f.name}"


def test_every_numeric_key_has_a_rule():
    """A new numeric key must bring its range (veomni/arguments/validation.py RULES)."""
    numeric = set(_numeric_keys(VeOmniArguments))
    assert numeric, "no numeric keys found: the walk is broken"
    assert not numeric - set(RULES), f"numeric keys without a rule: {sorted(numeric - set(RULES))}"
    assert not set(RULES) - set(_all_keys(VeOmniArguments)), "rules for keys that do not exist"


def test_yaml_value_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  max_seq_len: 2048\ntrain:\n  micro_batch_size: 2\n  max_steps: 0\n")
    with pytest.raises(ConfigError, match=rf"^{path}:5: key 'train.max_steps': value 0 must be >= 1, or null"):
        parse_args(VeOmniArguments, [str(path)])


def test_global_batch_not_a_multiple_of_micro_batch_suggests_values():
    with pytest.raises(ConfigError, match=r"key 'train.global_batch_size': value 10 .* nearest valid: 8 or 12"):
        parse_args(VeOmniArguments, ["--train.micro_batch_size", "4", "--train.global_batch_size", "10"])


@pytest.mark.parametrize(
    "argv,key",
    [
        (["--data.dataloader.prefetch_factor", "2"], "data.dataloader.prefetch_factor"),
        (["--train.accelerator.extra_parallel_sizes", "2"], "train.accelerator.extra_parallel_sizes"),
        (["--train.accelerator.extra_parallel_names", "ep,ep"], "train.accelerator.extra_parallel_sizes"),
    ],
)
def test_inconsistent_pairs_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=rf"key '{key}'"):
        parse_args(VeOmniArguments, argv)


def test_valid_edges_pass():
    args = parse_args(
        VeOmniArguments,
        [
            "--train.max_steps", "1",
            "--train.optimizer.lr_warmup_ratio", "1",
            "--train.optimizer.max_grad_norm", "-1",
            "--train.checkpoint.save_steps", "0",
            "--data.dataloader.num_workers", "0",
            "--train.accelerator.dp_size", "-1",
            "--train.micro_batch_size", "3",
            "--train.global_batch_size", "9",
            "--data.train_size", "null",
        ],
    )  # fmt: skip
    assert args.train.max_steps == 1 and args.train.global_batch_size == 9


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(REPO, "configs", "text", "*.yaml"))))
def test_shipped_configs_pass(config):
    from veomni.arguments.dpo_arguments import DPOVeOmniArguments

    with open(config) as f:  # a preference config has its `dpo` group (tasks/train_dpo.py parses it so)
        kind = DPOVeOmniArguments if "\ndpo:" in "\n" + f.read() else VeOmniArguments
    parse_args(kind, [config])


def test_run_that_trains_nothing_is_an_error(tmp_path):
    """Valid numbers, too little streamed data for one step (its length is unknown up front, so only the loop can
    tell): the run fails (non-zero exit, the reason printed) and saves no `global_step_0` checkpoint, instead of
    "training" 0 steps and exiting 0."""
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=2)
    config = tiny_run_config(tmp)
    out = f"{tmp}/out"
    task = os.path.join(REPO, "tasks", "train_text.py")  # plain python: a world of one, no launcher to start
    cmd = [sys.executable, task, config, "--train.checkpoint.output_dir", out, "--data.datasets_type", "iterable"]
    proc = run_python(cmd, env=child_env(), timeout=300)
    assert proc.returncode != 0
    assert "no training step ran" in proc.stdout + proc.stderr
    assert not os.path.isdir(os.path.join(out, "checkpoints"))
