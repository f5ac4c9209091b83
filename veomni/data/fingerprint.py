"""Fingerprints: a short hash that changes whenever the data files, the transform or the tokenizer would change
the samples, so that a sample cache built under one set of them is never used under another.

Functions are hashed by their source code (an edited transform invalidates caches), tokenizers by their full
serialisation and chat template, configs and processors by their JSON, other objects by their class and state.
An object that cannot be fingerprinted (a lambda's closure over an open file, say) raises `Unfingerprintable`:
its data is then not cached rather than cached under a key that would miss a change.
"""

import functools
import hashlib
import inspect
import os
import pickle
from typing import Any, List

import numpy as np

_MAX_DEPTH = 12


class Unfingerprintable(TypeError):
    """No stable fingerprint for this object: its results are not cached."""


def fingerprint(*objects: Any) -> str:
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(_describe(obj, 0, set()).encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def files_fingerprint(files: List[str]) -> List[Any]:
    """Each file's absolute path, size and modification time: a rewritten file gives another fingerprint."""
    return [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]


def _function(fn, depth: int, seen: set) -> str:
    try:
        code = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(getattr(fn, "__code__", None), "co_code", b"").hex()
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
    if state is not None:  # the class's code and the object's state
        kind = type(obj)
        try:
            code = hashlib.sha256(inspect.getsource(kind).encode()).hexdigest()
        except (OSError, TypeError):
            code = ""
        return f"obj:{kind.__module__}.{kind.__qualname__}:{code}:{_describe(dict(state), depth + 1, seen)}"
    try:
        return f"pickle:{hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()}"
    except Exception as err:
        raise Unfingerprintable(f"cannot fingerprint a {type(obj).__name__}: {err}") from None
