"""Reading HF checkpoints (safetensors, or PyTorch `.bin` with `weights_only=True`; one file or a sharded index) as
a model's tensors, with transformers' own key renames and conversions (veomni/models/hf_conversion.py).

Everything a checkpoint can get wrong is found from its headers before a tensor is read: a key the model does not
have, a model tensor no key provides, a shape or dtype that does not fit. Tensors are then read one group at a time
(a rank may read just its slice of a renamed tensor), so memory stays one group, never the model.
"""

import collections
import contextlib
import itertools
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from torch import nn

from ..compat.torch import parameter_slots
from ..compat.transformers import keys_to_ignore_on_load_unexpected
from ..utils.hub import first_line
from ..utils.logging import get_logger
from .hf_conversion import TensorGroup, convert_group, plan_load, plan_save
from .placement import copy_into, tied_sources

logger = get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# PyTorch pickle weights (older HF folders): read only with `torch.load(weights_only=True)`, which refuses any
# callable a crafted file could name; safetensors (no code at all) are preferred whenever both are present.
BIN_SINGLE_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_NON_FLOAT_SAFETENSORS = ("I", "U", "BOOL")  # safetensors dtype names of integer and boolean tensors
# safetensors' dtype names of the torch dtypes (a name torch lacks, e.g. F4, gives no dtype: is_float only)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
READ_AHEAD = 4  # threads reading the next tensor groups while one is placed (transformers' loader uses 4 too)


class WeightsMismatchError(ValueError):
    """A checkpoint that does not fit the model (a key too many or too few, a shape or dtype): said in one line."""


class UnreadableWeightsError(ValueError):
    """A weight file or index that cannot be read as it claims (cut short, a bad header, an entry outside its
    folder): said in one line naming the file."""


def _index(path: str) -> Dict[str, str]:
    """An index's weight map; an entry naming a file outside the index's folder is refused (never opened)."""
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise UnreadableWeightsError(f"{path}: not a weight index ({type(err).__name__}: {err})") from err
    folder = os.path.normpath(os.path.abspath(os.path.dirname(path)))
    for key, file in weight_map.items():  # by name: the hub cache's shards are links into its blob store
        inside = isinstance(file, str) and not os.path.isabs(file)
        if not inside or not os.path.normpath(os.path.join(folder, file)).startswith(folder + os.sep):
            raise UnreadableWeightsError(
                f"{path}: '{key}' is listed in {file!r}, which is not a file of this folder; refusing to open it"
            )
    return weight_map


def safetensors_files(weights_path: str) -> List[str]:
    """The weight files of a checkpoint folder (or the single file given), in a stable order: safetensors, or
    else PyTorch `.bin` files (loaded with `weights_only=True`)."""
    if os.path.isfile(weights_path):
        return [weights_path]
    # unindexed shards: any *.safetensors, but only pytorch_model*.bin (not e.g. a Trainer's training_args.bin)
    formats = (
        (INDEX_FILE, SINGLE_FILE, "", ".safetensors"),
        (BIN_INDEX_FILE, BIN_SINGLE_FILE, "pytorch_model", ".bin"),
    )
    names = sorted(os.listdir(weights_path)) if os.path.isdir(weights_path) else []
    for index, single, prefix, suffix in formats:
        if os.path.isfile(os.path.join(weights_path, single)):  # before the index, as from_pretrained looks
            return [os.path.join(weights_path, single)]
        if os.path.isfile(os.path.join(weights_path, index)):
            return [
                os.path.join(weights_path, name)
                for name in sorted(set(_index(os.path.join(weights_path, index)).values()))
            ]
        found = [f for f in names if f.startswith(prefix) and f.endswith(suffix)]
        if found:
            return [os.path.join(weights_path, f) for f in found]
    raise FileNotFoundError(
        f"no weights in {weights_path} (looked for {INDEX_FILE}, {SINGLE_FILE}, {BIN_INDEX_FILE}, {BIN_SINGLE_FILE})"
    )


def load_pickled_weights(path: str) -> Dict[str, torch.Tensor]:
    """A PyTorch `.bin`/`.pt` state dict, unpickled with `weights_only=True`: tensors and plain containers only,
    so a crafted file cannot run code. The error names the file."""
    try:
        try:  # mapped, not read: the header pass and each group's reads touch only the tensors they need
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (pre-zip) file cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{path}: refused or unreadable PyTorch weights (loaded with weights_only=True, which allows tensors "
            f"only; convert the checkpoint to safetensors if it is yours): {type(err).__name__}: {err}"
        ) from err
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    return state


