"""`python -m veomni.launch [torchrun options] TASK.py ...`: torchrun, ending with one clear line.

torchrun itself ends a failed job with a traceback of its own and a summary block; after Ctrl-C it prints a
`SignalException` traceback. This launcher runs the same torchrun code and only changes how it ends:
- a worker error: the root cause (the first failure's record, written by `veomni.trainer.lifecycle`) is printed
  once, as the last line, and the exit code is 1;
- a stop (SIGINT/SIGTERM to the launcher or to the workers): the workers have saved and said where they stopped;
  the launcher exits quietly with 130 (SIGINT) or 143 (SIGTERM).
Workers started by it leave the final error line to it (`VEOMNI_LAUNCHER=1`).

The stop grace: a signal to the launcher is forwarded to every worker, which finishes its step and saves; torchrun
SIGKILLs a worker still running after its shutdown timeout, 30 s by default, less than a big model's save takes.
This launcher waits `DEFAULT_STOP_GRACE_S` (15 min) instead, unless `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (or torchrun's
`--shutdown-timeout`) says otherwise. Set it below your scheduler's own kill delay (SLURM `KillWait`, Kubernetes
`terminationGracePeriodSeconds`), and those above the time a checkpoint save takes.
"""

import logging
import os
import signal
import sys

STOP_EXIT_CODES = {int(signal.SIGINT): 130, int(signal.SIGTERM): 143, int(signal.SIGHUP): 129}
DEFAULT_STOP_GRACE_S = 900  # how long stopped workers may take to finish their step and save, before SIGKILL
FAILURE_GRACE_S = 30  # after a failure nothing is saved: frozen peers are killed this soon at the latest


def _record(failure) -> dict:
    """The record a worker wrote (veomni.trainer.lifecycle), or {}. torchrun makes up a plain-string message ("Signal
    15 (SIGTERM) received by PID ...") for a rank without a record: that is not one."""
    return failure.message if isinstance(failure.message, dict) else {}


def _root_cause(err) -> str:
    """The first rank's own record, else any record, else how a rank died. torchrun's own choice (the earliest
    failure, at 1-s resolution, ties to the lowest rank) often names a rank it SIGTERMed itself while tearing down."""
    failures = sorted(err.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    recorded = [(r, f) for r, f in failures if _record(f).get("message")]
    # not the echoes: ranks that failed because another one had already failed (they lost the race to report)
    primary = [(r, f) for r, f in recorded if not _record(f).get("extraInfo", {}).get("veomni_secondary")] or recorded
    # deaths by a signal other than the launcher's own SIGTERM (kill -9, OOM killer, a segfault) are news
    killed = [
        f"rank {r} was killed by {f.signal_name()} (exit code {f.exitcode})"
        for r, f in failures
        if f.exitcode < 0 and -f.exitcode != int(signal.SIGTERM)
    ]
    if primary:
        return "; ".join([str(_record(primary[0][1])["message"]), *killed])
    if killed:
        return "; ".join(killed)
    rank, failure = failures[0]
    return f"rank {rank} exited with code {failure.exitcode} (no error record: see its output)"


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .compat.torch_runtime import bound_worker_close_grace

    os.environ["VEOMNI_LAUNCHER"] = "1"
    # torchrun's shutdown notes ("Sending process N closing signal SIGTERM") would bury the cause; its loggers
    # each carry their own level, so quiet them one by one
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # when one worker fails, torchrun stops the others with a fixed 30 s grace before SIGKILL, so a frozen worker
    # (SIGSTOP, a stuck driver) would outlive the job by 30 s whatever --shutdown-timeout says: a failure saves
    # nothing, so that grace is TORCH_ELASTIC_SHUTDOWN_TIMEOUT where it is shorter
    bound_worker_close_grace(
        min(int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", FAILURE_GRACE_S)), FAILURE_GRACE_S)
    )
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = DEFAULT_STOP_GRACE_S  # torchrun's 30 s would SIGKILL a save of a big model
    try:
        run(args)
    except SignalException as stop:
        return STOP_EXIT_CODES.get(int(stop.sigval), 128 + int(stop.sigval))
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes <= set(STOP_EXIT_CODES.values()):  # every failed rank stopped on request, after saving
            return max(codes)
        sys.stderr.flush()
        print(f"error: {_root_cause(err)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
