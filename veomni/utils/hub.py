"""Models and datasets by hub name, resolved through `huggingface_hub` into its cache.

    model.model_path: Qwen/Qwen3-0.6B                  (also config_path, tokenizer_path)
    model.model_path: Qwen/Qwen3-0.6B@<branch|tag|commit>
    data.train_path:  hf://datasets/org/name[@rev][/path/in/the/repo]    (the repo's files, read by our readers)
    data.train_path:  hf://datasets/org/name[@rev][/config][:split]      (through `datasets`, hub_datasets.py)

A data path with `:split`, or whose segment after the name is no file or folder of the repo, is a config (default:
the repo's default) and split (default: train) loaded with `datasets.load_dataset` (veomni/data/hub_datasets.py).

A name that is not a local path is fetched with `huggingface_hub.snapshot_download`, which honours `HF_HOME`,
`HF_HUB_CACHE` and `HF_HUB_OFFLINE` (offline, only the cache is read: `models--org--name/snapshots/<commit>/` found
through `refs/<rev>`). Under torch.distributed, local rank 0 of each node downloads while the node's other ranks
wait in a collective; every rank then reads the path its node's local rank 0 got (the cache is per node), and an
error on any node ends every rank with the same one line. Which paths are hub names is decided by each rank from
the config and its filesystem: a folder named like `org/name` that exists on some nodes only would split the ranks
(give such folders as ./org/name or an absolute path).
"""

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

DATA_PREFIX = "hf://datasets/"
_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_MODEL_NAME = re.compile(rf"^(?P<repo>{_REPO})(@(?P<rev>[\w.-]+))?$")
_DATA_NAME = re.compile(
    rf"^{re.escape(DATA_PREFIX)}(?P<repo>{_REPO})(@(?P<rev>[\w.-]+))?(/(?P<sub>[^:]+?))?(:(?P<split>[\w.-]+))?$"
)

DEFAULT_SPLIT = "train"


@dataclass(frozen=True)
class HubData:
    """A split of a hub dataset read through `datasets`, its revision pinned to a commit once resolved."""

    repo: str
    revision: Optional[str]
    config: Optional[str]
    split: str

    def path(self) -> str:
        """The `hf://` form of this reference (what data.train_path holds once resolved)."""
        rev = f"@{self.revision}" if self.revision else ""
        config = f"/{self.config}" if self.config else ""
        return f"{DATA_PREFIX}{self.repo}{rev}{config}:{self.split}"

    def describe(self) -> str:
        """What the data fingerprint records: name, commit, config and split."""
        return f"{self.repo}@{self.revision} config={self.config or 'default'} split={self.split}"

    def cache_name(self) -> str:
        return f"{self.repo.replace('/', '_')}-{self.config or 'default'}-{self.split}"


# prepare(ref, key, path, data) -> pinned path: how local rank 0 readies a `datasets` split (the data layer's
# hub_datasets.prepare_split, handed down by its callers: this module sits below the data package)
PrepareDataset = Callable[[HubData, str, str, Any], str]

# local snapshot folder -> the hub name it came from (a LoRA adapter records the name, not the cache path)
_resolved_names: Dict[str, str] = {}
# pinned `hf://datasets/...:split` path -> {"source", "revision", "files"} (hub_datasets.prepare; the same on every rank)
data_entries: Dict[str, dict] = {}


class HubNameError(ValueError):
    """A hub name that could not be resolved, said in one line."""


def hub_reference(path: Optional[str], data: bool = False) -> Optional[Tuple[str, Optional[str], str]]:
    """(repo_id, revision, path inside the repo) when `path` names a hub repo rather than a local path, else None.
    A model name is `org/name[@rev]` with no such local file or folder; a dataset is `hf://datasets/...`."""
    if not isinstance(path, str) or (not data and os.path.exists(path)):
        return None
    match = (_DATA_NAME if data else _MODEL_NAME).match(path)
    if not match or (not data and path.startswith((".", "/"))):
        return None
    return match["repo"], match["rev"], (match.groupdict().get("sub") or "")


