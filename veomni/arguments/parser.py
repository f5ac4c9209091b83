"""`parse_args`: dataclass defaults, then a YAML file, then `--group.sub.key value` overrides.

Every value is checked against the field's annotation; a bad key or value raises `ConfigError` naming the key,
where it came from (file:line, or the command line) and what would have been valid.
"""

import dataclasses
import difflib
import os
import sys
import textwrap
import typing
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar

import yaml

from ..utils.logging import get_logger
from .validation import ConfigError, check_optional_packages, enable_wandb_on_use, validate_args

T = TypeVar("T")
logger = get_logger(__name__)


# ------------------------------------------------------------------------------------------ type helpers
def _field_types(cls) -> Dict[str, Any]:
    """Resolved annotations of a dataclass, including string forward references like `"ModelArguments"`."""
    from . import arguments_types

    # each class of the MRO resolves its own annotations in its own module (get_type_hints walks the MRO)
    return typing.get_type_hints(cls, localns=dict(vars(arguments_types)))


def _user_fields(cls) -> List[Tuple[dataclasses.Field, Any]]:
    """The keys of a group (derived `init=False` fields are not keys), each with its resolved type."""
    types = _field_types(cls)
    return [(f, types[f.name]) for f in dataclasses.fields(cls) if f.init]


def _describe(tp) -> str:
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in targs)
    if origin is typing.Union:
        return " or ".join(_describe(a) for a in targs if a is not type(None)) + " or null"
    if origin is list:
        return f"a list of {_describe(targs[0]) if targs else 'values'}"
    return getattr(tp, "__name__", str(tp))


_TRUE, _FALSE = {"true", "yes", "1", "on"}, {"false", "no", "0", "off"}


def _coerce(value: Any, tp, where: str, key: str) -> Any:
    """Convert `value` (from YAML or a CLI string) to the annotated type, or raise naming `where` and `key`."""
    origin, targs = typing.get_origin(tp), typing.get_args(tp)

    def bad():
        return ConfigError(f"{where}: key '{key}': value {value!r} is not {_describe(tp)}")

    if origin is typing.Union:
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in targs:
                return None
            raise bad()
        inner = [a for a in targs if a is not type(None)]
        return _coerce(value, inner[0], where, key) if len(inner) == 1 else value
    if origin is typing.Literal:
        for choice in targs:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise bad()
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            value = yaml.safe_load(text) if text.startswith("[") else [v for v in text.split(",") if v != ""]
        if not isinstance(value, list):
            raise bad()
        item = targs[0] if targs else Any
        return [_coerce(v, item, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # on the command line a YAML/JSON flow mapping: '{media_dir: /data, video_fps: 1}'
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise bad() from None
        if not isinstance(value, dict):
            raise bad()
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad()
    if tp in (int, float):
        number = value
        if isinstance(value, str):
            try:
                number = float(value) if tp is float or any(c in value for c in ".eE") else int(value, 0)
            except ValueError:
                raise bad() from None
        if tp is int and isinstance(number, float) and number.is_integer():  # 1e3, 2.0
            number = int(number)
        if isinstance(number, bool) or not isinstance(number, int if tp is int else (int, float)):
            raise bad()
        return tp(number)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad()
    return value


# --------------------------------------------------------------------------------------------- building
def _all_keys(cls, prefix: str = "") -> List[str]:
    keys = []
    for f, tp in _user_fields(cls):
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            keys.extend(_all_keys(tp, f"{prefix}{f.name}."))
    return keys


def _unknown_key(key: str, where: str, valid: List[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close:  # a misspelt leaf under the right group still deserves a hint
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in valid if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], n=1, cutoff=0.8)][:1]
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"{where}: unknown key '{key}'{hint}")


def _build(cls, values: Dict[str, Any], origins: Dict[str, str], valid: List[str], prefix: str = ""):
    types = {f.name: tp for f, tp in _user_fields(cls)}
    kwargs = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        where = origins.get(path, path)
        if key not in types:
            raise _unknown_key(path, where, valid)
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{path}' is a group of keys, not a value (got {value!r})")
            kwargs[key] = _build(tp, value, origins, valid, path + ".")
        else:
            kwargs[key] = _coerce(value, tp, where, path)
    return cls(**kwargs)


def _set_path(tree: Dict[str, Any], path: str, value: Any) -> None:
    node = tree
    *groups, leaf = path.split(".")
    for g in groups:
        child = node.get(g)
        if not isinstance(child, dict):
            child = node[g] = {}
        node = child
    node[leaf] = value


# ------------------------------------------------------------------------------------------------- YAML
def _load_yaml(path: str) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The YAML mapping and, for every dotted key in it, `file:line` for error messages."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        text = f.read()
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    origins: Dict[str, str] = {}

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                dotted = f"{prefix}{k.value}"
                origins[dotted] = f"{path}:{k.start_mark.line + 1}"
                walk(v, dotted + ".")

    walk(root, "")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of groups (model, data, train)")
    return data, origins


