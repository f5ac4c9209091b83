"""Reading DCP checkpoints without unpickling arbitrary objects.

DCP stores its `.metadata` with pickle and loads non-tensor items with `torch.load(weights_only=False)`. Our
checkpoints hold only tensors in DCP (everything else goes to `weights_only` files), and this reader unpickles the
metadata with an allow-list of DCP's own metadata classes, so a tampered checkpoint cannot run code.
"""

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED_BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(_ALLOWED_MODULE_PREFIXES):
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)  # the checkpoint id DCP records
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module == "torch.serialization" and name == "_get_layout":  # looks a layout up by name
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or obj is torch.Size:
                return obj
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with an allow-list, and which refuses non-tensor items."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        pickled = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
        if pickled:
            raise ValueError(f"{self.path}: non-tensor entries {pickled[:4]} would need unpickling; refusing")
        return metadata
