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

    def _apply(self, record: Any, where: Any) -> List[Dict[str, Any]]:
        if isinstance(record, DataFormatError):  # the reader's error, already naming file and line
            return self._reject(record, None)
        try:
            out = self.transform(record) if self.transform is not None else record
        except DataFormatError as err:
            return self._reject(err, where)
        out = out if isinstance(out, list) else [out]
        self.empty += not out
        return out

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
        """`_apply` over many records, through the transform's batched form when it has one."""
        batched = _batched_form(self.transform)
        if batched is None:
            return [self._apply(r, w) for r, w in zip(records, wheres)]
        out: List[List[Dict[str, Any]]] = [[] for _ in records]
        ok = []
        for i, record in enumerate(records):
            if isinstance(record, DataFormatError):
                out[i] = self._reject(record, None)
            else:
                ok.append(i)
        for i, res in zip(ok, batched([records[i] for i in ok])):  # a transform's error gets its record's location
            out[i] = self._reject(res, wheres[i]) if isinstance(res, DataFormatError) else res
            self.empty += not isinstance(res, DataFormatError) and not res
        return out

    def peek(self, n: int) -> List[Tuple[str, Any, Any]]:
        """The first `n` records as `(location, record, samples or the DataFormatError it gives)`, read from the
        start of the data without building or counting anything (pre-flight checks and the preview)."""
        out = []
        for record, where in self.reader.first(n):
            try:
                if isinstance(record, DataFormatError):
                    raise record
                samples = self.transform(record) if self.transform is not None else record
                out.append((str(where), record, samples if isinstance(samples, list) else [samples]))
            except DataFormatError as err:
                out.append((str(where), record, err))
        return out


def _batched_form(transform: Optional[Callable]) -> Optional[Callable]:
    """The batched version of a transform (`fn.batched`, also through functools.partial), or None."""
    if transform is None:
        return None
    if isinstance(transform, partial):
        inner = getattr(transform.func, "batched", None)
        return partial(inner, *transform.args, **transform.keywords) if inner else None
    return getattr(transform, "batched", None)
