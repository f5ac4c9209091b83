"""Range checks for every numeric key, run by `parse_args` before anything is built.

A value of the right type can still make a run that trains nothing or dies later with a bare `ZeroDivisionError`
(`max_seq_len 0`, `micro_batch_size 0`, `max_steps 0`). Each numeric key of the configuration tree has one rule
below; `tests/test_config_validation.py` fails when a numeric key has none, so a new key must bring its rule.
Errors are `ConfigError`s naming the key and where the value came from (file:line, or the command line).
"""

import importlib.util
import math
import re
from typing import Any, Callable, Dict, Optional, Tuple

from ..utils.logging import get_logger

logger = get_logger(__name__)


class ConfigError(ValueError):
    """A configuration mistake, worded for the person who made it."""


Rule = Tuple[Callable[[Any], bool], str]  # (accepts the value?, what a valid value is, for the message)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def at_least(low) -> Rule:
    return (lambda x: _finite(x) and x >= low), f">= {low}"


def positive() -> Rule:
    return (lambda x: _finite(x) and x > 0), "> 0"


def between(low, high, high_open: bool = False) -> Rule:
    right = ")" if high_open else "]"
    return (lambda x: _finite(x) and low <= x and (x < high if high_open else x <= high)), f"in [{low}, {high}{right}"


def any_finite() -> Rule:
    return _finite, "a finite number"


def optional(rule: Rule, null_means: str) -> Rule:
    check, text = rule
    return (lambda x: x is None or check(x)), f"{text}, or null ({null_means})"


def auto_or(rule: Rule) -> Rule:
    check, text = rule
    return (lambda x: x == -1 or check(x)), f"{text}, or -1 (derived)"


def each(rule: Rule, length: Optional[int] = None) -> Rule:
    check, text = rule
    count = f"{length} values, each " if length else "each value "
    return (lambda xs: (length is None or len(xs) == length) and all(check(x) for x in xs)), count + text


RULES: Dict[str, Rule] = {
    # data
    "data.max_seq_len": at_least(1),
    "data.train_size": optional(at_least(1), "not a token budget"),
    "data.train_sample": optional(at_least(1), "not a sample count"),
    "data.shuffle_buffer_size": at_least(1),  # 0 would never fill, so the stream would yield nothing
    "data.dataloader.num_workers": at_least(0),
    "data.dataloader.prefetch_factor": optional(at_least(1), "the loader's default"),
    # train
    "train.seed": at_least(0),
    "train.micro_batch_size": at_least(1),
    "train.global_batch_size": optional(at_least(1), "micro_batch_size * dp_size"),
    "train.num_train_epochs": at_least(1),
    "train.max_steps": optional(at_least(1), "no cap; 0 steps would train nothing"),
    "train.bsz_warmup_ratio": between(0, 1),
    "train.bsz_warmup_init_mbtoken": at_least(1),
    "train.dyn_bsz_buffer_size": at_least(1),
    "train.log_steps": at_least(1),
    "train.eval_steps": at_least(0),
    "train.eval_max_new_tokens": at_least(1),
    "train.early_stopping_patience": at_least(0),
    "train.accelerator.dist_timeout_minutes": positive(),
    "train.plan_check_memory_gib": optional(positive(), "the GPU's memory; nothing checked on CPU"),
    "model.ops_implementation.loss_chunk_size": at_least(0),
    "model.lora.r": at_least(1),
    "model.lora.alpha": positive(),
    "model.lora.dropout": between(0, 1, high_open=True),
    # train.optimizer
    "train.optimizer.lr": positive(),
    "train.optimizer.lr_min": at_least(0),
    "train.optimizer.lr_start": at_least(0),
    "train.optimizer.lr_warmup_ratio": between(0, 1),
    "train.optimizer.lr_decay_ratio": between(0, 1),
    "train.optimizer.weight_decay": at_least(0),
    "train.optimizer.betas": each(between(0, 1, high_open=True), length=2),
    "train.optimizer.eps": at_least(0),
    "train.optimizer.max_grad_norm": any_finite(),  # <= 0 disables clipping
    "train.optimizer.muon_lr": positive(),
    "train.optimizer.muon_momentum": between(0, 1, high_open=True),
    "train.optimizer.muon_weight_decay": at_least(0),
    "train.optimizer.muon_ns_steps": at_least(1),
    "train.optimizer.muon_ns_coefficients": each(any_finite(), length=3),
    "train.optimizer.muon_eps": at_least(0),
    # train.accelerator
    "train.accelerator.dp_size": auto_or(at_least(1)),
    "train.accelerator.dp_replicate_size": auto_or(at_least(1)),
    "train.accelerator.dp_shard_size": auto_or(at_least(1)),
    "train.accelerator.tp_size": at_least(1),
    "train.accelerator.pp_size": between(1, 1),
    "train.accelerator.cp_size": between(1, 1),
    "train.accelerator.ulysses_size": at_least(1),
    "train.accelerator.extra_parallel_sizes": each(at_least(1)),
    "train.accelerator.fsdp_config.max_load_broadcast_size": at_least(1),
    # train.checkpoint
    "train.checkpoint.save_steps": at_least(0),
    "train.checkpoint.save_total_limit": at_least(0),
}