def dataset_reference(path: Optional[str]):
    """The HubData (veomni.data.hub_datasets) of a data path in the `datasets` form (`...:split`), else None."""
    match = _DATA_NAME.match(path) if isinstance(path, str) else None
    if not match or not match["split"]:
        return None
    return HubData(match["repo"], match["rev"], match["sub"] or None, match["split"])


def hub_name_of(local_path: Optional[str]) -> Optional[str]:
    """The hub name a resolved local folder came from, or None for a path the user gave."""
    return _resolved_names.get(os.path.abspath(local_path)) if local_path else None


def folder_of_hub_name(name: Optional[str]) -> Optional[str]:
    """The local folder this process resolved hub name `name` to, or None."""
    return next((folder for folder, known in _resolved_names.items() if known == name), None)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def download(
    path: str, key: str = "model.model_path", data=False, prepare_dataset: Optional[PrepareDataset] = None
) -> str:
    """The local folder (or file) of hub name `path`, downloaded into the hub cache when online; `path` itself when
    it is local. Raises HubNameError naming `key`, the cache looked in and the offline flag. A data path in the
    `datasets` form is readied by `prepare_dataset` (`data="iterable"`: for streaming) and returned pinned."""
    ref = hub_reference(path, data)
    if ref is None:
        return path
    repo, revision, sub = ref
    dataset = dataset_reference(path) if data else None
    if dataset is None:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        patterns = [sub, f"{sub.rstrip('/')}/*"] if sub else None
        try:
            folder = huggingface_hub.snapshot_download(
                repo, revision=revision, repo_type="dataset" if data else "model", allow_patterns=patterns
            )
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
            raise HubNameError(explain(key, path, err)) from None
        local = os.path.join(folder, sub) if sub else folder
        if os.path.exists(local):
            _resolved_names[os.path.abspath(local)] = path if data else repo
            return local
        if not (data and "/" not in sub.strip("/")):
            raise HubNameError(f"{key}: {path}: the hub snapshot {folder} holds no {sub}")
        dataset = HubData(repo, revision, sub.strip("/"), DEFAULT_SPLIT)  # not a file of the repo: a config
    if prepare_dataset is None:
        raise TypeError(f"{key}: {path} is read through `datasets`: download() needs prepare_dataset")
    return prepare_dataset(dataset, key, path, data)


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def explain(key: str, path: str, err: BaseException) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    if offline():
        return (
            f"{key}: {path} is neither a local path nor in the hub cache {HF_HUB_CACHE} "
            f"(HF_HUB_OFFLINE=1: nothing is downloaded; unset it to download, or set HF_HOME/HF_HUB_CACHE to the "
            f"cache that holds it)"
        )
    return (
        f"{key}: {path} is not a local path and could not be downloaded into the hub cache {HF_HUB_CACHE}: "
        f"{first_line(err)} "
        f"(HF_HUB_OFFLINE is not set; check the name and revision, HF_TOKEN for a gated repo, or the network)"
    )


def resolve_on_every_rank(
    items: List[Tuple[str, Optional[str], Any]], prepare_dataset: Optional[PrepareDataset] = None
) -> Dict[str, str]:
    """{key: local path} for the (key, path, is_data) items that name hub repos (is_data "iterable": data to
    stream; a `datasets` path stays a pinned hf:// path, its entry in `data_entries`), resolved once per node: local
    rank 0 downloads, the node's other ranks wait in the gather and take its paths. The same on every rank; a
    failure anywhere raises HubNameError on every rank (the first failing rank's message)."""
    wanted = [(key, path, data) for key, path, data in items if hub_reference(path, data)]
    if not wanted:
        return {}
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0
    found, error = {}, None
    if local_rank == 0:
        try:
            for key, path, data in wanted:
                found[key] = download(path, key, data, prepare_dataset)
        except HubNameError as err:
            error = str(err)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (error, found, dict(_resolved_names), dict(data_entries)))
        error = next((e for e, _, _, _ in gathered if e), None)
        if error is None:  # this node's local rank 0 (torchrun numbers a node's ranks contiguously)
            _, found, names, entries = gathered[dist.get_rank() - local_rank]
            _resolved_names.update(names)
            data_entries.update(entries)
    if error:
        raise HubNameError(error)
    return found