class CheckpointFiles:
    """A checkpoint's keys, the file of each and its shape and dtype (from the safetensors headers), and reads of one
    tensor or a slice of it. Use as a context manager: file handles stay open until it closes."""

    def __init__(self, weights_path: str):
        self.path = weights_path
        self.files = safetensors_files(weights_path)
        self.file_of: Dict[str, str] = {}
        self.shape: Dict[str, Tuple[int, ...]] = {}
        self.is_float: Dict[str, bool] = {}
        self.dtype: Dict[str, Optional[torch.dtype]] = {}
        self._handles: Dict[str, object] = {}
        self._pickled: Tuple[Optional[str], Dict[str, torch.Tensor]] = (None, {})
        self._lock = threading.Lock()  # reads come from several threads: opening files and `.bin` shards is serial
        for path in self.files:
            for key, shape, dtype, is_float in self._header(path):
                if key in self.file_of:
                    raise WeightsMismatchError(f"{path}: key '{key}' is also in {self.file_of[key]}")
                self.file_of[key], self.shape[key], self.dtype[key], self.is_float[key] = path, shape, dtype, is_float
        self._check_index()

    def _header(self, path: str):
        if path.endswith(_PICKLE_SUFFIXES):
            for key, tensor in self._pickled_file(path).items():
                yield key, tuple(tensor.shape), tensor.dtype, tensor.is_floating_point()
            return
        handle = self._handle(path)
        for key in handle.keys():
            view = handle.get_slice(key)
            kind = view.get_dtype()  # safetensors' name, e.g. "BF16"
            shape = tuple(view.get_shape())
            yield key, shape, SAFETENSORS_DTYPES.get(kind), not kind.startswith(_NON_FLOAT_SAFETENSORS)

    def _check_index(self) -> None:
        for index in (INDEX_FILE, BIN_INDEX_FILE):
            path = os.path.join(self.path, index) if os.path.isdir(self.path) else ""
            if os.path.isfile(path) and not any(f.endswith((SINGLE_FILE, BIN_SINGLE_FILE)) for f in self.files):
                for key, file in _index(path).items():
                    if key not in self.file_of:
                        raise WeightsMismatchError(f"{path}: lists '{key}' in {file}, which does not hold it")
                return

    def _handle(self, path: str):
        with self._lock:
            if path not in self._handles:
                try:
                    self._handles[path] = safe_open(path, framework="pt", device="cpu")
                except Exception as err:  # safetensors names no file: a cut-short file, an absurd header
                    raise UnreadableWeightsError(_unreadable(path, err)) from err
            return self._handles[path]

    def _pickled_file(self, path: str) -> Dict[str, torch.Tensor]:
        with self._lock:
            if self._pickled[0] != path:  # one `.bin` shard in memory at a time
                self._pickled = (path, load_pickled_weights(path))
            return self._pickled[1]

    def keys(self) -> List[str]:
        return list(self.file_of)

    def read(self, key: str, index: Optional[Tuple[slice, ...]] = None) -> torch.Tensor:
        """The tensor `key`, or only `tensor[index]` (read from disk as just that slice)."""
        path = self.file_of[key]
        if path.endswith(_PICKLE_SUFFIXES):
            tensor = self._pickled_file(path)[key]
            return tensor[index] if index is not None else tensor
        try:
            if index is None:
                return self._handle(path).get_tensor(key)
            return self._handle(path).get_slice(key)[index]
        except UnreadableWeightsError:
            raise
        except Exception as err:  # the file changed under us since its header was read
            raise UnreadableWeightsError(_unreadable(path, err, key)) from err

    def neighbours(self, key: str) -> List[str]:
        """The files holding keys of `key`'s module (where a missing `key` would be expected)."""
        parent = key.rsplit(".", 2)[0] + "."
        return sorted({os.path.basename(f) for k, f in self.file_of.items() if k.startswith(parent)})

    def release(self, path: str) -> None:
        """Done with `path`: unmap it (its pages stop counting in this process's memory)."""
        with self._lock:
            self._handles.pop(path, None)
            if self._pickled[0] == path:
                self._pickled = (None, {})

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # the files are closed
        self._handles.clear()
        self._pickled = (None, {})


def _unreadable(path: str, err: BaseException, key: Optional[str] = None) -> str:
    what = f"reading '{key}': " if key else ""
    return f"{path}: not a readable safetensors file ({what}{first_line(err)}; {os.path.getsize(path)} bytes): damaged or cut short"


