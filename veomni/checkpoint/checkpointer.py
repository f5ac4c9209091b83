"""Checkpoints that never lose a run: DCP for model and optimizer tensors, plain files for the rest, published
atomically.

Layout under `<output_dir>/checkpoints/`:
    global_step_N/model_optimizer/     DCP shards (tensors only: any world size can load them)
    global_step_N/extra_state/rank_R.pt  scheduler, dataloader, RNG, trainer state (torch.load weights_only)
    global_step_N/checksums.json       CRC-32 of every file, computed as it was written (integrity.py)
    global_step_N/meta.json            step, world and data-parallel sizes, that it has checksums, a LoRA run's
                                       base model (lora_state.py); written last inside the folder
    latest                             name of the newest complete checkpoint, replaced atomically
A save is written to `global_step_N.tmp` and renamed only when every rank has finished, so a crash mid-save
leaves the previous checkpoint as the newest complete one. A folder being replaced or retired is renamed out of the
`global_step_N` names first and deleted after: a crash midway never leaves a half-deleted `global_step_N`.
"""

import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..optim.multi_optimizer import named_optimizers
from ..utils.collectives import on_rank0
from ..utils.hub import first_line
from ..utils.logging import get_logger
from .integrity import CHECKSUMS, ChecksumsError, checksumming_writer, misfit, verify_checksums, write_checksums
from .lora_state import BASE, BaseRecords, lora_base, trained_state
from .safe_reader import SafeFileSystemReader, load_tensor_file

logger = get_logger(__name__)

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


# ----------------------------------------------------------------------------------------------- discovery
def list_checkpoints(root: str) -> List[int]:
    """Steps of the complete checkpoints under `root` (a folder with meta.json), ascending."""
    if not os.path.isdir(root):
        return []
    names = [name for name in os.listdir(root) if os.path.isfile(os.path.join(root, name, "meta.json"))]
    return sorted(step for step in map(checkpoint_step, names) if step is not None)


def checkpoint_step(path: str) -> Optional[int]:
    """N of a `global_step_N` checkpoint folder (None for another name)."""
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def resolve_checkpoint(load_path: Optional[str], output_dir: str) -> Optional[str]:
    """`auto`: the newest complete checkpoint of this run (None if there is none); a path: that checkpoint."""
    if not load_path:
        return None
    if load_path != "auto":
        if not os.path.isfile(os.path.join(load_path, "meta.json")):
            raise FileNotFoundError(
                f"train.checkpoint.load_path={load_path} is not a complete checkpoint (no meta.json)"
            )
        return load_path
    root = os.path.join(output_dir, "checkpoints")
    latest = os.path.join(root, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        candidate = os.path.join(root, name)
        if _STEP_DIR.match(name) and os.path.isfile(os.path.join(candidate, "meta.json")):  # never a path elsewhere
            return candidate
    steps = list_checkpoints(root)
    return os.path.join(root, f"global_step_{steps[-1]}") if steps else None


def check_shared_storage(folder: str, patience_s: float = 10.0) -> None:
    """Raise on every rank unless every rank sees the files rank 0 writes under `folder`.

    A DCP checkpoint is one folder that all ranks write into and that rank 0 publishes (renames); on per-node
    disks the other nodes' shards would never be published and a resume could not find them. Collective: call on
    all ranks. Waits up to `patience_s` for a network filesystem to show rank 0's file."""
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = os.path.join(folder, ".shared_storage_probe")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        _write_atomic(probe, token[0])
    dist.barrier()

    def sees_token() -> bool:
        with contextlib.suppress(OSError), open(probe) as f:  # not there yet: False
            return f.read() == token[0]
        return False

    deadline = time.monotonic() + patience_s
    while not (seen := sees_token()) and time.monotonic() <= deadline:
        time.sleep(0.2)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seen, os.uname().nodename))
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(everyone) if not ok]
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(probe)
    if blind:
        raise RuntimeError(
            f"checkpoint folder {folder} is not shared: {', '.join(blind)} cannot see the files rank 0 writes "
            "there (per-node disks?). A checkpoint must be written to one filesystem that every rank sees "
            "(NFS, Lustre, ...): set train.checkpoint.output_dir to such a path."
        )


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the folder, the file and the way out."""


def _previous_good(path: str) -> str:
    """How to fall back from the checkpoint at `path`: the newest complete one before it, if any."""
    root, step = os.path.dirname(os.path.normpath(path)), checkpoint_step(path)
    older = [s for s in list_checkpoints(root) if step is None or s < step]
    if not older:
        return "there is no earlier complete checkpoint"
    previous = os.path.join(root, f"global_step_{older[-1]}")
    return (
        f"the previous complete checkpoint is {previous}: resume from it with --train.checkpoint.load_path {previous}"
    )


def _damaged(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is damaged: {what}; {_previous_good(path)}")


def _check_shards(path: str, reader) -> None:
    """Every file the DCP metadata points to exists and is long enough (a crash or a full disk truncates)."""
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as err:  # the allow-list's refusals included
        file = os.path.join(path, "model_optimizer", ".metadata")
        raise _damaged(path, f"{file}: {err}") from err
    needed: Dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, "model_optimizer", name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            state = "is missing" if have is None else f"is truncated ({have} of {size} bytes)"
            raise _damaged(path, f"{file} {state}")


@contextlib.contextmanager
def _failing_save(tmp: str) -> Iterator[None]:
    """A failed save (disk full, permissions, a torn write) raises CheckpointError naming the cause; its
    half-written folder, which only takes space, is deleted."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as err:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failure(err, tmp) from err


