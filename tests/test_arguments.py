"""The configuration system: seed snippets, precedence, type checks, did-you-mean, file:line."""

import os
import re
import sys
import textwrap
from dataclasses import dataclass, field

import pytest
import yaml

from helpers import REPO, child_env, run_python
from veomni.arguments import ConfigError, TrainingArguments, VeOmniArguments, parse_args, save_args

SEED_ARGUMENTS = """
from dataclasses import dataclass, field
from veomni.arguments import DataArguments, ModelArguments, TrainingArguments, parse_args, VeOmniArguments

@dataclass
class Arguments(VeOmniArguments):
    model: "ModelArguments" = field(default_factory=ModelArguments)
    data: "DataArguments" = field(default_factory=DataArguments)
    train: "TrainingArguments" = field(default_factory=TrainingArguments)

if __name__ == "__main__":
    args = parse_args(Arguments)
    print(args.train.optimizer.lr)  # Access default arguments
"""

SEED_CUSTOM = """
from dataclasses import dataclass, field
from veomni.arguments import DataArguments, ModelArguments, TrainingArguments, parse_args, VeOmniArguments

@dataclass
class CustomTrainingArguments(TrainingArguments):
    enable_xxx: bool = field(
        default=False,
        metadata={"help": "Enable me if necessary."},
    )

@dataclass
class Arguments(VeOmniArguments):
    model: "ModelArguments" = field(default_factory=ModelArguments)
    data: "DataArguments" = field(default_factory=DataArguments)
    train: "CustomTrainingArguments" = field(default_factory=CustomTrainingArguments)

if __name__ == "__main__":
    args = parse_args(Arguments)
    print(args.train.enable_xxx, args.train.optimizer.lr)
"""


def _run_snippet(tmp_path, code, *argv):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    return run_python([sys.executable, str(script), *argv], env=child_env())


def test_seed_arguments_snippet_prints_default_lr(tmp_path):
    out = _run_snippet(tmp_path, SEED_ARGUMENTS)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(TrainingArguments().optimizer.lr)


def test_seed_custom_extension_snippet(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  enable_xxx: true\n  optimizer:\n    lr: 0.01\n")
    out = _run_snippet(tmp_path, SEED_CUSTOM, str(cfg), "--train.optimizer.lr", "2e-4")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "0.0002"]


def _write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_cli_over_yaml_over_defaults(tmp_path):
    path = _write(
        tmp_path,
        """
        data:
          max_seq_len: 1024
        train:
          micro_batch_size: 3
          optimizer:
            lr: 0.1
            betas: [0.8, 0.9]
          accelerator:
            fsdp_config:
              mixed_precision:
                enable: true
    """,
    )
    args = parse_args(
        VeOmniArguments,
        [
            path,
            "--train.optimizer.lr=0.5",
            "--train.accelerator.extra_parallel_sizes",
            "2",
            "--train.accelerator.extra_parallel_names",
            "ep",
            "--train.dyn_bsz",
            "false",
            "--train.gradient_checkpointing.enable",
            "--model.model_path",
            "/m",
        ],
    )
    assert args.train.optimizer.lr == 0.5  # CLI wins
    assert args.data.max_seq_len == 1024 and args.train.micro_batch_size == 3  # YAML wins over default
    assert args.train.optimizer.betas == [0.8, 0.9]
    assert args.train.accelerator.fsdp_config.mixed_precision.enable is True
    assert args.train.accelerator.extra_parallel_sizes == [2] and args.train.accelerator.extra_parallel_names == ["ep"]
    assert args.train.dyn_bsz is False and args.train.gradient_checkpointing.enable is True
    assert args.model.config_path == "/m" and args.model.tokenizer_path == "/m"  # derived from model_path
    assert args.train.optimizer.weight_decay == 0.0  # default
    # outside torchrun the sizes resolve for the smallest world they fit: ep=2 needs 2 ranks, so dp=2
    assert args.train.accelerator.dp_size == 2
    assert args.train.global_batch_size == 6 and args.train.dataloader_batch_size == 1


