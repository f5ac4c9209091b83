"""Consolidated HF-format folders (config.json, safetensors shards + index, tokenizer / processor files), from a
live (sharded) model or from a DCP checkpoint, loadable by plain `transformers.AutoModelForCausalLM.from_pretrained`
(`AutoModelForImageTextToText` and `AutoProcessor` for vision/audio-language models).

Every rank writes: the folder's layout (which tensor goes to which shard, at which byte) is computed from names,
shapes and dtypes alone on every rank alike (safetensors_layout.py), rank 0 creates the files, and each rank writes
what it holds into them. A tensor kept as blocks of whole rows (FSDP2's dim-0 shards, plain replicas) is written by
the rank that holds each block, with no communication; one that must be converted (MoE experts split into the hub's
per-expert keys, a LoRA merge) or is sharded otherwise (a TP column shard) is gathered, one at a time, and written
by the rank whose turn it is. So no rank holds more than its own shards plus one tensor in flight. Key names and
layouts are transformers' own rules (`save_pretrained`'s), through models/hf_conversion.py.
"""

import copy
import functools
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..models.hf_conversion import convert_group, plan_save
from ..models.placement import local_index, tied_sources
from ..utils.collectives import on_every_rank, on_rank0, rank_and_world
from ..utils.logging import get_logger
from .safetensors_layout import Layout, Spec, nbytes, shard_names

logger = get_logger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    # a multimodal processor saved beside the model: AutoProcessor.from_pretrained(out_dir) rebuilds it
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)
Shapes = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]


def export_config(config, out_dir: str, architecture: str) -> None:
    """The model config for inference: the cache back on, the real class name (`architecture_of`, not FSDP's
    wrapper)."""
    config = copy.deepcopy(config)
    config.use_cache = True
    if getattr(config, "text_config", None) is not None:
        config.text_config.use_cache = True
    config.architectures = [architecture]
    config.save_pretrained(out_dir)


def copy_tokenizer(tokenizer_dir: Optional[str], out_dir: str) -> None:
    if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
        return
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, name))


def architecture_of(model) -> str:
    names = getattr(model.config, "architectures", None)
    return names[0] if names else type(model).__name__.removeprefix("FSDP")


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class Item:
    """Output tensors made from some model tensors: `convert(tensors)` gives them, or (None) the one model tensor
    is written as it is under the one output name."""

    keys: List[str]
    outputs: List[Spec]
    convert: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None


def hub_items(model: nn.Module, shapes: Shapes) -> List[Item]:
    """The model tensors in `shapes` as `save_pretrained` writes them for `model`'s class (per-expert MoE keys, the
    hub names of VL/Omni models): transformers' rules reversed, each converter's outputs found on meta tensors."""
    items = []
    for group in plan_save(model, shapes):
        if group.is_rename:
            (key,) = group.keys
            items.append(Item([key], [(group.target, *shapes[key])]))
            continue
        fake = {key: torch.empty(shapes[key][0], dtype=shapes[key][1], device="meta") for key in group.keys}
        outputs = [(name, tuple(t.shape), t.dtype) for name, t in convert_group(group, fake, model).items()]
        items.append(Item(list(group.keys), outputs, functools.partial(convert_group, group, model=model)))
    return items


def _files(items: Sequence[Item], max_shard_bytes: int, single: Optional[str]) -> Dict[str, List[Spec]]:
    """Consecutive items in files of at most `max_shard_bytes` (an item larger than that gets a file of its own),
    named as transformers names shards; `single`: one file of that name."""
    if single is not None:
        return {single: [spec for item in items for spec in item.outputs]}
    shards, size = [[]], 0
    for item in items:
        item_bytes = sum(nbytes(shape, dtype) for _, shape, dtype in item.outputs)
        if shards[-1] and size + item_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1] += item.outputs
        size += item_bytes
    return dict(zip(shard_names(len(shards)), shards))


