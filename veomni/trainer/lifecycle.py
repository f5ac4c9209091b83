"""How a training process starts, stops and fails: the same way on every rank, and never by hanging.

`run_worker(main)` wraps a task's `main` on each rank:
- **launcher death**: the worker asks the kernel for SIGHUP when its parent (torchrun) dies (Linux
  `PR_SET_PDEATHSIG`), so SIGKILL of the launcher alone does not leave workers training: they stop as below.
- **stop on request**: the first SIGINT/SIGTERM/SIGHUP only sets a flag; the trainer all-reduces it with each
  step's totals (no extra collective), so every rank finishes the same step, saves one checkpoint together and
  exits with `128 + signal` (130 for SIGINT, 143 for SIGTERM, 129 after the launcher died; `STOP_EXIT_CODES`).
  A second SIGINT/SIGTERM exits at once, unless it comes within `REPEAT_WINDOW_S` of the first: a scheduler that
  signals every process of the job (SLURM) reaches each worker directly AND through the launcher, which forwards
  it; that is one request, not two. The launcher waits for the save (see veomni/launch.py, the stop grace).
  Before training starts there is nothing to save: a signal ends the process at once with the same code.
  After the last step (`set_training_done`) a stop changes nothing: the final checkpoint and export are written
  and the run ends as a completed one (exit 0), on every rank alike, whichever ranks got the signal.
- **errors**: an exception ends this rank at once with exit code 1 (no barrier, no process-group teardown that
  could wait on a peer), so torchrun tears the other ranks down. The first rank to fail (agreed through the
  rendezvous store) prints the message once; user errors (config, data, paths, checkpoints) as one line, bugs with
  their traceback. The message also goes to torchrun's error file, so its summary names the real cause.
- **stalls**: a heartbeat thread records each rank's step and phase in the store every few seconds; when a
  collective fails or times out (`train.accelerator.dist_timeout_minutes`), the report names the ranks that
  stopped answering and what they were doing.
"""

import contextlib
import ctypes
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional, Sequence

# default_store never imports torch: the heartbeat thread starts before the task imports it, and a second thread
# importing a half-initialised torch raises (which silently killed the heartbeat). No torch, no group, no store.
from ..compat.torch_runtime import default_store

# stop signals by precedence when ranks saw different ones; SIGHUP is the launcher's death (see watch_parent)
STOP_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
ERROR_EXIT_CODE = 1
_HEARTBEAT_SECONDS = 1.0
_GROUP_POLL_SECONDS = 0.1  # until the process group exists: the first beat follows joining it this closely
# how a stop request is told, and how to insist in its own terms (a Ctrl-C is not answered with "a second SIGTERM")
_STOP_WORDS = {
    signal.SIGINT: ("Ctrl-C (SIGINT) received", "a second Ctrl-C"),
    signal.SIGTERM: ("SIGTERM received", "a second SIGTERM to the workers"),
    signal.SIGHUP: ("the launcher died (SIGHUP)", "a second SIGTERM to the workers"),
}
REPEAT_WINDOW_S = 5.0  # a stop signal this soon after the first one is the same request, told twice
_PR_SET_PDEATHSIG = 1

_state = {
    "stop_signal": None,  # the first stop signal received, if any
    "stop_time": 0.0,  # when it came (time.monotonic())
    "loop_active": False,  # a training loop is running and will honour a stop at its next step
    "training_done": False,  # the last step ran: only the final save, export and teardown are left
    "exiting": False,  # this rank is reporting an error or leaving after a stop: further signals change nothing
    "step": 0,
    "phase": "set-up",
    "handler_pid": None,  # the rank's own process (not its forked data-loader workers)
    "joined": None,  # when this rank's heartbeat first found the process group (time.time())
}