def test_unknown_yaml_key_names_file_line_and_suggestion(tmp_path):
    path = _write(
        tmp_path,
        """
        train:
          optimizer:
            lr: 0.1
          gradient_checkpoint:
            enable: true
    """,
    )
    with pytest.raises(ConfigError) as err:
        parse_args(VeOmniArguments, [path])
    assert f"{path}:5" in str(err.value)
    assert "unknown key 'train.gradient_checkpoint'" in str(err.value)
    assert "did you mean 'train.gradient_checkpointing'" in str(err.value)


def test_unknown_cli_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"command line: unknown key 'train.optimizer.learning_rat'.*"):
        parse_args(VeOmniArguments, ["--train.optimizer.learning_rat", "1"])
    with pytest.raises(ConfigError, match="did you mean 'train.micro_batch_size'"):
        parse_args(VeOmniArguments, ["--train.micro_batchsize", "1"])


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["--train.micro_batch_size", "two"], r"key 'train.micro_batch_size': value 'two' is not int"),
        (["--train.dyn_bsz", "maybe"], r"key 'train.dyn_bsz': value 'maybe' is not bool"),
        (["--train.init_device", "tpu"], r"value 'tpu' is not one of 'cpu', 'cuda', 'meta'"),
        (
            ["--train.accelerator.extra_parallel_sizes", "[2, x]"],
            r"key 'train.accelerator.extra_parallel_sizes\[1\]': value 'x' is not int",
        ),
    ],
)
def test_wrong_cli_types_name_key_value_and_type(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_args(VeOmniArguments, argv)


def test_wrong_yaml_type_names_line(tmp_path):
    path = _write(tmp_path, "train:\n  optimizer:\n    lr: fast\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: key 'train.optimizer.lr': value 'fast' is not float"):
        parse_args(VeOmniArguments, [path])
    path = _write(tmp_path, "train: 3\n")
    with pytest.raises(ConfigError, match="is a group of keys"):
        parse_args(VeOmniArguments, [path])


def test_global_batch_must_divide(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"micro_batch_size \* dp_size = 2 \* 2 = 4"):
        parse_args(VeOmniArguments, ["--train.micro_batch_size", "2", "--train.global_batch_size", "6"])
    args = parse_args(VeOmniArguments, ["--train.micro_batch_size", "2", "--train.global_batch_size", "16"])
    assert args.train.accelerator.dp_size == 2 and args.train.dataloader_batch_size == 4


def test_compute_train_steps():
    args = parse_args(VeOmniArguments, ["--train.micro_batch_size", "2", "--train.global_batch_size", "8"])
    assert args.compute_train_steps(100) == 12 and args.train_steps == 12  # 100 samples / (2 * 4) per step
    args.train.max_steps = 5
    assert args.compute_train_steps(100) == 5
    args = parse_args(
        VeOmniArguments, ["--train.global_batch_size", "4", "--data.train_size", "40960", "--data.max_seq_len", "1024"]
    )
    assert args.compute_train_steps(None) == 10  # dyn_bsz: tokens / (global_batch * max_seq_len)
    args = parse_args(
        VeOmniArguments, ["--train.dyn_bsz", "false", "--train.global_batch_size", "4", "--data.train_sample", "100"]
    )
    assert args.compute_train_steps(None) == 25


def test_train_group_computes_steps_as_the_seed_names_it(tmp_path):
    """The seed's loader snippet says `args.train.compute_train_steps`: the train group reaches its data group."""
    args = parse_args(VeOmniArguments, ["--train.micro_batch_size", "2", "--train.global_batch_size", "8"])
    assert args.train.compute_train_steps(100) == 12 == args.train.train_steps == args.train_steps
    args.data.train_size, args.data.max_seq_len = 40960, 1024  # dyn_bsz: tokens / (global batch * max_seq_len)
    assert args.train.compute_train_steps(None) == 5 == args.compute_train_steps(None)
    with pytest.raises(ValueError, match="needs the data group"):
        TrainingArguments().compute_train_steps(100)  # alone, it has no data group to read
    saved = yaml.safe_load(open(save_args(args, str(tmp_path))))
    assert "_data" not in saved["train"]  # a link, not a key: the saved config is unchanged


def test_a_mapping_key_takes_a_flow_mapping_on_the_command_line():
    """`--data.mm_configs '{media_dir: /data}'` is a mapping, as in the YAML (it stayed a string before)."""
    args = parse_args(VeOmniArguments, ["--data.mm_configs", '{"media_dir": "/data/images", "video_fps": 1}'])
    assert args.data.mm_configs == {"media_dir": "/data/images", "video_fps": 1}
    with pytest.raises(ConfigError, match="key 'data.mm_configs': value '/data' is not"):
        parse_args(VeOmniArguments, ["--data.mm_configs", "/data"])


@pytest.mark.parametrize(
    "yaml_wandb,cli,enabled",
    [
        ({}, [], False),
        ({}, ["--train.wandb.project", "p"], True),  # a project named on the command line
        ({"name": "run-1"}, [], True),  # or in the YAML
        ({"project": "p", "enable": False}, [], False),  # enable said explicitly wins
        ({"project": "p"}, ["--train.wandb.enable", "false"], False),
        ({}, ["--train.wandb.mode", "online"], False),  # the mode alone is no request to log
    ],
)
def test_wandb_turns_on_when_a_project_or_name_is_set(tmp_path, monkeypatch, yaml_wandb, cli, enabled):
    import logging

    from veomni.arguments import validation

    monkeypatch.delitem(validation.OPTIONAL_PACKAGES, "train.wandb.enable")  # wandb need not be installed here

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"wandb": yaml_wandb}} if yaml_wandb else {}))
    records, handler = [], logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("veomni.arguments.validation")
    logger.addHandler(handler)
    try:
        args = parse_args(VeOmniArguments, [str(path), *cli])
    finally:
        logger.removeHandler(handler)
    assert args.train.wandb.enable is enabled
    assert any("wandb logging on" in r.getMessage() for r in records) is enabled  # said, when turned on


