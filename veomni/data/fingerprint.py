"""Fingerprints: a short hash that changes whenever the data files, the transform or the tokenizer would change
the samples, so that a sample cache built under one set of them is never used under another.

Functions are hashed by the source of their whole module (an edited transform, or a helper it calls from the same
file, invalidates caches), objects by the source of every class of their type's MRO and their state, tensors and
arrays by value, tokenizers by their full serialisation and chat template, configs and processors by their JSON.
Every fingerprint also covers the source of `veomni/data`, whose code the built-in transforms call. An object that
cannot be fingerprinted (a lambda's closure over an open file, say) raises `Unfingerprintable`: its data is then
not cached rather than cached under a key that would miss a change.
"""

import functools
import hashlib
import inspect
import logging
import os
import pickle
import sys
from typing import Any, List

import numpy as np

_MAX_DEPTH = 12


class Unfingerprintable(TypeError):
    """No stable fingerprint for this object: its results are not cached."""


def fingerprint(*objects: Any) -> str:
    digest = hashlib.sha256(_package_source().encode())
    for obj in objects:
        digest.update(_describe(obj, 0, set()).encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def files_fingerprint(files: List[str]) -> List[Any]:
    """Each file's absolute path, size and modification time: a rewritten file gives another fingerprint."""
    return [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]


@functools.lru_cache(maxsize=None)
def _package_source() -> str:
    """A hash of veomni/data's sources (the built-in transforms and what they call)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _module_source(name: str) -> str:
    """A hash of the source file of module `name` ("" for a module without one, as a builtin)."""
    path = getattr(sys.modules.get(name), "__file__", None)
    if not path or not os.path.isfile(path):
        return ""
    stat = os.stat(path)
    return _file_hash(path, stat.st_size, stat.st_mtime_ns)


def _class_sources(kind: type) -> str:
    """The sources of every class in `kind`'s MRO (a base class edited changes what the object does)."""
    parts = []
    for cls in kind.__mro__:
        if cls.__module__ == "builtins":
            continue
        try:
            parts.append(hashlib.sha256(inspect.getsource(cls).encode()).hexdigest())
        except (OSError, TypeError):
            parts.append(f"{cls.__module__}.{cls.__qualname__}:{_module_source(cls.__module__)}")
    return ",".join(parts)


def _function(fn, depth: int, seen: set) -> str:
    try:
        code = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(getattr(fn, "__code__", None), "co_code", b"").hex()
    code += ":" + _module_source(getattr(fn, "__module__", None) or "")  # helpers of the same file
    batched = getattr(fn, "batched", None)  # a transform's batched form gives the same samples: part of it
    extra = _describe(batched, depth + 1, seen) if batched is not None and batched is not fn else ""
    # what a closure or default arguments hold changes the function as much as its code (module globals it reads
    # are not covered: pass such objects as arguments, e.g. with functools.partial)
    cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
    state = _describe([cells, getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None)], depth + 1, seen)
    return f"fn:{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}:{code}:{extra}:{state}"


def _tokenizer(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    settings = {k: getattr(tok, k, None) for k in ("add_bos_token", "add_eos_token", "padding_side")}
    specials = getattr(tok, "special_tokens_map", {})
    return f"tok:{type(tok).__name__}:{body}:{specials}:{settings}:{getattr(tok, 'chat_template', None)}"


def _describe(obj: Any, depth: int, seen: set) -> str:
    if depth > _MAX_DEPTH:
        raise Unfingerprintable(f"{type(obj).__name__} nests too deeply to fingerprint")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return repr(obj)
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}[" + ",".join(_describe(o, depth + 1, seen) for o in obj) + "]"
    if isinstance(obj, (set, frozenset)):
        return "set[" + ",".join(sorted(_describe(o, depth + 1, seen) for o in obj)) + "]"
    if isinstance(obj, dict):
        items = sorted((repr(k), _describe(v, depth + 1, seen)) for k, v in obj.items())
        return "dict{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(obj, np.ndarray):
        return f"nd:{obj.dtype}:{obj.shape}:{hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest()}"
    if _is_tensor(obj):  # by value (its bytes: bf16 has no numpy type)
        flat = obj.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(sys.modules["torch"].uint8).numpy().tobytes() if flat.numel() else b""
        return f"tensor:{obj.dtype}:{tuple(obj.shape)}:{hashlib.sha256(raw).hexdigest()}"
    if isinstance(obj, logging.Logger):  # its level cache changes as it is used: the name is what matters
        return f"logger:{obj.name}"
    if isinstance(obj, functools.partial):
        args = _describe(list(obj.args), depth + 1, seen)
        return f"partial({_describe(obj.func, depth + 1, seen)},{args},{_describe(obj.keywords, depth + 1, seen)})"
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
        owner = getattr(obj, "__self__", None)
        bound = _describe(owner, depth + 1, seen) if owner is not None and not inspect.ismodule(owner) else ""
        return _function(obj, depth, seen) + bound
    if id(obj) in seen:
        return f"cycle:{type(obj).__qualname__}"
    seen = seen | {id(obj)}
    if hasattr(obj, "backend_tokenizer") or (hasattr(obj, "get_vocab") and hasattr(obj, "encode")):
        return _tokenizer(obj)
    if inspect.isclass(type(obj)) and callable(getattr(type(obj), "get_attributes", None)):  # an HF processor
        parts = {name: getattr(obj, name, None) for name in type(obj).get_attributes()}  # tokenizer, image, audio
        return (
            f"processor:{type(obj).__name__}:{_describe(parts, depth + 1, seen)}:{getattr(obj, 'chat_template', None)}"
        )
    if hasattr(obj, "to_json_string") and callable(obj.to_json_string):  # configs, image processors, extractors
        try:
            return f"json:{type(obj).__name__}:{obj.to_json_string()}"
        except Exception:  # some processors cannot serialise every attribute: fall back to their state
            pass
    if inspect.isclass(obj):
        return f"class:{obj.__module__}.{obj.__qualname__}"
    state = getattr(obj, "__dict__", None)
    if state is not None:  # the classes' code and the object's state
        kind = type(obj)
        code = _class_sources(kind)
        return f"obj:{kind.__module__}.{kind.__qualname__}:{code}:{_describe(dict(state), depth + 1, seen)}"
    try:
        return f"pickle:{hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()}"
    except Exception as err:
        raise Unfingerprintable(f"cannot fingerprint a {type(obj).__name__}: {err}") from None


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # (a tensor exists only once torch is imported)
    return torch is not None and isinstance(obj, torch.Tensor)