_MISSING = object()  # a key the configuration class does not have (a custom root without some group)


def _get(args, path: str):
    node = args
    for part in path.split("."):
        node = getattr(node, part, _MISSING)  # stays _MISSING below a missing group
    return node


def validate_args(args, origins: Dict[str, str]) -> None:
    """Raise `ConfigError` for the first value outside its key's range, or an inconsistent pair of keys."""

    def fail(key: str, message: str):
        raise ConfigError(f"{origins.get(key, 'default')}: key '{key}': {message}")

    for key, (check, valid) in RULES.items():
        value = _get(args, key)
        if value is not _MISSING and not check(value):
            fail(key, f"value {value!r} must be {valid}")

    micro, global_ = _get(args, "train.micro_batch_size"), _get(args, "train.global_batch_size")
    if isinstance(global_, int) and isinstance(micro, int) and global_ % micro:
        below = global_ // micro * micro
        nearest = " or ".join(str(m) for m in (below, below + micro) if m > 0)
        fail(
            "train.global_batch_size",
            f"value {global_} is not a multiple of train.micro_batch_size={micro}; nearest valid: {nearest}",
        )
    workers, prefetch = _get(args, "data.dataloader.num_workers"), _get(args, "data.dataloader.prefetch_factor")
    if prefetch not in (None, _MISSING) and workers == 0:
        fail("data.dataloader.prefetch_factor", "needs data.dataloader.num_workers > 0 (prefetching is per worker)")
    names, sizes = (_get(args, f"train.accelerator.extra_parallel_{k}") for k in ("names", "sizes"))
    if names is not _MISSING and sizes is not _MISSING:
        if len(names) != len(sizes):
            fail(
                "train.accelerator.extra_parallel_sizes",
                f"{list(sizes)} does not match extra_parallel_names {list(names)} (one size per name)",
            )
        if len(set(names)) != len(names):
            fail("train.accelerator.extra_parallel_names", f"{list(names)} repeats a name")
    lora = _get(args, "model.lora")
    if lora is not _MISSING and lora.enable:
        _check_lora(args, lora, fail)


def _check_lora(args, lora, fail) -> None:
    """What PEFT would refuse late (or quietly accept wrongly), said at parse time."""
    targets = lora.target_modules
    if not targets or any(not t.strip() for t in targets):
        fail("model.lora.target_modules", f"{targets!r}: name at least one module (e.g. [q_proj, v_proj])")
    special = [t for t in targets if t == "all-linear" or t.startswith("re:")]
    if special and len(targets) > 1:
        fail("model.lora.target_modules", f"{special[0]!r} must be the only entry, got {targets}")
    if targets[0].startswith("re:"):
        try:
            re.compile(targets[0][3:])
        except re.error as err:
            fail("model.lora.target_modules", f"{targets[0]!r} is not a regular expression: {err}")
    if _get(args, "train.accelerator.tp_size") not in (1, _MISSING):
        fail("model.lora.enable", "LoRA with tensor parallel (tp_size > 1) is not supported; use tp_size 1")


def enable_wandb_on_use(args, origins: Dict[str, str]) -> None:
    """`train.wandb.project` / `name` set in the YAML or on the command line mean "log this run to wandb": they
    turn `train.wandb.enable` on (with a log line), unless `enable` itself was given. Without this, a project
    name alone was silently ignored."""
    wandb = _get(args, "train.wandb")
    named = [k for k in ("train.wandb.project", "train.wandb.name") if k in origins]
    if wandb is _MISSING or not named or "train.wandb.enable" in origins or wandb.enable:
        return
    wandb.enable = True
    origins["train.wandb.enable"] = "turned on by train.wandb.project/name"  # for check_optional_packages
    where = ", ".join(f"{k} ({origins[k]})" for k in named)
    logger.info(
        f"wandb logging on: {where} set (train.wandb.mode={wandb.mode}); --train.wandb.enable false turns it off"
    )


# key that turns the feature on -> (import name, pip install line)
OPTIONAL_PACKAGES = {
    "train.wandb.enable": ("wandb", "pip install wandb (or veomni[logging])"),
    "train.use_tensorboard": ("tensorboard", "pip install tensorboard (or veomni[logging])"),
    "model.lora.enable": ("peft", "pip install peft (or veomni[lora])"),
}


def check_optional_packages(args, origins: Dict[str, str]) -> None:
    """A feature switched on whose package is not installed: one ConfigError naming the key, where it was set and
    the install line, at parse time (the loggers were found missing only after the model was built)."""
    for key, (module, install) in OPTIONAL_PACKAGES.items():
        if _get(args, key) is True and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{origins.get(key, 'default')}: key '{key}': needs the {module} package: {install}")
