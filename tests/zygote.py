"""Launch test processes by forking a server that has already imported torch, transformers and veomni.

A rank's imports cost about 9 CPU-seconds on the 2-core CI box and the suite starts hundreds of ranks: most of
its CPU went to importing the same modules again and again. The server (one per pytest worker and environment)
imports them once; each launch is a fork of it that then runs its script as `python script args` would: its own
session, environment, working directory, `sys.argv`, `sys.path[0]`, standard streams (the caller's file
descriptors, passed over a Unix socket) and `__main__`, and a normal interpreter exit (atexit, thread joins).

A forked process is as fresh as a new one for what the tests prove (no process group, no model, no data state:
the server only imports, single-threaded -- the environment pins OpenMP to one thread -- and never computes).
What it cannot give is an environment read at import time that differs from the server's: a launch whose
environment differs from every running server's gets a server of its own (`Zygotes.spawn`), which costs one
import, still less than the plain launch of two ranks.

Run as a script, this file is the server: `python tests/zygote.py SOCKET` (the launcher side is `Zygotes`).
"""

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from typing import Dict, List, Optional

# what a rank of the tasks and test scripts imports; anything else a script needs it imports itself
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers.modeling_utils",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.llama.modeling_llama",
    "veomni.trainer",
    "veomni.trainer.task",
    "veomni.plan.runlog",
)
# set per rank by the launcher: the only variables allowed to differ between a server and the launches it forks
RANK_VARIABLES = frozenset(
    "RANK LOCAL_RANK ROLE_RANK GROUP_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_WORLD_SIZE ROLE_WORLD_SIZE ROLE_NAME "
    "MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS".split()
)
PR_SET_PDEATHSIG = 1


# --- the server -------------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _serve(path: str) -> dict:
    """Accept launches until killed. Returns only in a forked child, with the launch it is to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)  # the launcher waits for this line before its first connect
    waiting: Dict[int, socket.socket] = {}  # pid -> the connection that is told its exit code
    while True:
        if select.select([listener], [], [], 0.02)[0]:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (conn, *waiting.values()):
                    other.close()
                return {**json.loads(message), "fds": fds}
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:  # the exit code, and the CPU seconds (the launcher's own rusage never sees a grandchild's)
                conn.sendall(f"{os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime}\n".encode())
            except OSError:  # the launcher is gone: nobody to tell
                pass
            conn.close()


def _become(job: dict) -> None:
    """In the forked child: turn into `python script args` run from `cwd` with `env` and the passed streams."""
    os.setsid()
    _die_with_parent()  # the server dies with its pytest worker, and the launch with the server
    for fd, target in zip(job["fds"], (0, 1, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    script = job["argv"][0]
    sys.argv = list(job["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))


def _quiet_teardown() -> None:
    """The interpreter's teardown never frees the frozen objects, so libtriton's nanobind (triton 3.9) reports each
    of its objects still alive as leaked, on stderr, where a plain `python script` frees them silently. Unfreezing
    them costs a full collection (about 1 s per launch), so -- as triton does for its own worker processes -- the
    teardown's stderr is dropped, once every exit handler has run, when triton was loaded."""
    if "triton" in sys.modules:
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def main() -> None:
    import gc

    _die_with_parent()
    for name in PRELOAD:
        __import__(name)
    # the imported objects move to a generation the collector never scans: a forked child's collections would
    # otherwise touch (and so copy) every page of the server's heap
    gc.freeze()
    job = _serve(sys.argv[1])
    _become(job)
    import atexit
    import runpy

    atexit.register(_quiet_teardown)  # registered first, so it runs after the script's own exit handlers

    runpy.run_path(job["argv"][0], run_name="__main__")


# --- the launcher -----------------------------------------------------------------------------------------------


class ForkedProcess:
    """The part of `subprocess.Popen` the tests use, for a process a server forked: pid, poll, wait, signals."""

    cpu_seconds = 0.0  # of every forked process that has ended, for a profiler to add to this process's children

    def __init__(self, server: str, argv: List[str], cwd: str, env: Dict[str, str], streams: List[int]):
        self.args, self.returncode = argv, None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(server)
        socket.send_fds(self._conn, [json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()], streams)
        self._reply = self._conn.makefile("r")
        self.pid = int(self._reply.readline())

    def poll(self) -> Optional[int]:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        return self.returncode

    def _read_exit(self) -> None:
        code, cpu = self._reply.readline().split() or [-signal.SIGKILL, 0.0]  # nothing: the server died under it
        self.returncode = int(code)
        ForkedProcess.cpu_seconds += float(cpu)
        self._reply.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygotes:
    """This pytest worker's servers, one per launch environment, the least recently used stopped beyond `keep`
    (each holds the imported modules' memory)."""

    def __init__(self, keep: int = 2):
        self.keep, self.servers = keep, {}  # environment key -> (process, socket path), most recent last

    @staticmethod
    def forkable(argv: List[str]) -> bool:
        """`python script.py ...` (not -m, -c or another program): what a fork can become."""
        return len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py")

    def start(self, argv: List[str], cwd: str, env: Dict[str, str], stdout=None, stderr=None) -> ForkedProcess:
        """`argv` (a `forkable` command) forked from the server for `env`, its output to the given files."""
        server = self._server(env)
        null = os.open(os.devnull, os.O_RDWR)
        try:
            streams = [null, *(f.fileno() if f is not None else n for f, n in ((stdout, 1), (stderr, 2)))]
            return ForkedProcess(server, argv[1:], cwd, env, streams)
        finally:
            os.close(null)

    def _server(self, env: Dict[str, str]) -> str:
        key = json.dumps(sorted((k, v) for k, v in env.items() if k not in RANK_VARIABLES))
        if key in self.servers:
            self.servers[key] = self.servers.pop(key)  # most recently used last
            return self.servers[key][1]
        while len(self.servers) >= self.keep:
            self._stop(next(iter(self.servers)))
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="veomni-zygote-"), "socket")
        server_env = {k: v for k, v in env.items() if k not in RANK_VARIABLES}
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), path], env=server_env, stdout=subprocess.PIPE, text=True
        )
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the launch server did not start (exit code {proc.wait()})")
        self.servers[key] = (proc, path)
        return path

    def _stop(self, key: str) -> None:
        proc, path = self.servers.pop(key)
        proc.kill()
        proc.wait()
        proc.stdout.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # gone already when the session's scratch went first

    def close(self) -> None:
        for key in list(self.servers):
            self._stop(key)


if __name__ == "__main__":
    main()