def iter_safetensors(weights_path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield a checkpoint's `(key, tensor)` as stored, file by file: memory is one tensor (one `.bin` shard)."""
    with CheckpointFiles(weights_path) as files:
        for key in files.keys():
            yield key, files.read(key)


@contextlib.contextmanager
def init_empty_weights():
    """Build parameters on the meta device but keep buffers real (RoPE `inv_freq` stays correct)."""
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:  # a meta param re-registered (weight tying) stays the same object
            slots = parameter_slots(module)
            slots[name] = nn.Parameter(slots[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def ignored_unexpected(model: nn.Module) -> Optional["re.Pattern"]:
    """Checkpoint keys `from_pretrained` drops without a word (`_adjust_missing_and_unexpected_keys`): the model's
    `_keys_to_ignore_on_load_unexpected` (an MTP head, an Omni talker), old per-layer `rotary_emb.inv_freq`, and
    `position_ids` buffers."""
    patterns = set(keys_to_ignore_on_load_unexpected(model))
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def num_experts_of(config) -> Optional[int]:
    for source in (config, getattr(config, "text_config", None), getattr(config, "thinker_config", None)):
        for name in ("num_experts", "n_routed_experts", "num_local_experts"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def _shape_error(source: str, name: str, got: Sequence[int], want: Sequence[int], model: nn.Module) -> Exception:
    got, want = tuple(got), tuple(want)
    message = f"{source}: '{name}' has shape {got}, the model expects {want}"
    is_vocab = name.endswith(("embed_tokens.weight", "lm_head.weight")) and got[1:] == want[1:] and got[:1] != want[:1]
    if is_vocab:
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        message += (
            f": the checkpoint's vocabulary has {got[0]} rows and the model's config says vocab_size="
            f"{getattr(text, 'vocab_size', want[0])}; build the model from the checkpoint's own config.json"
        )
    return WeightsMismatchError(message)


class ModelWeights:
    """A checkpoint read as `model`'s tensors (names, shapes and dtypes checked against `model` up front).

    `model` may be on meta, sharded (FSDP2 / TP / EP DTensors) or real: only its names, shapes and dtypes are used.
    A full Omni checkpoint loads into its thinker: the speech-output parts (talker, token2wav) are skipped, said once.
    """

    def __init__(self, weights_path: str, model: nn.Module):
        self.path, self.model = weights_path, model
        self.files = CheckpointFiles(weights_path)
        state = model.state_dict()
        self.expected = {name: (tuple(t.shape), t.is_floating_point()) for name, t in state.items()}
        sources = tied_sources(model)
        tied = set(sources)
        plan = plan_load(model, self.files.keys(), state.keys())
        ignore = ignored_unexpected(model)
        if ignore is not None:
            plan.unexpected = [(k, n) for k, n in plan.unexpected if not (ignore.search(k) or ignore.search(n))]
        # tying as `from_pretrained` does it: a checkpoint holding only the tied name (lm_head) feeds its source;
        # one holding both with different values is refused (transformers unties them; this model is built tied)
        by_target = {t: g for g in plan.groups for t in g.targets()}
        self.tie_checks: Dict[str, str] = {}
        for name, source in sources.items():
            group = by_target.get(name)
            if group is None or not group.is_rename:
                continue
            if source not in by_target:
                group.target = source
            else:
                self.tie_checks[name] = source
        self.groups = [g for g in plan.groups if not set(g.targets()) <= tied or g.target in self.tie_checks]
        if plan.unexpected:
            key, renamed = plan.unexpected[0]
            hint = "" if key == renamed else f" (renamed by transformers' rules to '{renamed}')"
            raise WeightsMismatchError(
                f"{self.files.file_of[key]}: checkpoint key '{key}'{hint} matches no parameter of "
                f"{type(model).__name__}"
                + (f", nor do {len(plan.unexpected) - 1} more" if len(plan.unexpected) > 1 else "")
            )
        if plan.skipped:
            logger.info(f"{weights_path}: skipped {len(plan.skipped)} tensors of the Omni speech output (talker etc.)")
        provided = {target for group in self.groups for target in group.targets()} | set(self.tie_checks.values())
        missing = [n for n in state if n not in provided and n not in tied]  # (no non-persistent buffer in state)
        if missing:
            raise WeightsMismatchError(self._missing_message(missing))
        for group in self.groups:
            counts = {pattern: len(keys) for pattern, keys in group.sources.items()}
            if len(set(counts.values())) > 1:
                raise WeightsMismatchError(
                    f"{self.files.file_of[group.keys[0]]}: '{group.target}' is converted from {counts} checkpoint keys "
                    "per pattern; each pattern needs as many (one per expert)"
                )
            if group.is_rename:
                (key,) = group.keys
                self._check(group.target, self.files.shape[key], self.files.is_float[key], self.files.file_of[key])

    def _missing_message(self, missing: List[str]) -> str:
        name = missing[0]
        (hub,) = plan_save(self.model, [name])
        where = self.files.neighbours(hub.target)
        place = f"expected beside its module's other tensors in {', '.join(where)}" if where else "its module has none"
        more = ""
        if len(missing) > 1:
            more = f" ({len(missing) - 1} more missing: {missing[1:4]}{' ...' if len(missing) > 4 else ''})"
        return f"{self.path}: no tensor for the model's '{name}' (checkpoint name '{hub.target}'; {place}){more}"

    def _check(self, name: str, shape: Sequence[int], is_float: bool, source: str) -> None:
        if name not in self.expected:
            raise WeightsMismatchError(f"{source}: converts to '{name}', which the model does not have")
        want_shape, want_float = self.expected[name]
        if tuple(shape) != want_shape:
            raise _shape_error(source, name, shape, want_shape, self.model)
        if is_float != want_float:
            kinds = ("floating point", "integer") if is_float else ("integer", "floating point")
            raise WeightsMismatchError(f"{source}: '{name}' is {kinds[0]} in the checkpoint, {kinds[1]} in the model")

    def _read(self, group: TensorGroup, local_index, unread: collections.Counter):
        index = local_index(group.target) if group.is_rename and local_index is not None else None
        sources = {key: self.files.read(key, index) for key in group.keys}
        for key in group.keys:
            path = self.files.file_of[key]
            with self.files._lock:
                unread[path] -= 1
                done = unread[path] == 0
            if done:
                self.files.release(path)
        return sources, index

    def tensors(
        self, local_index: Optional[Callable[[str], Optional[Tuple[slice, ...]]]] = None
    ) -> Iterator[Tuple[str, torch.Tensor, bool]]:
        """Yield `(model name, tensor, is_local_slice)`, a group at a time in file order. `local_index(name)` may
        give the slice of a tensor this rank keeps: a tensor that is only renamed is then read as just that.
        `READ_AHEAD` threads read the next groups while this one is converted and placed (reading is page faults
        and copies out of the mapped files, which release the GIL); at most that many groups wait in memory."""
        order = {path: i for i, path in enumerate(self.files.files)}
        groups = sorted(self.groups, key=lambda g: order[self.files.file_of[g.keys[0]]])
        unread = collections.Counter(self.files.file_of[key] for group in self.groups for key in group.keys)
        held: Dict[str, torch.Tensor] = {}  # one side of a tied pair until the other arrives

        def tie_check(name: str, tensor: torch.Tensor) -> None:
            pair = self.tie_checks.get(name) or next((t for t, s in self.tie_checks.items() if s == name), None)
            if pair is None:
                return
            other = held.pop(pair, None)
            if other is None:
                held[name] = tensor
            elif not torch.equal(other, tensor):
                tied_name = name if name in self.tie_checks else pair
                raise WeightsMismatchError(
                    f"{self.path}: the config ties '{tied_name}' to '{self.tie_checks[tied_name]}' but the checkpoint "
                    "holds both with different values (transformers then unties them): set tie_word_embeddings=false"
                )

        with self.files, ThreadPoolExecutor(READ_AHEAD) as pool:
            reads = ((group, pool.submit(self._read, group, local_index, unread)) for group in groups)
            pending = collections.deque(itertools.islice(reads, READ_AHEAD))
            while pending:
                group, future = pending.popleft()
                sources, index = future.result()
                pending.extend(itertools.islice(reads, 1))  # the next group's read starts
                if group.is_rename:
                    tie_check(group.target, sources[group.keys[0]])
                    if group.target not in self.tie_checks:
                        yield group.target, sources[group.keys[0]], index is not None
                    continue
                source = f"{self.files.file_of[group.keys[0]]} ({len(group.keys)} tensors from '{group.keys[0]}')"
                try:
                    produced = convert_group(group, sources, self.model)
                except (RuntimeError, ValueError) as err:  # e.g. one expert of another shape, one expert missing
                    raise WeightsMismatchError(
                        f"{source}: do not convert to '{group.target}': {first_line(err)}"
                    ) from err
                for name, tensor in produced.items():
                    self._check(name, tensor.shape, tensor.is_floating_point(), source)
                    yield name, tensor, False


def load_weights(model: nn.Module, weights_path: str) -> None:
    """Copy a checkpoint into a materialised (non-meta, non-sharded) model, exactly as `from_pretrained` would."""
    copy_into(model, ModelWeights(weights_path, model).tensors(), weights_path)