def _save_failure(err: BaseException, folder: str) -> CheckpointError:
    """Name the folder and the cause; torch.save reports a full disk as `unexpected pos N vs M`."""
    chain, pending = [], [err]
    while pending and len(chain) < 16:
        cause = pending.pop(0)
        chain.append(cause)
        # DCP wraps each rank's failure in CheckpointException.failures: {rank: (exception, traceback)}
        pending += [pair[0] for pair in getattr(cause, "failures", {}).values()]
        nxt = cause.__cause__ or cause.__context__
        if nxt is not None:
            pending.append(nxt)
    text = " ".join(str(c) for c in chain)
    full = any(getattr(c, "errno", None) == errno.ENOSPC for c in chain) or "No space left" in text
    # torch's zip writer reports a short write (a full disk, a quota) only as `unexpected pos N vs M`
    if full or "unexpected pos" in text:
        where = next((c.filename for c in chain if getattr(c, "filename", None)), None)
        why = "the disk is full (ENOSPC" + (f" writing {where}" if where else "") + ")"
        if not full:
            why = "a write was cut short, most likely a full disk or quota (torch: 'unexpected pos')"
        existing = os.path.dirname(os.path.abspath(folder))
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        with contextlib.suppress(OSError):  # the free space is a hint: a failure to read it loses only that
            why += f"; {shutil.disk_usage(existing).free / 2**20:.1f} MiB free there" + _last_checkpoint_size(folder)
    else:  # the first failure that is not DCP's wrapper, which names only the ranks
        cause = next((c for c in chain if type(c).__name__ != "CheckpointException"), err)
        why = f"{type(cause).__name__}: {first_line(cause)}"
    return CheckpointError(f"saving checkpoint {folder} failed: {why}; the previous checkpoint is left as it was")


