"""Tiny, fast, real fixtures: an HF model config, a BPE tokenizer trained on the spot, jsonl data, and a
runner that launches a task under torchrun and reads back its metrics.jsonl."""

import atexit
import json
import os
import random
import subprocess
import sys
from typing import Dict, List, Optional

import yaml
from zygote import Zygotes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_cache": False,
    "attention_dropout": 0.0,
}


TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "use_cache": False,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
}


def write_moe_config(folder: str, **overrides) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**TINY_QWEN3_MOE, **overrides}, f)
    return folder


def write_model_config(folder: str, **overrides) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**TINY_QWEN2, **overrides}, f)
    return folder


def write_tokenizer(folder: str, vocab_size: int = 300) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog", "to be or not to be, that is the question"] * 20
    tok.train_from_iterator(text, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(
        folder
    )
    return folder


def write_token_data(path: str, n: int = 120, low: int = 16, high: int = 96, vocab: int = 512, seed: int = 0) -> str:
    """Pre-tokenised documents of random length and learnable content (arithmetic runs with a random start
    and stride), so parity tests need no tokenizer quirks and the loss visibly falls."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            start, stride = rng.randrange(vocab), rng.randint(1, 3)
            ids = [3 + (start + i * stride) % (vocab - 3) for i in range(rng.randint(low, high))]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def token_dataset(path: str, kind: str = "iterable", *, max_seq_len: int, seed: int = 3, **kw):
    """`build_dataset` over pre-tokenised records (`input_ids`, no tokenizer) cut to `max_seq_len`."""
    from functools import partial

    from veomni.data import build_dataset
    from veomni.data.data_transform import process_pretrain_example

    transform = partial(process_pretrain_example, tokenizer=None, max_seq_len=max_seq_len)
    return build_dataset(train_path=path, datasets_type=kind, transform=transform, seed=seed, **kw)


def token_loader(
    dataset, rank=0, dp=1, workers=0, *, max_seq_len, dyn=False, micro=2, dlbs=2, drop_last=False, seed=7, **kw
):
    """`build_dataloader` for data-parallel rank `rank` of `dp`, in the loader tests' short names."""
    from veomni.data import build_dataloader

    return build_dataloader(
        dataset=dataset,
        micro_batch_size=micro,
        dataloader_batch_size=dlbs,
        max_seq_len=max_seq_len,
        dyn_bsz=dyn,
        num_workers=workers,
        drop_last=drop_last,
        seed=seed,
        dp_rank=rank,
        dp_size=dp,
        **kw,
    )


def document_starts(micro_batch) -> List[int]:
    """The first token of each document (or piece) packed in a micro-batch: where its position ids restart at 0.
    The loader tests write documents whose first token names them."""
    import torch

    ids, pos = micro_batch["input_ids"][0], micro_batch["position_ids"][0]
    return [int(ids[i]) for i in torch.nonzero(pos == 0).flatten()]


def one_by_one(model, docs):
    """Loss sum and gradients of `docs` (dicts with `input_ids`) run through `model` one at a time, unpacked: the
    reference a packed micro-batch must equal. Leaves the model's gradients zeroed."""
    import torch

    from veomni.ops import lm_loss_sum, shift_labels

    total = 0.0
    for d in docs:
        ids = torch.tensor([d["input_ids"]])
        loss, _ = lm_loss_sum(model(input_ids=ids).logits, shift_labels(ids))
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return total, grads


def tiny_run_config(tmp: str, **train_overrides) -> str:
    """A YAML config for the tiny model on token data; returns its path."""
    model_dir = write_model_config(os.path.join(tmp, "model"))
    tok_dir = os.path.join(tmp, "tokenizer")
    if not os.path.isdir(tok_dir):
        write_tokenizer(tok_dir)
    data = os.path.join(tmp, "data.jsonl")
    if not os.path.isfile(data):
        write_token_data(data)
    config = {
        "model": {"config_path": model_dir, "tokenizer_path": tok_dir},
        "data": {"train_path": data, "max_seq_len": 128},
        "train": {
            "seed": 0,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "dyn_bsz": False,
            "max_steps": 10,
            "optimizer": {"lr": 3e-3, "lr_warmup_ratio": 0.2, "lr_decay_style": "cosine", "weight_decay": 0.1},
            "checkpoint": {"output_dir": os.path.join(tmp, "out")},
            "log_steps": 100,
        },
    }
    path = os.path.join(tmp, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def child_env(threads: int = 1) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    # a launch sets up its own world: rendezvous variables left by a process group made in the pytest process
    # (MASTER_PORT names a port that process may still hold: EADDRINUSE) must not reach it
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def torchrun_cmd(nproc: int, *argv: str) -> List[str]:
    """The command that launches `argv` (torchrun options, then a script and its arguments) on `nproc` local ranks,
    with a rendezvous on a free port (tests run side by side)."""
    rendezvous = ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *rendezvous, *argv]


def torchrun(
    script: str, args: List[str], nproc: int, timeout: int = 300, check: bool = True
) -> subprocess.CompletedProcess:
    """`script args` on `nproc` local ranks. A launch expected to succeed (`check`) starts its ranks directly with
    the variables torchrun would give them (`launch_ranks`): torchrun's agent process costs as much CPU as a rank's
    imports, and the suite makes hundreds of launches. A launch whose failure is under test goes through the real
    torchrun, whose failure handling (error files, the summary, tearing the others down) is part of what it tests."""
    env = child_env()
    if nproc == 1:  # plain `python` is a world of one (init_distributed): no launcher to start, seconds saved
        cmd = [sys.executable, script, *args]
        proc = run_python(cmd, env, timeout)
    elif check:
        cmd = [sys.executable, script, *args]
        proc = launch_ranks(cmd, nproc, env, timeout)
    else:
        cmd = torchrun_cmd(nproc, "--master_port=0", script, *args)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def start_ranks(cmd: List[str], nproc: int, env: Dict[str, str], stdout, stderr) -> list:
    """`cmd` started on `nproc` local ranks with torchrun's environment (one node, a fresh port), without its
    agent, each in a session of its own and killed when this process dies; their output to the given files. Returns
    the processes (`subprocess.Popen`, or `zygote.ForkedProcess`: the same poll, wait and signals)."""
    import socket

    with socket.socket() as s:  # a free port for rank 0's store (the ranks bind it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = {"WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1, "ROLE_WORLD_SIZE": nproc,
             "GROUP_RANK": 0, "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}  # fmt: skip
    rank_envs = [
        {**env, **{k: str(v) for k, v in world.items()}, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}
        for r in range(nproc)
    ]
    if _forking(cmd, env):
        return [ZYGOTES.start(cmd, REPO, rank_env, stdout, stderr) for rank_env in rank_envs]
    die_with_parent = _parent_death_signal()
    return [
        subprocess.Popen(
            cmd, cwd=REPO, stdout=stdout, stderr=stderr, start_new_session=True, preexec_fn=die_with_parent, env=e
        )
        for e in rank_envs
    ]


def launch_ranks(cmd: List[str], nproc: int, env: Dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`start_ranks` and wait: the ranks' output goes to one stdout and one stderr as under torchrun; when a rank
    fails the others are stopped (SIGTERM, then SIGKILL after a grace period) and the first failure's exit code is
    returned."""
    import signal
    import tempfile
    import time

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        ranks = start_ranks(cmd, nproc, env, out, err)
        deadline, code, stop_at = time.monotonic() + timeout, 0, None
        while any(p.poll() is None for p in ranks):
            failed = [p.returncode for p in ranks if p.returncode not in (None, 0)]
            if failed and stop_at is None:  # torchrun's way: the others are told to stop, then killed
                code, stop_at = failed[0], time.monotonic() + 15
                for p in ranks:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
            if time.monotonic() > deadline or (stop_at is not None and time.monotonic() > stop_at):
                for p in ranks:
                    if p.poll() is None:
                        p.kill()
                if stop_at is None:
                    [p.wait() for p in ranks]
                    raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        code = code or next((p.returncode for p in ranks if p.returncode), 0)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


ZYGOTES = Zygotes()
atexit.register(ZYGOTES.close)  # the servers' CPU time is counted in this process's children once they are reaped


def _forking(cmd: List[str], env: Dict[str, str]) -> bool:
    """Whether `cmd` is launched as a fork of an imported server (tests/zygote.py): every `python script.py`,
    except under Triton's interpreter (tests/triton_interpreter.py must patch Triton before torch imports it) or
    when VEOMNI_TEST_FORK=0 asks for plain processes (to rule the servers out when chasing a failure)."""
    wanted = os.environ.get("VEOMNI_TEST_FORK", "1") != "0" and "TRITON_INTERPRET" not in env
    return wanted and Zygotes.forkable(cmd)


def run_python(
    cmd: List[str], env: Dict[str, str], timeout: Optional[float] = None, cwd: str = REPO, check: bool = False
) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=check)` for a
    `python script.py ...` command, forked from an imported server where it can be (tests/zygote.py)."""
    if not _forking(cmd, env):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=check)
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = ZYGOTES.start(cmd, cwd, env, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(cmd, code, out.read(), err.read())
    if check:
        done.check_returncode()
    return done


def _parent_death_signal():
    """A function for launch_ranks' children to call between fork and exec: SIGKILL when the test process that
    launched them dies (Linux's PR_SET_PDEATHSIG), so a killed pytest worker leaves no rank behind waiting in a
    collective. Resolved here, in the parent: the child only makes the one C call (no import, no lookup)."""
    import ctypes
    import functools
    import signal

    if not sys.platform.startswith("linux"):
        return None
    return functools.partial(ctypes.CDLL(None).prctl, 1, int(signal.SIGKILL))


def read_metrics(output_dir: str) -> List[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_text_task(config: str, nproc: int, out: str, extra: Optional[List[str]] = None) -> List[dict]:
    torchrun(
        os.path.join(REPO, "tasks", "train_text.py"),
        [config, "--train.checkpoint.output_dir", out, *(extra or [])],
        nproc,
    )
    return read_metrics(out)


def launch_sequence(nproc: int, runs: List[tuple], check: bool = True) -> subprocess.CompletedProcess:
    """Several trainings, one after another in ONE launch (tests/dist/trainer_scenarios.py `sequence`), each
    given as (scenario, config, output_dir, extra flags); "plain" is the TextTrainer as tasks/train_text.py runs it.
    A launch's start-up (imports on every rank) costs more than a tiny run, so tests that compare runs on the same
    world size share one. Resumes stay in launches of their own: a fresh process is what they prove."""
    argv = ["sequence"]
    for i, (scenario, config, out, extra) in enumerate(runs):
        argv += (["::"] if i else []) + [scenario, config, "--train.checkpoint.output_dir", out, *extra]
    return torchrun(os.path.join(REPO, "tests", "dist", "trainer_scenarios.py"), argv, nproc, check=check)


def run_text_tasks(nproc: int, runs: List[tuple]) -> List[List[dict]]:
    """`launch_sequence` of plain trainings given as (config, output_dir, extra flags): each run's metrics."""
    launch_sequence(nproc, [("plain", config, out, extra) for config, out, extra in runs])
    return [read_metrics(out) for _, out, _ in runs]


def assert_close_series(a: List[float], b: List[float], rtol: float, what: str) -> None:
    assert len(a) == len(b) and len(a) > 0, f"{what}: {len(a)} vs {len(b)} steps"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12), f"{what} differs at step {i + 1}: {x!r} vs {y!r}"


def descendants(pid: int) -> List[int]:
    """Every process below `pid` (torchrun's workers run in sessions of their own)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and all its descendants at once, as a node failure would."""
    import signal

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
