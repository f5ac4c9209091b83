"""What a loader's epoch did with the data, so that nothing is lost silently: samples handed out, bad records
skipped, empty records, blank lines, samples dropped, streamed records not reached (read from the loader's state)."""

from typing import Any, Dict, List

from .dataset import StreamingDataset
from .streamed_batches import SlotStream


def _stream_states(node) -> List[Dict[str, Any]]:
    """The states of the stream in each worker, found in a loader's state."""
    if isinstance(node, dict):
        if "produced" in node and "skipped" in node:
            return [node]
        return [s for v in node.values() for s in _stream_states(v)]
    return []


def skipped_samples(loader) -> int:
    """Bad samples skipped so far (read from the loader's state). Global-batch loaders index all records up
    front, so every worker reports the same whole-dataset count."""
    states = _stream_states(loader.state_dict())
    if any(s.get("global_position") for s in states):
        return max((s["skipped"] for s in states), default=0)
    return sum(s["skipped"] for s in states)


def data_report(loader, count_unread: bool = True) -> Dict[str, Any]:
    """This rank's account of the current epoch, so that nothing is lost silently: `samples` handed out in steps
    (a step fetched on one rank when another rank has run out is among them, and is not trained on),
    `skipped` bad records, `empty` records that gave no sample (empty text), `blank` lines, `dropped` samples
    (drop_last, or a tail that fits no full step), and for streamed files `unread`: records of this rank's share
    not reached when the epoch stopped (ranks whose share is larger go on only as long as every rank has data;
    counting reads the rest of this rank's share without parsing it, so `count_unread=False` skips it)."""
    stream = getattr(loader, "stream", None)
    report = {"samples": 0, "skipped": 0, "empty": 0, "blank": 0, "dropped": 0}
    states = _stream_states_by_worker(loader.state_dict())
    for state in states.values():
        for name in ("samples", "skipped", "empty", "dropped"):
            report[name] += state.get(name, 0)
        report["blank"] += state.get("blank", state.get("source", {}).get("blank", 0))  # (slot streams: summed)
    report["whole_dataset"] = bool(states and any(s.get("global_position") for s in states.values()))
    if report["whole_dataset"]:  # counts of the whole dataset, the same on every rank (samples stay this rank's)
        for name in ("skipped", "empty", "dropped", "blank"):
            report[name] = max(s.get(name, 0) for s in states.values())
    source = getattr(stream, "source", None)
    if isinstance(stream, SlotStream) and count_unread:
        report["unread"] = stream.unread(states)
    elif isinstance(source, StreamingDataset) and count_unread:
        workers = max(loader.num_workers, 1)
        report["unread"] = 0
        for worker in range(workers):
            state = states.get(worker, {})
            shard = worker * stream.dp_size + stream.dp_rank
            units = source.shard_units(stream.epoch, shard, workers * stream.dp_size)
            src = state.get("source", {})
            at, position = src.get("unit", 0), src.get("position")
            left = sum(source.reader.count_unit(u) for u in units[at + 1 :])
            left += source.reader.count_unit(units[at], position) if at < len(units) else 0
            report["unread"] += (
                left + len(src.get("buffer", [])) + len({tuple(e[:-2]) for e in state.get("buffer", [])})
            )
    return report


def _stream_states_by_worker(node, worker: int = 0) -> Dict[int, Dict[str, Any]]:
    if isinstance(node, dict):
        if "produced" in node and "skipped" in node:
            return {worker: node}
        worker = node.get("worker_id", worker)  # a worker's snapshot names its worker
        found = {}
        for value in node.values():
            found.update(_stream_states_by_worker(value, worker))
        return found
    return {}


def dropped_samples(loader) -> int:
    """Samples of the current epoch's tail that fit no full global step (drop_last, or too few to split)."""
    return max((s.get("dropped", 0) for s in _stream_states(loader.state_dict())), default=0)
