"""Every private torch / torchdata / transformers symbol veomni needs, imported and adapted here only.

A private name (`torch._grouped_mm`, `DeviceMesh._flatten`, `config._attn_implementation`, a modeling file's
`rotate_half`, a DataLoader's `_iterator`...) can move or change in any release. Here each one has a small adapter
whose docstring says why veomni needs it and what breaks when it moves, so an upgrade fails in one place:
tests/test_compat.py imports every symbol listed in `PRIVATE_SYMBOLS` of the modules below and runs the patched
models against plain transformers, and a grep test keeps private uses out of the rest of `veomni/`.

    veomni.compat.torch          tensors, meshes, collectives, TP styles, kernels, nn/optim internals, DCP metadata
    veomni.compat.torch_runtime  torchrun and c10d internals, imported lazily (the launcher and the heartbeat
                                 thread must not import torch themselves)
    veomni.compat.torchdata      StatefulDataLoader internals (its iterator, worker shutdown, state layout)
    veomni.compat.transformers   config attributes, modeling-file globals, checkpoint wrappers, processor internals

Call sites import from the submodule (`from ..compat.torch import grouped_mm`), so importing one part never pulls
in transformers; `from veomni.compat import name` also works (resolved lazily below).
"""

import importlib

_PARTS = ("torch", "torch_runtime", "torchdata", "transformers")


def __getattr__(name: str):
    # lazy, so that `from veomni.compat import flatten_mesh` imports torch's part only
    if name.startswith("__"):  # probes for module dunders (copy, pickle, inspect) import nothing
        raise AttributeError(name)
    for part in _PARTS:
        module = importlib.import_module(f"{__name__}.{part}")
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
