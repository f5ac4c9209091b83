"""A job ends, never hangs: a rank killed, frozen or raising ends every process, with one clear message; a
stop signal saves and the same command resumes exactly; workers do not outlive their launcher.

Each launch prints how many seconds the job took to end (`-s` shows them); the box is shared, so they are noisy.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import REPO, child_env, read_metrics, run_text_task, tiny_run_config, torchrun_cmd, write_token_data
from veomni.checkpoint import list_checkpoints

TIMEOUT_S = 15  # train.accelerator.dist_timeout_minutes for the stall test
FLAGS = ["--train.max_steps", "20", "--train.optimizer.lr_decay_style", "constant"]


def _config(tmp) -> str:
    write_token_data(os.path.join(tmp, "data.jsonl"), n=600)
    return tiny_run_config(tmp)


_LAUNCHED = []


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """A failed assertion must not leave a launch (or its workers, in sessions of their own) running."""
    yield
    while _LAUNCHED:
        proc = _LAUNCHED.pop()
        workers = [pid for pid, _ in _children(proc.pid)]
        for pid in [proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def _launch(config, out, *extra, env=None):
    """`bash train.sh tasks/train_text.py ...` in its own session; output to files (a full pipe would block)."""
    full_env = child_env()
    full_env.update(PYTHON=sys.executable, NPROC_PER_NODE="2", **(env or {}))
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "launch.log"), "w")
    cmd = ["bash", "train.sh", "tasks/train_text.py", config, "--train.checkpoint.output_dir", out, *FLAGS, *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log.name
    _LAUNCHED.append(proc)
    return proc


def _output(proc) -> str:
    with open(proc.log_path) as f:
        return f.read()


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def _children(pid: int):
    """(pid, RANK) of the launcher's worker processes."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError):
            continue
        if b"RANK" in env:
            found.append((int(entry), int(env[b"RANK"])))
    return sorted(found, key=lambda x: x[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for_step(proc, out: str, step: int, limit: float = 120) -> int:
    path, deadline = os.path.join(out, "metrics.jsonl"), time.time() + limit
    while time.time() < deadline:
        assert proc.poll() is None, f"the run ended before step {step}:\n{_output(proc)[-3000:]}"
        if os.path.isfile(path):
            steps = [json.loads(x)["step"] for x in open(path) if x.strip().endswith("}")]
            if steps and steps[-1] >= step:
                return steps[-1]
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {limit} s")


def _wait_gone(pids, limit: float) -> float:
    start = time.time()
    while any(_alive(p) for p in pids):
        assert time.time() - start < limit, f"processes {[p for p in pids if _alive(p)]} still alive after {limit} s"
        time.sleep(0.05)
    return time.time() - start


def _signal_rank_and_time(tmp, sig, extra=(), env=None):
    """Launch, send `sig` to rank 1 at step 3, and return (seconds until the launcher returned, rc, output)."""
    config = _config(tmp)
    out = os.path.join(tmp, f"out_{sig.name}")
    proc = _launch(
        config, out, "--train.max_steps", "100000", "--data.train_path", f"{tmp}/data.jsonl", *extra, env=env
    )
    _wait_for_step(proc, out, 3)
    if sig == signal.SIGSTOP:  # let rank 1 publish its first heartbeat (within 0.1 s of the group's start)
        time.sleep(0.5)
    workers = _children(proc.pid)
    assert [r for _, r in workers] == [0, 1], workers
    start = time.time()
    os.kill(workers[1][0], sig)
    rc = proc.wait(timeout=TIMEOUT_S + 60)
    elapsed = time.time() - start
    _wait_gone([p for p, _ in workers], 5)
    print(f"\n{sig.name} to rank 1: the job ended {elapsed:.1f} s later, rc {rc}")
    return elapsed, rc, _output(proc)


def test_worker_sigkilled_mid_step_ends_the_job(tmp_path):
    elapsed, rc, output = _signal_rank_and_time(str(tmp_path), signal.SIGKILL)
    assert rc == 1, output[-3000:]
    last = _last_line(output)
    assert last.startswith("error: ") and "rank 1" in last, output[-3000:]
    assert elapsed < 15, elapsed


def test_worker_stopped_ends_the_job_at_the_timeout(tmp_path):
    """SIGSTOP: rank 0 times out in its collective and names rank 1; torchrun then SIGKILLs the frozen rank
    after its shutdown grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default, 3 s here)."""
    elapsed, rc, output = _signal_rank_and_time(
        str(tmp_path),
        signal.SIGSTOP,
        ["--train.accelerator.dist_timeout_minutes", str(TIMEOUT_S / 60)],
        env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"},
    )
    assert rc == 1, output[-3000:]
    last = _last_line(output)
    assert last.startswith("error: collective failed (rank 0, step "), last
    assert "rank 1 silent for" in last, last
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 15, elapsed


def test_bad_record_on_one_rank_is_said_at_once_and_ends_the_job(tmp_path):
    """A malformed line in rank 1's share of streamed data (plain torchrun): the message is printed as soon as
    the rank raises, the others stop within seconds (no barrier in teardown), and torchrun's summary names it."""
    tmp = str(tmp_path)
    config = _config(tmp)
    lines = open(f"{tmp}/data.jsonl").read().splitlines()
    lines[41] = '{"input_ids": [1, 2, 3'  # in one rank's share: streamed files are dealt out in byte ranges
    with open(f"{tmp}/bad.jsonl", "w") as f:
        f.write("\n".join(lines) + "\n")
    cmd = torchrun_cmd(
        2,
        os.path.join(REPO, "tasks", "train_text.py"),
        config,
        "--data.train_path",
        f"{tmp}/bad.jsonl",
        "--data.datasets_type",
        "iterable",
        "--train.checkpoint.output_dir",
        f"{tmp}/out",
        *FLAGS,
    )
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _LAUNCHED.append(proc)
    lines_at = []
    reader = threading.Thread(target=lambda: lines_at.extend((time.time(), line) for line in proc.stdout), daemon=True)
    reader.start()
    rc = proc.wait(timeout=180)
    ended = time.time()
    reader.join()
    output = "".join(line for _, line in lines_at)
    expected = f"{tmp}/bad.jsonl:42: malformed JSON"
    said = [(t, line) for t, line in lines_at if line.startswith("error: ") and expected in line]
    assert rc == 1 and len(said) == 1, output[-4000:]
    print(f"\nbad record on rank 1: every process ended {ended - said[0][0]:.1f} s after the message")
    # a barrier in teardown would hold the others for the collective timeout (minutes); a loaded box (two test
    # workers beside other work) took over 10 s for the launcher's own teardown
    assert ended - said[0][0] < 60
    root = output.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s+: [01] ", root) and "DataFormatError: " + expected in root, root


def test_config_typo_is_said_once_and_last(tmp_path):
    config = _config(str(tmp_path))
    with open(config, "a") as f:
        f.write("trian:\n  seed: 1\n")
    out = str(tmp_path / "out")
    proc = _launch(config, out)
    rc = proc.wait(timeout=120)
    output = _output(proc)
    assert rc == 1, output
    assert output.count("unknown key 'trian'") == 1, output
    last = _last_line(output)
    assert last.startswith("error: ConfigError: ") and f"{config}:" in last and "'train'" in last, output
    assert "Traceback" not in output, output


def test_sigterm_saves_and_the_same_command_resumes_exactly_also_after_the_launcher_dies(tmp_path):
    """Uninterrupted 20 steps vs: SIGTERM to rank 1 alone (a preemption notice reaching one process) -> both ranks
    stop after the same step and save, train.sh returns 143; the same command resumes; SIGKILL of the launcher
    alone -> workers get SIGHUP (parent-death signal), save and exit; the same command finishes. Loss and grad
    norm equal the uninterrupted run at every step. (SIGTERM/SIGINT to train.sh itself takes the same path once
    torchrun forwards it to every rank.)"""
    tmp = str(tmp_path)
    config = _config(tmp)
    ref = run_text_task(config, 2, f"{tmp}/ref", FLAGS)
    out, again = f"{tmp}/run", ["--train.checkpoint.load_path", "auto"]

    proc = _launch(config, out, *again)
    _wait_for_step(proc, out, 4)
    os.kill(_children(proc.pid)[1][0], signal.SIGTERM)
    rc = proc.wait(timeout=60)
    first = read_metrics(out)[-1]["step"]
    saved = os.path.join(out, "checkpoints", f"global_step_{first}")
    assert rc == 143 and _last_line(_output(proc)).startswith(f"SIGTERM: stopped at step {first}; saved {saved}; ")
    assert list_checkpoints(os.path.join(out, "checkpoints")) == [first] and first < 20

    proc = _launch(config, out, *again)
    _wait_for_step(proc, out, first + 4)
    workers = [pid for pid, _ in _children(proc.pid)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"\nlauncher SIGKILLed: its workers saved and exited {_wait_gone(workers, 60):.1f} s later")
    second = read_metrics(out)[-1]["step"]
    kept = list_checkpoints(os.path.join(out, "checkpoints"))
    assert first < second < 20 and kept == [first, second], (first, second, kept, _output(proc)[-3000:])
    assert f"stopped at step {second}" in _output(proc)

    proc = _launch(config, out, *again)
    assert proc.wait(timeout=120) == 0, _output(proc)[-3000:]
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == list(range(1, 21))
    for a, b in zip(ref, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)


@pytest.mark.parametrize("loop_active", [False, True])
def test_first_stop_signal_sets_a_flag_in_the_loop_and_ends_set_up_at_once(loop_active):
    from veomni.trainer import lifecycle

    previous = {sig: signal.getsignal(sig) for sig in lifecycle.STOP_EXIT_CODES}
    lifecycle.install_stop_handlers()
    lifecycle.set_loop_active(loop_active)
    try:
        if loop_active:
            os.kill(os.getpid(), signal.SIGTERM)
            assert lifecycle.stop_requested() == signal.SIGTERM
        else:
            with pytest.raises(lifecycle.StopBeforeTraining):
                os.kill(os.getpid(), signal.SIGTERM)
    finally:
        lifecycle._state.update(stop_signal=None, loop_active=False, exiting=False)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _DictStore:
    """The few c10d store calls the heartbeat makes."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_heartbeat_starts_with_the_group_and_names_a_peer_stopped_before_its_first(monkeypatch):
    """The first beat follows the process group's start within a fraction of a second (not the 1 s beat), and a
    peer with no beat yet is said to have stopped before it, with the time since the group started: not "never
    reported", which read as if that rank had never started."""
    from veomni.trainer import lifecycle

    store, group = _DictStore(), threading.Event()
    monkeypatch.setattr(lifecycle, "default_store", lambda: store if group.is_set() else None)
    monkeypatch.setitem(lifecycle._state, "joined", None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    stop = threading.Event()
    beating = threading.Thread(target=lifecycle._heartbeat_loop, args=(stop,), daemon=True)
    beating.start()
    try:
        time.sleep(0.3)
        group.set()  # init_process_group
        started = time.time()
        while "veomni/heartbeat/0" not in store.data and time.time() - started < 2:
            time.sleep(0.01)
        assert time.time() - started < 0.5, "the first heartbeat waited for the 1 s beat"
    finally:
        stop.set()
        beating.join()
    monkeypatch.setattr(lifecycle, "_HEARTBEAT_SECONDS", 0.01)  # _stalled_peers waits 1.5 beats for live peers
    monkeypatch.setitem(lifecycle._state, "joined", time.time() - 12)
    store.set("veomni/heartbeat/2", json.dumps({"t": time.time() - 30, "step": 7, "phase": "forward"}))
    assert lifecycle._stalled_peers() == (
        "rank 1 silent since the process group started 12 s ago (stopped or hung before its first heartbeat); "
        "rank 2 silent for 30 s (last heartbeat in step 7, forward)"
    )


# ----------------------------------------------------------------------------------- failures on disk
@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny_state():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _two_checkpoints(folder):
    """Steps 1 and 2 of a tiny model saved in `folder`: (checkpointer, model, optimizer, step 2's folder, its shard)."""
    from veomni.checkpoint import Checkpointer

    model, optimizer = _tiny_state()
    checkpointer = Checkpointer(folder)
    checkpointer.save(1, model, optimizer, {}, {})
    newest = checkpointer.save(2, model, optimizer, {}, {})
    return checkpointer, model, optimizer, newest, os.path.join(newest, "model_optimizer", "__0_0.distcp")


def test_truncated_shard_names_the_file_and_the_previous_checkpoint(tmp_path, one_process_group):
    from veomni.checkpoint import CheckpointError

    checkpointer, model, optimizer, newest, shard = _two_checkpoints(str(tmp_path))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.load(newest, model, optimizer)
    message = str(caught.value)
    previous = os.path.join(str(tmp_path), "checkpoints", "global_step_1")
    assert shard in message and "truncated" in message, message
    assert f"--train.checkpoint.load_path {previous}" in message, message


def test_garbled_shard_of_the_right_size_is_a_checkpoint_error(tmp_path, one_process_group):
    """The sizes check passes; DCP's own failure (a BaseException) must still become a named CheckpointError."""
    from veomni.checkpoint import CheckpointError

    checkpointer, model, optimizer, newest, shard = _two_checkpoints(str(tmp_path))
    with open(shard, "r+b") as f:
        f.write(b"\0" * os.path.getsize(shard))
    with pytest.raises(CheckpointError) as caught:
        checkpointer.load(newest, model, optimizer)
    assert newest in str(caught.value) and "global_step_1" in str(caught.value), str(caught.value)


def test_disk_full_during_save_names_the_path_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, one_process_group
):
    """The rank's extra-state file is pointed at /dev/full, where every write fails with ENOSPC."""
    from veomni.checkpoint import Checkpointer, CheckpointError, list_checkpoints

    model, optimizer = _tiny_state()
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(1, model, optimizer, {"step": 1}, {})
    real_makedirs = os.makedirs

    def makedirs_onto_a_full_disk(path, *args, **kwargs):
        real_makedirs(path, *args, **kwargs)
        target = os.path.join(path, "rank_0.pt")
        if path.endswith(os.path.join("global_step_2.tmp", "extra_state")) and not os.path.islink(target):
            os.symlink("/dev/full", target)

    monkeypatch.setattr(os, "makedirs", makedirs_onto_a_full_disk)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(2, model, optimizer, {"step": 2}, {})
    message = str(caught.value)
    root = os.path.join(str(tmp_path), "checkpoints")
    assert os.path.join(root, "global_step_2.tmp") in message and "ENOSPC" in message, message
    assert list_checkpoints(root) == [1] and open(os.path.join(root, "latest")).read() == "global_step_1"
    assert not os.path.exists(os.path.join(root, "global_step_2.tmp"))  # the torn save is cleared away


def test_teardown_skips_the_barrier_while_an_exception_propagates(one_process_group, monkeypatch):
    # fixture order matters: monkeypatch is undone first, so the group fixture then really destroys the group
    """destroy_parallel_state() in a `finally:` must not wait for peers that are stuck in a collective."""
    import torch.distributed as dist

    from veomni.distributed import destroy_parallel_state

    barriers = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(1))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)  # the fixture destroys it
    with pytest.raises(ValueError):
        try:
            raise ValueError("bad record")
        finally:
            destroy_parallel_state()
    assert barriers == []
    destroy_parallel_state()
    assert barriers == [1]