def test_resolved_config_round_trips(tmp_path):
    args = parse_args(VeOmniArguments, ["--train.optimizer.lr", "0.25", "--data.text_keys", "content"])
    path = save_args(args, str(tmp_path))
    saved = yaml.safe_load(open(path))
    assert saved["train"]["optimizer"]["lr"] == 0.25
    saved["train"].pop("dataloader_batch_size")
    saved["train"].pop("train_steps")
    clean = tmp_path / "again.yaml"
    clean.write_text(yaml.safe_dump(saved))
    again = parse_args(VeOmniArguments, [str(clean)])
    assert again == args


@dataclass
class _Custom(TrainingArguments):
    enable_xxx: bool = field(default=False, metadata={"help": "x"})


@dataclass
class _Args(VeOmniArguments):
    train: _Custom = field(default_factory=_Custom)


def test_subclassed_group_keys_are_valid_and_checked():
    assert parse_args(_Args, ["--train.enable_xxx", "true"]).train.enable_xxx is True
    with pytest.raises(ConfigError, match="did you mean 'train.enable_xxx'"):
        parse_args(_Args, ["--train.enable_xx", "true"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        parse_args(VeOmniArguments, ["nope.yaml"])
    assert os.path.isdir(REPO)


@pytest.mark.parametrize(
    "cli, said",
    [
        (
            ["--train.use_tensorboard", "true"],
            "command line: key 'train.use_tensorboard': needs the tensorboard package",
        ),
        (["--train.wandb.enable", "true"], "command line: key 'train.wandb.enable': needs the wandb package"),
        (
            ["--train.wandb.project", "p"],
            "turned on by train.wandb.project/name: key 'train.wandb.enable': needs the wandb",
        ),
    ],
)
def test_a_missing_logger_is_said_at_parse_time(monkeypatch, cli, said):
    """Before: found missing in on_train_begin, after the model was built, with a traceback."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in ("wandb", "tensorboard") else find_spec(n, *a)
    )
    with pytest.raises(ConfigError, match=re.escape(said)):
        parse_args(VeOmniArguments, cli)