class StopBeforeTraining(BaseException):
    """A stop signal arrived outside a loop that saves (set-up, or a script without checkpoints): leave at once.
    A BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class TrainingStopped(BaseException):
    """Raised on every rank by the trainer after the agreed stop step was saved."""

    def __init__(self, signum: int, step: int, saved: str, resume_hint: str):
        super().__init__(signum)
        # the launcher SIGTERMs the ranks that are still up when the first one exits: that is no news now
        _state["exiting"] = True
        self.signum, self.step, self.saved, self.resume_hint = signum, step, saved, resume_hint

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        return f"{name}: stopped at step {self.step}; saved {self.saved}; {self.resume_hint}"


# -------------------------------------------------------------------------------------------- queries
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def stop_requested() -> Optional[int]:
    """The signal that asked this rank to stop (SIGINT, SIGTERM, or SIGHUP for the launcher's death), or None."""
    return _state["stop_signal"]


def set_progress(step: int, phase: str) -> None:
    """Record what this rank is doing; shown when a collective fails or a peer stalls. Costs nothing."""
    _state["step"], _state["phase"] = step, phase


def set_loop_active(active: bool) -> None:
    """While True, a stop signal is honoured at the next step; otherwise it ends the process at once."""
    _state["loop_active"] = active


def set_training_done() -> None:
    """The last step ran (its stop verdict is agreed): a stop signal from now on lets the run finish its final save,
    export and teardown. Interrupting them would tear the checkpoint or leave peers waiting in a collective."""
    _state["training_done"] = True


def _say(text: str) -> None:
    """Write to stderr from anywhere, a signal handler included (print() is not reentrant)."""
    with contextlib.suppress(OSError):
        os.write(2, (text.rstrip("\n") + "\n").encode())


# ------------------------------------------------------------------------------------- launcher death
def watch_parent(sig: int = signal.SIGHUP) -> bool:
    """Ask for `sig` when the launcher dies (Linux only, and only under torchrun). Returns whether it is set.

    SIGHUP, not SIGTERM: the kernel sends it once per exiting thread of a multi-threaded launcher (torchrun has
    several), and repeats of it must not count as the "second signal" that means "exit now, do not save"."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), sig)
    return True


# ---------------------------------------------------------------------------------------- stop signals
def _on_stop_signal(signum, frame) -> None:
    # torchrun signals each worker's whole process group: forked data-loader workers inherit this handler and
    # get the signal too, but they just follow their rank (which stops them), so they ignore it
    if _state["exiting"] or os.getpid() != _state["handler_pid"]:
        return
    name = signal.Signals(signum).name
    if signum == signal.SIGHUP and _state["stop_signal"] is not None:
        return  # the launcher's death, told again by another of its threads
    if _state["stop_signal"] is not None:
        if time.monotonic() - _state["stop_time"] < REPEAT_WINDOW_S:
            return  # the same request by another route (the scheduler directly, and the launcher forwarding it)
        _say(f"rank {_rank()}: second {name}: exiting now without saving")  # the user means it
        os._exit(STOP_EXIT_CODES[signum])
    _state["stop_signal"], _state["stop_time"] = signum, time.monotonic()
    if _state["training_done"]:
        if _rank() == 0:
            _say(f"{name} after the last step: finishing the final save, then exiting as a completed run")
        return
    if not _state["loop_active"]:
        raise StopBeforeTraining(signum)
    if _rank() == 0:
        request, insist = _STOP_WORDS[signum]
        _say(f"{request}: finishing the current step, then saving a checkpoint ({insist}, "
             f"{REPEAT_WINDOW_S:.0f} s or more later, exits at once)")  # fmt: skip


def install_stop_handlers() -> None:
    _state["handler_pid"] = os.getpid()
    for sig in STOP_EXIT_CODES:
        signal.signal(sig, _on_stop_signal)


# ------------------------------------------------------------------------------------------- heartbeat
def _heartbeat_loop(stop: threading.Event) -> None:
    while True:
        store = default_store()
        if store is not None and _state["joined"] is None:
            _state["joined"] = time.time()
        # once a stop is under way the launcher may be gone with its store: nothing left to tell it
        if store is not None and _state["stop_signal"] is None:
            beat = {"t": time.time(), "step": _state["step"], "phase": _state["phase"]}
            try:
                store.set(f"veomni/heartbeat/{_rank()}", json.dumps(beat))
            except Exception:  # the store went away with the launcher: nothing to report to
                return
        if stop.wait(_HEARTBEAT_SECONDS if store is not None else _GROUP_POLL_SECONDS):
            return


def _stalled_peers() -> str:
    """Ranks whose heartbeat is missing or stale, with their last step and phase ('' if none or unknown)."""
    store = default_store()
    if store is None:
        return ""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        time.sleep(_HEARTBEAT_SECONDS * 1.5)  # a live peer refreshes its beat meanwhile; a dead one cannot
        now, notes = time.time(), []
        for r in range(world):
            if r == _rank():
                continue
            key = f"veomni/heartbeat/{r}"
            if not store.check([key]):  # its first beat is due within _GROUP_POLL_SECONDS of the group's start
                joined = _state["joined"]
                since = f" since the process group started {now - joined:.0f} s ago" if joined else ""
                notes.append(f"rank {r} silent{since} (stopped or hung before its first heartbeat)")
                continue
            beat = json.loads(store.get(key))
            if now - beat["t"] > _HEARTBEAT_SECONDS * 2:
                notes.append(
                    f"rank {r} silent for {now - beat['t']:.0f} s (last heartbeat in step {beat['step']}, "
                    f"{beat['phase']})"
                )
        return "; ".join(notes)
    except Exception:
        return ""


# ----------------------------------------------------------------------------------------------- errors
# a user's mistake, said in one line without a traceback: the builtin file errors, and what the task adds
# (`run_worker(main, user_errors)`: config, data, template, weights and checkpoint errors; veomni.trainer.task)
_FILE_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
_user_errors: Callable[[], Sequence[type]] = tuple


def _user_error_types():
    return (*_FILE_ERRORS, *_user_errors())


def _is_collective_failure(err: BaseException) -> bool:
    import torch.distributed as dist

    text = f"{type(err).__name__} {err}".lower()
    return isinstance(err, getattr(dist, "DistBackendError", ())) or any(
        s in text for s in ("gloo", "nccl", "timed out", "timeout", "connection closed", "connection reset")
    )


def _claim_report() -> Optional[bool]:
    """True on the first rank to fail (the store decides), False on later ones; None before the process group
    exists (no echoes yet: every failing rank read the same inputs, and local rank 0 says it)."""
    store = default_store()
    if store is None:
        return None
    try:
        return store.add("veomni/failures", 1) == 1
    except Exception:
        return True


def _first_line(err: BaseException) -> str:
    """The message's first line, without gloo's source location and closing advice."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". This is typically caused by")[0]


def describe_error(err: BaseException, probe_peers: bool = True) -> str:
    """One line: what failed, on which rank, in which step and operation, and the stalled peers if any."""
    first = _first_line(err)
    if isinstance(err, _user_error_types()):
        return f"{type(err).__name__}: {first}" if first else type(err).__name__
    where = f"rank {_rank()}, step {_state['step']}, {_state['phase']}"
    if _is_collective_failure(err):
        stalled = _stalled_peers() if probe_peers else ""
        line = f"collective failed ({where}): {type(err).__name__}: {first}"
        return line + (f"; {stalled}" if stalled else "")
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" at {frame.filename}:{frame.lineno}" if frame else ""
    return f"{type(err).__name__}: {first} ({where}{at})"


def _write_error_file(message: str, trace: str, secondary: bool) -> None:
    """torchrun's error record: its summary shows `py_callstack` and names the earliest failure as the root cause,
    at 1-s resolution with ties going to the lowest rank. A rank it SIGTERMs while tearing down is dated when it
    is seen dead (no record), often the same second as the real cause on a higher rank; so the real cause is
    dated a second early and an echo of it (a peer's lost connection) a second late."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = int(time.time()) + (1 if secondary else -1)
    info = {"py_callstack": trace or message, "timestamp": stamp, "veomni_secondary": secondary}
    record = {"message": {"message": message, "extraInfo": info}}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(record, f)


def report_error(err: BaseException) -> None:
    """Say what went wrong, once over all ranks, as this rank's last output."""
    _state["exiting"] = True
    claim = _claim_report()
    reporter = claim if claim is not None else int(os.environ.get("LOCAL_RANK", "0")) == 0
    message = describe_error(err, probe_peers=reporter)  # a later failure is an echo: no time spent on it
    # a user's mistake or a lost peer is said in one line; a traceback only helps with a bug in the code
    plain = isinstance(err, _user_error_types()) or _is_collective_failure(err)
    trace = "" if plain else "".join(traceback.format_exception(err))
    _write_error_file(message, trace, secondary=claim is False)
    if not reporter:
        return
    if trace:
        _say(trace)
    if not os.environ.get("VEOMNI_LAUNCHER"):  # `python -m veomni.launch` says it last, after every rank is down
        _say(f"error: {message}")


def _exit(code: int) -> None:
    """Leave now: no atexit hooks or destructors that could wait on a dead peer (or abort in gloo teardown)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_worker(main: Callable[[], object], user_errors: Callable[[], Sequence[type]] = tuple) -> None:
    """Run a task's `main` on this rank with the launcher-death, stop-signal and error handling above;
    `user_errors()` (called only when something fails: it may import what it names) are the error types reported
    in one line, as a mistake in the inputs rather than a bug in the code."""
    global _user_errors
    _user_errors = user_errors
    watch_parent()
    install_stop_handlers()
    beat_stop = threading.Event()
    threading.Thread(target=_heartbeat_loop, args=(beat_stop,), name="veomni-heartbeat", daemon=True).start()
    try:
        main()
    except TrainingStopped as stop:
        beat_stop.set()
        if _rank() == 0:
            _say(stop.message())
        import torch.distributed as dist

        if dist.is_initialized():  # every rank is at the same point: leave the process group cleanly
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        _exit(STOP_EXIT_CODES[stop.signum])
    except StopBeforeTraining as stop:
        if _rank() == 0:
            where = f"at step {_state['step']}" if _state["step"] else "during set-up"
            _say(f"{signal.Signals(stop.signum).name}: stopped {where}; nothing was saved")
        _exit(STOP_EXIT_CODES[stop.signum])
    except SystemExit as done:
        if done.code not in (0, None):  # sys.exit(message or code) is a failure like any other
            report_error(done)
            _exit(done.code if isinstance(done.code, int) else ERROR_EXIT_CODE)
        beat_stop.set()
        _exit(0)  # e.g. --help: a clean, successful exit
    except BaseException as err:  # noqa: BLE001 - every failure must end the process, KeyboardInterrupt too
        report_error(err)
        _exit(ERROR_EXIT_CODE)
    beat_stop.set()