# ------------------------------------------------------------------------------------------------ writing
class _Sink:
    """This rank's writes into the folder; the first failure is kept (and nothing written after it), so the rank
    still joins every collective and the failure is told to all ranks at the end instead of hanging them."""

    def __init__(self, layout: Layout, folder: str):
        self.layout, self.folder, self.error = layout, folder, None

    def write(self, produce: Callable[[], Dict[str, torch.Tensor]], first_row: int = 0) -> None:
        if self.error is not None:
            return
        try:
            for name, tensor in produce().items():
                self.layout.write(self.folder, name, tensor, first_row)
        except Exception as err:
            self.error = err

    def finish(self) -> None:
        try:
            self.layout.close(sync=self.error is None)
        except OSError as err:
            self.error = self.error or err
        if self.error is not None:
            raise self.error


def _alone(fn: Callable[[], Any], *_) -> Any:
    return fn()


def write_folder(
    items: Sequence[Item],
    write_item: Callable[[int, Item, _Sink], None],
    out_dir: str,
    finish: Callable[[str], None],
    max_shard_bytes: int = 5 * 2**30,
    single: Optional[str] = None,
    collective: bool = True,
) -> None:
    """Collective (unless not `collective`: this process alone): `out_dir` replaced at once by a folder of
    `items`, each rank writing its part through `write_item(index, item, sink)`; `finish(folder)` adds the other
    files on rank 0. A failure on any rank is raised on every rank and leaves `out_dir` as it was."""
    layout = Layout(_files(items, max_shard_bytes, single))
    tmp = out_dir.rstrip("/") + ".tmp"
    on_rank0_, on_every_rank_ = (on_rank0, on_every_rank) if collective else (_alone, _alone)

    def create():
        shutil.rmtree(tmp, ignore_errors=True)  # no stale shards or index of an earlier export remain
        layout.create(tmp)

    on_rank0_(create)
    sink = _Sink(layout, tmp)
    for index, item in enumerate(items):
        write_item(index, item, sink)
    try:
        on_every_rank_(sink.finish, f"writing the HF export {out_dir}")
    except Exception:
        if not collective or rank_and_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the half-written export only takes space
        raise

    def publish():
        finish(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
        logger.info(f"exported {out_dir}")

    on_rank0_(publish)


def _row_block(tensor: torch.Tensor) -> Optional[Tuple[torch.Tensor, int, bool]]:
    """(this rank's rows, the first one's index, whether this rank writes them) when `tensor` is held as blocks of
    whole rows (dim-0 shards, replicas); None otherwise. Which case it is depends on the placements only, so every
    rank decides alike."""
    if not isinstance(tensor, DTensor):
        return None
    if any(type(p) not in (Shard, Replicate) or (isinstance(p, Shard) and p.dim != 0) for p in tensor.placements):
        return None
    index, coordinate = local_index(tensor), tensor.device_mesh.get_coordinate()
    if index is None:
        return None
    replica = [coordinate[d] for d, p in enumerate(tensor.placements) if isinstance(p, Replicate)]
    return tensor.to_local(), index[0].start if index else 0, not any(replica)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device.type != tensor.device_mesh.device_type:  # CPU-offloaded shards gather on the mesh's device
        tensor = tensor.to(tensor.device_mesh.device_type)
    return tensor.full_tensor()


def produce(item: Item, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    if item.convert is not None:
        return item.convert(tensors)
    return {item.outputs[0][0]: tensors[item.keys[0]]}


def live_writer(state: Dict[str, torch.Tensor]) -> Callable[[int, Item, _Sink], None]:
    """How each rank writes the items of a live model's (sharded) `state`: row blocks where it holds them, the rest
    gathered one item at a time (a collective, in item order on every rank) and written by the item's rank."""
    rank, world = rank_and_world()

    def write(index: int, item: Item, sink: _Sink) -> None:
        block = _row_block(state[item.keys[0]]) if item.convert is None else None
        if block is not None:
            rows, first_row, mine = block
            if mine:
                sink.write(lambda: {item.outputs[0][0]: rows}, first_row)
            return
        full = {key: _full(state[key]) for key in item.keys}  # plain tensors: every rank holds them already
        if index % world == rank:
            sink.write(lambda: produce(item, full))

    return write


def live_state(model: nn.Module) -> Tuple[Dict[str, torch.Tensor], Shapes]:
    """The model's own (sharded) tensors under its clean names, less tied ones; and their full shapes and dtypes."""
    tied = set(tied_sources(model))
    state = {k: v for k, v in get_model_state_dict(model).items() if k not in tied}  # HF re-ties on load
    return state, {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def hf_folder_finish(model, config, tokenizer_dir: Optional[str]) -> Callable[[str], None]:
    def finish(folder: str) -> None:
        export_config(config, folder, architecture_of(model))
        copy_tokenizer(tokenizer_dir, folder)

    return finish


def save_hf_model(model, out_dir: str, tokenizer_dir: Optional[str] = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write an HF folder of a (sharded) model, every rank writing its own part (call on all ranks)."""
    state, shapes = live_state(model)
    finish = hf_folder_finish(model, model.config, tokenizer_dir)
    write_folder(hub_items(model, shapes), live_writer(state), out_dir, finish, max_shard_bytes)


def dcp_to_hf(
    checkpoint_dir: str,
    out_dir: str,
    max_shard_bytes: int = 5 * 2**30,
    trust_remote_code: bool = False,
    all_ranks: bool = False,
) -> str:
    """Consolidate the model of a DCP checkpoint (any world size) into an HF folder, one tensor in memory at a time:
    by this process alone, or with `all_ranks` by every rank of a launch (a collective: each reads and writes its
    share). The metadata is read with the allow-list reader; a config naming custom code is refused unless
    `trust_remote_code`."""
    from transformers import AutoConfig

    from ..models.multimodal import model_class_for
    from .safe_reader import SafeFileSystemReader

    config_dir = os.path.join(checkpoint_dir, "hf_config")
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise FileNotFoundError(f"{checkpoint_dir}: no hf_config/config.json; is this a veomni checkpoint?")
    config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = model_class_for(config).from_config(config, trust_remote_code=trust_remote_code)
    tied = set(tied_sources(skeleton))
    reader = SafeFileSystemReader(os.path.join(checkpoint_dir, "model_optimizer"), cache_metadata=True)
    shapes = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():  # shapes and dtypes exactly as trained
        name = key[len("model.") :]
        if key.startswith("model.") and name not in tied:
            shapes[name] = (tuple(meta.size), meta.properties.dtype)
    if any(".lora_" in name for name in shapes):  # adapters under PEFT's names: no hub key fits them
        raise ValueError(
            f"{checkpoint_dir} holds LoRA adapters (model.lora): its merged or adapter export is written at the end "
            "of training (train.checkpoint.save_hf_weights, model.lora.export); converting a LoRA DCP checkpoint "
            "is not supported"
        )
    finish = hf_folder_finish(skeleton, config, config_dir)
    items, writer = hub_items(skeleton, shapes), dcp_writer(reader, shapes, all_ranks)
    write_folder(items, writer, out_dir, finish, max_shard_bytes, collective=all_ranks)
    return out_dir


def dcp_writer(reader, shapes: Shapes, all_ranks: bool) -> Callable[[int, Item, _Sink], None]:
    """Each item read from the DCP files by the rank whose turn it is (no collective)."""
    import torch.distributed.checkpoint as dcp

    rank, world = rank_and_world() if all_ranks else (0, 1)

    def read(keys: List[str]) -> Dict[str, torch.Tensor]:
        state = {"model": {key: torch.empty(shapes[key][0], dtype=shapes[key][1]) for key in keys}}
        dcp.load(state, storage_reader=reader, no_dist=True)
        return state["model"]

    def write(index: int, item: Item, sink: _Sink) -> None:
        if index % world == rank:
            sink.write(lambda: produce(item, read(item.keys)))

    return write
