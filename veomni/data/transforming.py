"""What every dataset of records shares: the transform applied with the bad-data policy, and `peek(n)`."""

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..utils.logging import EVERY_RANK, get_logger
from .data_transform import DataFormatError

logger = get_logger(__name__)
Key = Tuple[int, ...]


class Transforming:
    """Applies `self.transform` to records of `self.reader`: a bad record raises naming it, or is skipped and
    counted (`data.skip_bad_samples`)."""

    transform: Optional[Callable]
    skip_bad_samples: bool
    skipped: int = 0  # bad records skipped
    empty: int = 0  # records that gave no sample (empty text, a one-token document): counted, not errors

    def _reject(self, err: DataFormatError, where: Optional[Any]) -> List[Dict[str, Any]]:
        """Raise the bad record's error, or skip it. `where` (a lazy location: counting a jsonl line reads the
        file up to it) becomes text only when the message is shown, so skipping stays linear in the data."""

        def message() -> str:
            return str(err) if where is None else f"{where}: {err}"

        if not self.skip_bad_samples:
            raise DataFormatError(message() + " (set data.skip_bad_samples to skip such samples)") from None
        self.skipped += 1
        if self.skipped <= 5:
            logger.warning(f"skipped bad sample: {message()}", extra=EVERY_RANK)
        return []

    def _apply_many(self, records: List[Any], wheres: List[Any]) -> List[List[Dict[str, Any]]]:
        """Each record's samples, through the transform's batched form when it has one; a bad record (the reader's
        error, which already names its place, or the transform's, given the record's `where`) is `_reject`ed."""
        ok = [i for i, record in enumerate(records) if not isinstance(record, DataFormatError)]
        batched = _batched_form(self.transform)
        todo = [records[i] for i in ok]
        results = dict(zip(ok, batched(todo) if batched else [_transform(self.transform, r) for r in todo]))
        out = []
        for i, record in enumerate(records):
            res = results.get(i, record)
            if isinstance(res, DataFormatError):
                out.append(self._reject(res, wheres[i] if i in results else None))
            else:
                self.empty += not res
                out.append(res)
        return out

    def peek(self, n: int) -> List[Tuple[str, Any, Any]]:
        """The first `n` records as `(location, record, samples or the DataFormatError it gives)`, read from the
        start of the data without building or counting anything (pre-flight checks and the preview)."""
        return [
            (str(where), record, record if isinstance(record, DataFormatError) else _transform(self.transform, record))
            for record, where in self.reader.first(n)
        ]


def _transform(transform: Optional[Callable], record: Any) -> Any:
    """The record's samples (a list), or the DataFormatError the transform raised for it."""
    try:
        out = transform(record) if transform is not None else record
    except DataFormatError as err:
        return err
    return out if isinstance(out, list) else [out]


def _batched_form(transform: Optional[Callable]) -> Optional[Callable]:
    """The batched version of a transform (`fn.batched`, also through functools.partial), or None."""
    if isinstance(transform, partial):
        inner = getattr(transform.func, "batched", None)
        return partial(inner, *transform.args, **transform.keywords) if inner else None
    return getattr(transform, "batched", None)
