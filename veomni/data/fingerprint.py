"""Fingerprints: a short hash that changes whenever the data files, the transform or the tokenizer would change
the samples, so that a sample cache built under one set of them is never used under another.

Functions are hashed by the source of their whole module (an edited transform, or a helper it calls from the same
file, invalidates caches), objects by the module sources of their type's MRO and their state, tensors and
arrays by value, tokenizers by their full serialisation and chat template, configs and processors by their JSON.
A cache key also covers the source of `veomni/data`, whose code the built-in transforms call. An object that
cannot be fingerprinted (a lambda's closure over an open file, say) raises `Unfingerprintable`: its data is then
not cached rather than cached under a key that would miss a change.

A data file is fingerprinted by its path, size, mtime and a hash of its content: all of it up to 1 MiB, else 32
evenly spaced blocks of 16 KiB (the first and last included), so an edit that keeps the size and the mtime (`cp -p`,
`rsync -a`) still changes the key unless it falls entirely between the sampled blocks of a large file.
"""

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import pickle
import sys
from typing import Any, Dict, List, Optional

import numpy as np

_MAX_DEPTH = 12
_WHOLE_FILE, _BLOCKS, _BLOCK = 1 << 20, 32, 16 << 10


class Unfingerprintable(TypeError):
    """No stable fingerprint for this object: its results are not cached."""


def fingerprint(*objects: Any, package: bool = True, exclude: Any = None) -> str:
    """The objects' hash (and veomni/data's source unless `package=False`); `exclude` (e.g. a tokenizer, hashed
    on its own) counts by its type only."""
    digest = hashlib.sha256(_package_source().encode() if package else b"")
    for obj in objects:  # (None is described before the `seen` check: excluding it changes nothing)
        digest.update(_describe(obj, 0, {id(exclude)}).encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def files_fingerprint(files: List[str]) -> List[Any]:
    """Each file's absolute path, size, modification time and sampled content (see the module doc)."""
    out = []
    for f in files:
        st = os.stat(f)
        content = _content_hash(f, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        out.append((os.path.abspath(f), st.st_size, st.st_mtime_ns, content))
    return out


@functools.lru_cache(maxsize=4096)
def _content_hash(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    """(Cached per process by the file's stat: an edit changes its ctime even when it keeps size and mtime.)"""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE:
            digest.update(f.read())
        else:
            for k in range(_BLOCKS):
                f.seek(k * (size - _BLOCK) // (_BLOCKS - 1))
                digest.update(f.read(_BLOCK))
    return digest.hexdigest()


def data_fingerprint(files: List[str], transform: Any, source: Optional[str] = None) -> Dict[str, Optional[str]]:
    """What a run's data is made of, part by part, so that a change can be named: the data `files` (their sizes and
    sampled content, in order: the same data moved or touched is the same), the `transform` (its code and
    arguments, the tokenizer aside) and the `tokenizer` it uses (None if it has none). Raises Unfingerprintable for
    a transform that hides its state. `source`: where the files came from, when they came by name (a hub dataset's
    name, commit, config and split; hub_datasets.py), recorded as such."""
    tokenizer = find_tokenizer(transform)
    contents = [(size, content) for _, size, _, content in files_fingerprint(files)]
    parts = {
        "files": hashlib.sha256(repr(contents).encode()).hexdigest()[:20],
        "transform": fingerprint(transform, package=False, exclude=tokenizer),
        "tokenizer": fingerprint(tokenizer, package=False) if tokenizer is not None else None,
    }
    return {**parts, "source": source} if source else parts


def find_tokenizer(transform: Any) -> Any:
    """The tokenizer a transform uses: an argument of it, or the `tokenizer` of a chat template or processor."""
    if not isinstance(transform, functools.partial):
        return None
    for value in [*transform.args, *transform.keywords.values()]:
        for candidate in (value, getattr(value, "tokenizer", None)):
            if _is_tokenizer(candidate):
                return candidate
    return None


def _is_tokenizer(obj: Any) -> bool:
    return hasattr(obj, "backend_tokenizer") or (hasattr(obj, "get_vocab") and hasattr(obj, "encode"))


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


def _module_source(name: str) -> str:
    """A hash of the source file of module `name` ("" for a module without one, as a builtin), read as a data file
    is (whole up to 1 MiB, which any hand-written module is)."""
    path = getattr(sys.modules.get(name), "__file__", None)
    if not path or not os.path.isfile(path):
        return ""
    return files_fingerprint([path])[0][3]


def _function(fn, depth: int, seen: set) -> str:
    # its file's source covers the function and the helpers it calls from the same file; the bytecode, a function
    # made without a file
    code = getattr(getattr(fn, "__code__", None), "co_code", b"").hex()
    code += ":" + _module_source(getattr(fn, "__module__", None) or "")
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
    torch = sys.modules.get("torch")  # (a tensor exists only once torch is imported)
    if torch is not None and isinstance(obj, torch.Tensor):  # by value (its bytes: bf16 has no numpy type)
        flat = obj.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
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
    if _is_tokenizer(obj):
        return _tokenizer(obj)
    if callable(getattr(type(obj), "get_attributes", None)):  # an HF processor
        parts = {name: getattr(obj, name, None) for name in type(obj).get_attributes()}  # tokenizer, image, audio
        template = getattr(obj, "chat_template", None)
        return f"processor:{type(obj).__name__}:{_describe(parts, depth + 1, seen)}:{template}"
    if hasattr(obj, "to_json_string") and callable(obj.to_json_string):  # configs, image processors, extractors
        with contextlib.suppress(Exception):  # some processors cannot serialise every attribute: then their state
            return f"json:{type(obj).__name__}:{obj.to_json_string()}"
    if inspect.isclass(obj):
        return f"class:{obj.__module__}.{obj.__qualname__}"
    state = getattr(obj, "__dict__", None)
    if state is not None:  # the object's state and the module sources of its MRO (an edited base class counts)
        kind = type(obj)
        code = ",".join(
            f"{cls.__module__}.{cls.__qualname__}:{_module_source(cls.__module__)}"
            for cls in kind.__mro__
            if cls.__module__ != "builtins"
        )
        return f"obj:{kind.__module__}.{kind.__qualname__}:{code}:{_describe(dict(state), depth + 1, seen)}"
    try:
        return f"pickle:{hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()}"
    except Exception as err:
        raise Unfingerprintable(f"cannot fingerprint a {type(obj).__name__}: {err}") from None
