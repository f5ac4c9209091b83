"""Reading DCP checkpoints without unpickling arbitrary objects.

DCP stores its `.metadata` with pickle and loads non-tensor items with `torch.load(weights_only=False)`. Our
checkpoints hold only tensors in DCP (everything else goes to `weights_only` files), and this reader unpickles the
metadata with an allow-list of exact `(module, name)` pairs, so a tampered checkpoint cannot run code.

Why exact pairs and never a module prefix: with pickle protocol >= 4, `find_class` resolves dotted names, so
("torch.distributed.checkpoint.metadata", "os.system") is `os.system` (that module imports os), and every
function in `torch.distributed.checkpoint.*` (some write files) would be callable from a crafted file.
"""

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ..compat.torch import DCP_PRIVATE_PICKLED, finish_dcp_metadata, open_dcp_metadata

_DCP = "torch.distributed.checkpoint.metadata"

# Everything DCP's FileSystemWriter pickles into `.metadata` (torch 2.11-2.13): listed by watching `find_class`
# while loading metadata of model and optimizer states in fp32/bf16/fp16/int64, plain and FSDP-sharded.
_ALLOWED = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "StorageMeta"),
        (_DCP, "MetadataIndex"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "BytesStorageMetadata"),  # unpickled only to be refused below, with a clear message
        ("torch", "Size"),
        ("pathlib", "PosixPath"),  # the checkpoint id DCP records
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)
_ALLOWED |= DCP_PRIVATE_PICKLED  # torch's private names in it (an Enum of ints, a storage record, a layout lookup)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked for a callable outside the allow-list: refused before anything runs."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if "." not in name:  # a dotted name walks attributes: never allowed, whatever the module
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: checkpoint metadata refers to {module}.{name}, which DCP metadata never holds; "
            "refusing to load it (a tampered or foreign checkpoint could run code this way)"
        )


def load_tensor_file(path: str):
    """`torch.load` of our own non-DCP state files (scheduler, data loader, RNG) with `weights_only=True`: tensors
    and plain containers only, so a tampered file cannot run code. The error names the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise pickle.UnpicklingError(
            f"{path}: refused or unreadable state file (read with weights_only=True, which allows only tensors "
            f"and plain containers): {type(err).__name__}: {err}"
        ) from err


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with an allow-list, and which refuses non-tensor items.
    `cache_metadata`: read it once for many loads (an export reads one tensor per load)."""

    def __init__(self, path, cache_metadata: bool = False):
        super().__init__(path)
        self._cache_metadata, self._metadata = cache_metadata, None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is not None:
            finish_dcp_metadata(self, self._metadata)  # this load's id
            return self._metadata
        with open_dcp_metadata(self, kwargs.get("rank")) as (f, path):
            data = f.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # truncated or garbage bytes: say which file
            raise pickle.UnpicklingError(
                f"{path}: unreadable checkpoint metadata ({type(err).__name__}: {err})"
            ) from err
        if not hasattr(metadata, "state_dict_metadata"):
            raise pickle.UnpicklingError(f"{path}: not DCP metadata (got {type(metadata).__name__})")
        finish_dcp_metadata(self, metadata)
        pickled = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
        if pickled:
            raise ValueError(f"{path}: non-tensor entries {pickled[:4]} would need unpickling; refusing")
        if self._cache_metadata:
            self._metadata = metadata
        return metadata
