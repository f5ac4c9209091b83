"""What a loader's epoch did with the data, read from the loader's state, so that nothing is lost silently."""

from typing import Any, Dict

from .streamed_batches import SlotStream, worker_states

_COUNTS = ("samples", "skipped", "empty", "blank", "dropped")


def data_report(loader, count_unread: bool = True) -> Dict[str, Any]:
    """This rank's account of the current epoch, so that nothing is lost silently: `samples` handed out in steps
    (a step fetched on one rank when another rank has run out is among them, and is not trained on),
    `skipped` bad records, `empty` records that gave no sample (empty text), `blank` lines, `dropped` samples
    (drop_last, or a tail that fits no full step), and for streamed files `unread`: records of this rank's share
    not reached when the epoch stopped (ranks whose share is larger go on only as long as every rank has data;
    counting reads the rest of this rank's share without parsing it, so `count_unread=False` skips it).
    Sized data counts skipped, empty, blank and dropped over the whole dataset, the same on every rank
    (`whole_dataset`)."""
    states = worker_states(loader.state_dict())
    report = {name: sum(s.get(name, 0) for s in states.values()) for name in _COUNTS}
    report["whole_dataset"] = any(s.get("global_position") for s in states.values())
    if report["whole_dataset"]:  # (samples stay this rank's)
        report.update({name: max(s.get(name, 0) for s in states.values()) for name in _COUNTS[1:]})
    stream = getattr(loader, "stream", None)
    if isinstance(stream, SlotStream) and count_unread:
        report["unread"] = stream.unread(states)
    return report