def _last_checkpoint_size(folder: str) -> str:
    """`, a checkpoint takes X MiB` from the newest complete checkpoint beside `folder`, if any."""
    root = os.path.dirname(os.path.normpath(folder))
    steps = list_checkpoints(root)
    if not steps:
        return ""
    total = sum(p.stat().st_size for p in Path(root, f"global_step_{steps[-1]}").rglob("*") if p.is_file())
    return f", a checkpoint takes {total / 2**20:.1f} MiB"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    """Saves and loads training state; every method is called on every rank."""

    def __init__(self, output_dir: str, save_total_limit: int = 0, async_save: bool = False):
        self.root = os.path.join(output_dir, "checkpoints")
        self.save_total_limit, self.async_save = save_total_limit, async_save
        self._pending = None  # (future, tmp, final, meta, CRCs written) of an async save not yet published
        self._async_group = None
        self._storage_checked = False  # every rank sees rank 0's files (checked collectively at the first save)
        self.storage_patience_s = 10.0  # how long a network filesystem may take to show rank 0's probe file
        self._warned_abandoned = False  # checkpoints numbered after this run's saves were reported once
        self._base_records = BaseRecords()  # a LoRA run's base model, checksummed once
        self.protected_steps = set()  # kept whatever save_total_limit says (train.checkpoint.keep_best)

    # ------------------------------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        model,
        optimizer,
        extra_state: Dict[str, Any],
        meta: Dict[str, Any],
        attach: Optional[Callable[[str], None]] = None,
    ) -> str:
        """`attach(folder)` runs on rank 0 before publishing, to add files (e.g. the HF config) to the checkpoint."""
        self.wait()
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = final + ".tmp"

        def prepare():
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save
            os.makedirs(os.path.join(tmp, "extra_state"))
            if attach is not None:
                attach(tmp)

        with _failing_save(tmp):
            on_rank0(prepare)  # a failure there ends every rank at once, not in a barrier
            if not self._storage_checked:
                check_shared_storage(tmp, self.storage_patience_s)
                self._storage_checked = True
            os.makedirs(os.path.join(tmp, "extra_state"), exist_ok=True)  # never rely on another rank's mkdir
            base = lora_base(model)
            state, _ = _state(model, optimizer, adapters_only=base is not None)
            extra_file = os.path.join("extra_state", f"rank_{dist.get_rank()}.pt")
            written = {extra_file: _save_small(extra_state, os.path.join(tmp, extra_file))}  # CRC-32s as written
            meta = dict(meta, step=step, world_size=dist.get_world_size(), checksums=CHECKSUMS)
            if base is not None:
                meta[BASE] = self._base_records(base)
            folder = os.path.join(tmp, "model_optimizer")
            writer = checksumming_writer(folder, tmp, written)
            if self.async_save:
                if self._async_group is None:  # DCP's async save must not share the training collectives
                    self._async_group = dist.new_group(backend="gloo")
                group = self._async_group
                future = dcp.async_save(state, checkpoint_id=folder, storage_writer=writer, process_group=group)
                self._pending = (future, tmp, final, meta, written)
            else:
                dcp.save(state, checkpoint_id=folder, storage_writer=writer)
                self._publish(tmp, final, meta, written)
        return final

    def wait(self) -> None:
        """Finish and publish an async save still in flight."""
        if self._pending is None:
            return
        future, tmp, final, meta, written = self._pending
        self._pending = None
        with _failing_save(tmp):
            future.result()
        self._publish(tmp, final, meta, written)

    def _publish(self, tmp: str, final: str, meta: Dict[str, Any], written: Dict[str, int]) -> None:
        dist.barrier()  # every rank's shards and extra state are on disk
        write_checksums(tmp, written)  # (collective: the CRCs each rank computed while writing)

        def publish():
            _write_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
            _rename_into_place(tmp, final)  # re-saving a step (after a resume): the new one wins
            _write_atomic(os.path.join(self.root, "latest"), os.path.basename(final))
            self._retire_old(meta["step"])
            logger.info(f"saved checkpoint {final}")

        on_rank0(publish)

    def _retire_old(self, saved_step: int) -> None:
        """Keep the `save_total_limit` newest checkpoints of this run's timeline: those up to the one just saved.

        Steps only grow within a run, so a folder numbered after the checkpoint just saved belongs to a timeline
        this run abandoned (it resumed from an older checkpoint by an explicit load_path): it neither counts
        against the limit (which would retire the new checkpoints first) nor is deleted here; this run replaces
        it when it saves that step itself."""
        if self.save_total_limit <= 0:
            return
        steps = list_checkpoints(self.root)
        mine = [s for s in steps if s <= saved_step]
        abandoned = [s for s in steps if s > saved_step]
        if abandoned and not self._warned_abandoned:
            self._warned_abandoned = True
            logger.warning(
                f"checkpoints of steps {abandoned} in {self.root} come after this run's step {saved_step} (an "
                "abandoned timeline): kept, not counted by save_total_limit; this run replaces each when it saves "
                "that step"
            )
        for step in [s for s in mine if s not in self.protected_steps][: -self.save_total_limit]:
            _delete(os.path.join(self.root, f"global_step_{step}"))
        for name in os.listdir(self.root):  # what a crash left while deleting
            if name.endswith(_DELETING):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # ------------------------------------------------------------------------------------------ load
    def _continue_from(self, path: str) -> None:
        """A checkpoint of this output_dir that a run resumes from becomes `latest` (rank 0): resuming an older one
        by an explicit load_path starts a new timeline, and a crash before its first save must bring `auto` back
        here, not to the newer checkpoints of the timeline it abandoned."""
        here = os.path.dirname(os.path.realpath(path)) == os.path.realpath(self.root)
        if here and dist.get_rank() == 0:
            _write_atomic(os.path.join(self.root, "latest"), os.path.basename(os.path.normpath(path)))

    def _check_base(self, path: str, meta: Dict[str, Any], model) -> None:
        """A checkpoint holding only LoRA adapters resumes only over the base model it was trained on."""
        if BASE not in meta:
            return
        reason = self._base_records.mismatch(meta[BASE], lora_base(model))  # collective
        if reason:
            raise CheckpointError(
                f"checkpoint {path} holds LoRA adapters, not their base model: {reason}. Resume with that base "
                "(model.model_path), or start a new run (another train.checkpoint.output_dir)"
            )

    def load(self, path: str, model, optimizer) -> Dict[str, Any]:
        """Restore model and optimizer in place (any world size); return meta and every rank's extra state."""
        meta = _read_meta(path)
        self._check_base(path, meta, model)
        state, param_groups = _state(model, optimizer, adapters_only=BASE in meta)
        reader = SafeFileSystemReader(os.path.join(path, "model_optimizer"))
        _check_shards(path, reader)
        try:
            verify_checksums(path, required=bool(meta.get("checksums")))  # collective, before any load
        except ChecksumsError as err:
            raise _damaged(path, str(err)) from err
        reason = misfit(state, reader.read_metadata().state_dict_metadata)
        if reason:
            raise CheckpointError(
                f"checkpoint {path} was saved by a run with another model or optimizer: {reason}. Resume it with the "
                "model and optimizer settings it was saved with (its run's veomni_config.yaml), or start a new run "
                "(another train.checkpoint.output_dir, or --train.checkpoint.overwrite true)"
            )
        try:
            dcp.load(state, checkpoint_id=os.path.join(path, "model_optimizer"), storage_reader=reader)
        except (OSError, RuntimeError, EOFError, ValueError, CheckpointException) as err:
            inner = next(iter(getattr(err, "failures", {}).values()), (err,))[0]  # DCP wraps per-rank failures
            first = f"{type(inner).__name__}: {first_line(inner)}"
            raise CheckpointError(f"checkpoint {path} could not be read ({first}); {_previous_good(path)}") from err
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=BASE not in meta))  # adapters
        for name, opt in named_optimizers(optimizer).items():
            set_optimizer_state_dict(model, opt, {"state": state[f"optim.{name}"], "param_groups": param_groups[name]})
        self._continue_from(path)
        extra = ExtraStates(path, meta["world_size"])  # read on demand: a same-size resume reads one file per rank
        logger.info(f"resumed from {path} (saved at step {meta['step']} by {meta['world_size']} ranks)")
        return {"meta": meta, "extra_states": extra}


