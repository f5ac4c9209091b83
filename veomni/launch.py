"""`python -m veomni.launch [torchrun options] TASK.py ...`: torchrun, ending with one clear line.

torchrun itself ends a failed job with a traceback of its own and a summary block; after Ctrl-C it prints a
`SignalException` traceback. This launcher runs the same torchrun code and only changes how it ends:
- a worker error: the root cause (the first failure's record, written by `veomni.utils.lifecycle`) is printed
  once, as the last line, and the exit code is 1;
- a stop (SIGINT/SIGTERM to the launcher or to the workers): the workers have saved and said where they stopped;
  the launcher exits quietly with 130 (SIGINT) or 143 (SIGTERM).
Workers started by it leave the final error line to it (`VEOMNI_LAUNCHER=1`).
"""

import logging
import os
import signal
import sys

STOP_EXIT_CODES = {int(signal.SIGINT): 130, int(signal.SIGTERM): 143}


def _root_cause(err) -> str:
    rank, failure = err.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    if not message or "To enable traceback" in str(message):
        return f"rank {rank} exited with code {failure.exitcode} (no error record: see its output above)"
    return str(message)


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ["VEOMNI_LAUNCHER"] = "1"
    # torchrun's shutdown notes ("Sending process N closing signal SIGTERM") would bury the cause; its loggers
    # each carry their own level, so quiet them one by one
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    args = parse_args(sys.argv[1:] if argv is None else argv)
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
