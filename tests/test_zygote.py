"""The test launcher's fork server (tests/zygote.py) runs a script as `python script args` would: the same
argv, path, working directory, environment, streams, `__main__`, exit code and interpreter exit; and it really
forks (a launch's parent is the server, not this process)."""

import os
import signal
import sys

from helpers import ZYGOTES, child_env, run_python, start_ranks

SCRIPT = r"""
import atexit, json, os, sys, threading, time
import torch  # preloaded by the server: no import cost here

def bye():
    print("atexit ran", flush=True)

atexit.register(bye)
report = {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__, "file": __file__,
          "marker": os.environ.get("ZYGOTE_TEST_MARKER"), "rank": os.environ.get("RANK"),
          "ppid": os.getppid(), "sid": os.getsid(0) == os.getpid(), "torch": "torch" in sys.modules}
print(json.dumps(report), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "thread":  # a non-daemon thread still running at the end of the script is joined, as in python
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
elif mode == "exit":
    sys.exit(3)
elif mode == "raise":
    raise ValueError("boom")
elif mode == "wait":
    time.sleep(60)
"""


def _script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def test_a_forked_launch_is_the_script_run_by_python(tmp_path):
    import json

    script = _script(tmp_path)
    env = dict(child_env(), ZYGOTE_TEST_MARKER="here")
    work = tmp_path / "work"
    work.mkdir()
    done = run_python([sys.executable, script, "thread", "x y"], env=env, cwd=str(work), timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[0])
    assert report["argv"] == [script, "thread", "x y"] and report["file"] == script and report["name"] == "__main__"
    assert report["path0"] == str(tmp_path) and report["cwd"] == str(work) and report["marker"] == "here"
    assert report["sid"] and report["torch"]
    assert report["ppid"] != os.getpid()  # forked by the server: the test can fail if forking silently stops
    assert done.stdout.splitlines()[1:] == ["thread done", "atexit ran"] and done.stderr == "to stderr\n"


def test_exit_codes_exceptions_and_signals_are_those_of_python(tmp_path):
    script = _script(tmp_path)
    assert run_python([sys.executable, script, "exit"], env=child_env(), timeout=120).returncode == 3
    raised = run_python([sys.executable, script, "raise"], env=child_env(), timeout=120)
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: boom"), raised.stderr
    with open(os.devnull, "w") as null:
        (proc,) = start_ranks([sys.executable, script, "wait"], 1, child_env(), null, null)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM


def test_each_environment_gets_its_own_server(tmp_path):
    """A variable read at import time (HF_HOME, TRITON_INTERPRET, ...) must be the launch's: a launch whose
    environment differs from a running server's is forked from a server started with its environment."""
    script = _script(tmp_path)
    first = run_python([sys.executable, script, "-"], env=dict(child_env(), ZYGOTE_TEST_MARKER="a"), timeout=120)
    second = run_python([sys.executable, script, "-"], env=dict(child_env(), ZYGOTE_TEST_MARKER="b"), timeout=120)
    parents = {line.split('"ppid": ')[1].split(",")[0] for line in (first.stdout, second.stdout)}
    assert len(parents) == 2 and len(ZYGOTES.servers) <= ZYGOTES.keep