def test_other_ranks_say_only_their_own_warnings(monkeypatch):
    """A warning about the whole run is said once, by rank 0; rank 1 says its errors and its own warnings."""
    import uuid

    from veomni.utils.logging import EVERY_RANK, get_logger

    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr("sys.stdout", __import__("io").StringIO())
        logger = get_logger(f"veomni.test_{uuid.uuid4().hex}")
        logger.info("an info line")
        logger.warning("a warning about the run")
        logger.warning("a bad record in this rank's share", extra=EVERY_RANK)
        logger.error("an error")
        said[rank] = __import__("sys").stdout.getvalue()
    assert all(line in said["0"] for line in ("an info line", "a warning about the run", "bad record", "an error"))
    assert "info line" not in said["1"] and "warning about the run" not in said["1"]
    assert "a bad record in this rank's share" in said["1"] and "an error" in said["1"]


@pytest.mark.parametrize(
    "signum, said",
    [
        (
            signal.SIGINT,
            "Ctrl-C (SIGINT) received: finishing the current step, then saving a checkpoint (a second Ctrl-C,",
        ),
        (signal.SIGTERM, "SIGTERM received: finishing the current step, then saving a checkpoint (a second SIGTERM to"),
    ],
)
def test_a_stop_request_is_answered_in_its_own_terms(monkeypatch, capfd, signum, said):
    """A Ctrl-C was answered with 'a second SIGTERM to the workers ... exits at once'."""
    from veomni.trainer import lifecycle

    monkeypatch.setitem(lifecycle._state, "handler_pid", os.getpid())
    monkeypatch.setitem(lifecycle._state, "stop_signal", None)
    monkeypatch.setitem(lifecycle._state, "loop_active", True)
    monkeypatch.setitem(lifecycle._state, "training_done", False)
    monkeypatch.setitem(lifecycle._state, "exiting", False)
    monkeypatch.setenv("RANK", "0")
    lifecycle._on_stop_signal(signum, None)
    assert said in capfd.readouterr().err