def _parse_cli(tokens: List[str]) -> List[Tuple[str, Any]]:
    """`--key v`, `--key v1 v2` (a list), `--key` (true) and `--key=v` (takes no further values)."""
    overrides = []  # (key, values, closed by `=`)
    for token in tokens:
        if token.startswith("--"):
            key, eq, inline = token[2:].partition("=")
            overrides.append((key, [inline] if eq else [], bool(eq)))
        elif overrides and not overrides[-1][2]:
            overrides[-1][1].append(token)
        else:
            raise ConfigError(f"command line: expected --group.key, got {token!r}")
    return [(key, "true" if not values else values[0] if len(values) == 1 else values) for key, values, _ in overrides]


# ------------------------------------------------------------------------------------------------- help
def _help_lines(cls, prefix: str, only: str) -> List[str]:
    leaves, groups = [], []
    for f, tp in _user_fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            groups.append((path, tp))
        elif not only or path == only or path.startswith(only + "."):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            default = "(required)" if default is dataclasses.MISSING else default
            shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else repr(default)
            head = f"  --{path}  ({_describe(tp)}; default: {shown})"
            doc = f.metadata.get("help", "")
            body = textwrap.wrap(doc, 100, initial_indent=" " * 6, subsequent_indent=" " * 6) if doc else []
            leaves.extend([head, *body])
    lines = []
    if leaves:
        doc = (cls.__doc__ or "").strip()
        doc = "" if doc.startswith(cls.__name__ + "(") else doc.split("\n\n")[0].replace("\n", " ")  # dataclass's own
        lines += ["", prefix.rstrip(".") + ":" + (f"  {doc}" if doc else ""), *leaves]
    for path, sub in groups:
        inside = only == path or only.startswith(path + ".")  # the request is this group or below it
        if not only or inside or path.startswith(only + "."):
            lines += _help_lines(sub, path + ".", only if inside else "")
    return lines


def format_help(root_class, only: str = "", prog: str = "TASK.py") -> str:
    """Every key of every group with its type, default and doc (from the field metadata where the key is
    defined), grouped; `only` narrows to a group (`train.optimizer`) or one key."""
    only = only.strip(".")
    valid = _all_keys(root_class)
    if only and only not in valid:
        raise _unknown_key(only, "--help", valid)
    header = [
        f"usage: {prog} [CONFIG.yaml] [--group.key value ...] [--help [GROUP]]",
        "",
        "Values: command line over CONFIG.yaml over the defaults below. Lists: `--key a b c` or `--key a,b,c`;",
        "booleans: true/false; null/none for an optional value. `--help train.optimizer` shows one group.",
    ]
    return "\n".join(header + _help_lines(root_class, "", only)) + "\n"


def _help_request(argv: List[str]) -> Optional[str]:
    """The group asked for by `--help [GROUP]` / `-h` / `--help=GROUP` ("" for all), or None."""
    for i, token in enumerate(argv):
        if token in ("-h", "--help"):
            following = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if following.startswith("-") or following.endswith((".yaml", ".yml")) else following
        if token.startswith("--help="):
            return token.split("=", 1)[1]
    return None


def parse_args(root_class: Type[T], argv: Optional[List[str]] = None) -> T:
    """Build `root_class` from `[config.yaml] [--group.key value ...]` (default: sys.argv[1:]).

    Precedence: command line over YAML over dataclass defaults. Derived sizes (dp_size, dataloader_batch_size)
    are resolved against WORLD_SIZE. `--help [GROUP]` prints every key with its type, default and doc, and exits.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = _help_request(argv)
    if wanted is not None:
        sys.stdout.write(format_help(root_class, wanted, os.path.basename(sys.argv[0]) or "TASK.py"))
        sys.exit(0)
    tree: Dict[str, Any] = {}
    origins: Dict[str, str] = {}
    if argv and not argv[0].startswith("--"):
        tree, origins = _load_yaml(argv.pop(0))
    valid = _all_keys(root_class)
    for key, value in _parse_cli(argv):
        if key not in valid:
            raise _unknown_key(key, "command line", valid)
        _set_path(tree, key, value)
        origins[key] = "command line"
    _model_path_wins(tree, origins)
    args = _build(root_class, tree, origins, valid)
    validate_args(args, origins)  # ranges of numeric keys, before anything is built
    enable_wandb_on_use(args, origins)
    check_optional_packages(args, origins)  # a missing logger said now, not after the model is built
    if hasattr(getattr(args, "train", None), "resolve"):
        args.train.resolve(int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
    return args


def _model_path_wins(tree: Dict[str, Any], origins: Dict[str, str]) -> None:
    """`--model.model_path` on the command line beats the YAML's `model.config_path` (and `tokenizer_path`):
    a user fine-tuning an HF folder with a from-scratch YAML means that folder's config, not the YAML's."""
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    if origins.get("model.model_path") != "command line" or not model.get("model_path"):
        return
    for key in ("config_path", "tokenizer_path"):
        dotted = f"model.{key}"
        if model.get(key) and origins.get(dotted) != "command line":
            logger.info(
                f"{dotted}={model[key]} ({origins.get(dotted)}) is replaced by --model.model_path="
                f"{model['model_path']}: the command line wins over the YAML (pass --{dotted} to keep another)"
            )
            del model[key]
            origins.pop(dotted, None)


def save_args(args, output_dir: str, name: str = "veomni_config.yaml") -> str:
    """Write the fully resolved configuration next to the outputs, so every run is reproducible."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, name)
    with open(path, "w") as f:
        yaml.safe_dump(dataclasses.asdict(args), f, sort_keys=False)
    return path
