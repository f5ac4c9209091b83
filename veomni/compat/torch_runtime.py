"""Private torch symbols of the process lifecycle: torchrun's worker teardown and c10d's default store.

Nothing here imports torch at module load: the launcher imports torch.distributed.run only when it starts, and
the heartbeat thread runs before the task has imported torch (a second thread importing a half-initialised torch
raises), so each adapter imports what it needs when called.
"""

import contextlib
import sys
from typing import List, Tuple

__all__ = ["bound_worker_close_grace", "default_store", "explain_redistribute_notice", "quiet_torchao_enum_notice"]

PRIVATE_SYMBOLS: List[Tuple[str, str, str]] = [
    ("torch.distributed.elastic.multiprocessing.api", "PContext.close", "failure teardown grace (launch.py)"),
    ("torch.distributed.distributed_c10d", "_get_default_store", "the heartbeat's liveness keys"),
    ("torch.distributed.tensor._redistribute", "logger", "its sequential-redistribution notice (tensor parallel)"),
]

REDISTRIBUTE_NOTE = (
    "tensor parallel: DTensor redistributes some tensors over several mesh dimensions in sequential collectives "
    '(torch warns that their reduction order "may give inconsistent results between ranks"). Here that means '
    "rounding-level differences only (fp32 TP runs match one process to 1e-5, tests/test_tensor_parallel.py) and an "
    "extra collective's latency; said once, on rank 0"
)


def quiet_torchao_enum_notice() -> None:
    """torchao (the fp8 extra; transformers imports it whenever it is installed) registers enums as pytree constants,
    which torch >= 2.14 answers on every process with a deprecation notice through the logger of its private
    `torch.utils._pytree`: nothing a user of ours can act on. A filter on that logger (by name: torch not imported)."""
    import logging

    logging.getLogger("torch.utils._pytree").addFilter(lambda record: "is an Enum subclass" not in record.getMessage())


def explain_redistribute_notice(rank: int) -> None:
    """torch's DTensor logs its "sequential collectives ... may give inconsistent results between ranks" warning
    once per rank and mesh: under TP every rank printed the same alarming paragraph. A filter on that private
    logger says once, on rank 0, what it means here, and drops the rest."""
    import logging

    said = []

    def once_on_rank0(record) -> bool:
        if "inconsistent results between ranks" not in record.getMessage():
            return True
        if rank != 0 or said:
            return False
        said.append(True)
        record.msg, record.args = REDISTRIBUTE_NOTE, None
        return True

    target = logging.getLogger("torch.distributed.tensor._redistribute")
    for old in [f for f in target.filters if getattr(f, "__name__", "") == "once_on_rank0"]:
        target.removeFilter(old)  # one filter per process, whatever the number of models built
    target.addFilter(once_on_rank0)


def bound_worker_close_grace(grace_s: int) -> bool:
    """Make torchrun's `PContext.close` (how it stops the other workers when one fails) wait at most `grace_s`
    before SIGKILL instead of its fixed 30 s, by patching the class for this launcher process. Returns False (and
    changes nothing) where this torch has no PContext: the teardown then keeps torchrun's own 30 s."""
    try:
        from torch.distributed.elastic.multiprocessing.api import PContext
    except ImportError:
        return False
    close = PContext.close

    def close_with_grace(self, death_sig=None, timeout=grace_s):
        return close(self, death_sig, timeout)

    PContext.close = close_with_grace
    return True


def default_store():
    """The default process group's TCPStore (c10d's private `_get_default_store`), or None: no torch imported
    yet, no group, or the private function gone (the heartbeat then runs without the store)."""
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    return None