def _state(model, optimizer, adapters_only: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """What DCP saves and loads: the model's tensors (a LoRA run's adapters only) and each optimizer's state (also
    materialising an empty Adam state to load into); and each optimizer's param_groups, kept out of DCP."""
    model_state = get_model_state_dict(model)
    state = {"model": trained_state(model_state) if adapters_only else model_state}
    param_groups = {}
    for name, opt in named_optimizers(optimizer).items():
        full = get_optimizer_state_dict(model, opt)
        state[f"optim.{name}"], param_groups[name] = full["state"], full["param_groups"]
    return state, param_groups


def _save_small(obj: Any, file: str) -> int:
    """torch.save through memory: a failed write then raises OSError with its errno and file name (ENOSPC),
    where torch's own writer only says `unexpected pos N vs M`. Returns the CRC-32 of the bytes written."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        with open(file, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # a failed write() carries no file name of its own
        raise OSError(err.errno, err.strerror, file) from err
    return zlib.crc32(buffer.getbuffer())


_DELETING = ".deleting"


def _delete(folder: str) -> None:
    """Out of the checkpoint names first (one rename), then deleted: a crash midway leaves `<name>.deleting`,
    never a half-deleted checkpoint that still looks complete."""
    doomed = folder + _DELETING
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _rename_into_place(tmp: str, final: str) -> None:
    """`tmp` becomes `final`; an existing `final` is moved aside first and deleted only once the new one is in
    place (if the rename fails, it is put back)."""
    if not os.path.isdir(final):
        os.replace(tmp, final)
        return
    aside = final + ".replaced"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        os.replace(aside, final)
        raise
    _delete(aside)


def _read_meta(path: str) -> Dict[str, Any]:
    file = os.path.join(path, "meta.json")
    try:
        with open(file) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or "step" not in meta or "world_size" not in meta:
            raise ValueError("no step or world_size in it")
        return meta
    except (OSError, ValueError) as err:
        raise _damaged(path, f"{file}: {err}") from err


class ExtraStates:
    """Every rank's extra state of a checkpoint (`extras[r]`), each file read when first asked for."""

    def __init__(self, checkpoint: str, world_size: int):
        self.checkpoint, self.world_size = checkpoint, world_size
        self._cache: Dict[int, Dict[str, Any]] = {}

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, rank: int) -> Dict[str, Any]:
        if not 0 <= rank < self.world_size:
            raise IndexError(rank)  # also what ends a `for` over it
        if rank not in self._cache:
            file = os.path.join(self.checkpoint, "extra_state", f"rank_{rank}.pt")
            self._cache[rank] = _load_extra(file, self.checkpoint)
        return self._cache[rank]


def _load_extra(file: str, checkpoint: str) -> Dict[str, Any]:
    try:
        return load_tensor_file(file)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise _damaged(checkpoint, f"{file}: {first_line(err)}") from err
