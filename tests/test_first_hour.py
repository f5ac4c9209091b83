"""The first hour of a new user: resume by default, nothing overwritten, --help, exact step counts, early and
specific errors (zero steps, every record failing, a batch that does not split over the ranks)."""

import dataclasses
import glob
import json
import os
import stat
import subprocess
import sys
from functools import partial

import pytest

from helpers import REPO, child_env, read_metrics, run_python, tiny_run_config, write_token_data
from veomni.arguments import ConfigError, VeOmniArguments, parse_args
from veomni.arguments.parser import _field_types, format_help
from veomni.checkpoint import RunDirError, list_checkpoints, move_run_aside, plan_run

TASK = os.path.join(REPO, "tasks", "train_text.py")


def _train(config, out, *extra, check=True):
    """The trainer as a plain 1-process `python` run (no launcher: seconds saved per run)."""
    proc = run_python(
        [sys.executable, TASK, config, "--train.checkpoint.output_dir", out, *extra], env=child_env(), timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _fake_checkpoint(out, step):
    folder = os.path.join(out, "checkpoints", f"global_step_{step}")
    os.makedirs(folder)
    open(os.path.join(folder, "meta.json"), "w").write("{}")
    return folder


# ------------------------------------------------------------------------------- resume by default
def test_plan_resumes_by_default_and_never_overwrites(tmp_path):
    out = str(tmp_path / "run")
    assert plan_run(out, "auto").load_path is None  # nothing there: fresh
    _fake_checkpoint(out, 2)
    newest = _fake_checkpoint(out, 4)
    open(os.path.join(out, "metrics.jsonl"), "w").write('{"step": 1}\n')
    plan = plan_run(out, "auto")
    assert plan.load_path == newest and not plan.move_aside and "resuming" in plan.message
    with pytest.raises(RunDirError, match="overwrite true"):  # `load_path: null` alone must not clobber it
        plan_run(out, None)
    with pytest.raises(RunDirError, match="already holds another run"):  # nor a checkpoint of another run
        plan_run(out, _fake_checkpoint(str(tmp_path / "other"), 1))
    plan = plan_run(out, "auto", overwrite=True)
    assert plan.load_path is None and plan.move_aside
    moved = move_run_aside(out)
    assert os.path.basename(moved).startswith("run.old-") and list_checkpoints(f"{moved}/checkpoints") == [2, 4]
    assert open(f"{moved}/metrics.jsonl").read() == '{"step": 1}\n' and plan_run(out, None).load_path is None


def test_plan_keeps_the_files_of_a_run_that_never_saved(tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(f"{out}/checkpoints/global_step_5.tmp")  # died mid-save, before any complete checkpoint
    open(f"{out}/metrics.jsonl", "w").write('{"step": 1}\n')
    plan = plan_run(out, "auto")
    assert plan.load_path is None and plan.move_aside  # fresh start, but the old files are kept aside


def test_rerun_resumes_counts_exactly_and_overwrite_moves_the_old_run_aside(tmp_path):
    """Three real runs of the same command: cut short by max_steps, re-run without the cap (resumes, and runs
    exactly the counted steps of the data), then started over (the old run moved aside, not deleted)."""
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=50, low=20, high=200)
    config, out = tiny_run_config(tmp), f"{tmp}/run"
    flags = ["--train.dyn_bsz", "true", "--train.checkpoint.save_steps", "2"]
    _train(config, out, "--train.max_steps", "3", *flags)
    first = read_metrics(out)
    proc = _train(config, out, "--train.max_steps", "null", *flags)  # the same command again, uncapped
    assert "holds a run: resuming from" in proc.stdout and "global_step_3" in proc.stdout
    counted = int(proc.stdout.split(" steps per epoch (counted from the data")[0].rsplit("] ", 1)[1])
    again = read_metrics(out)
    assert [m["step"] for m in again] == list(range(1, counted + 1)) and again[:3] == first  # continued
    assert "ran out of data" not in proc.stdout and counted > 3
    # progress for a log file: the start line with the set-up time, then step/total with elapsed and ETA
    assert f"training starts (resumed at step 3): steps 4..{counted}; set-up took" in proc.stdout
    assert f"step {counted}/{counted}: loss" in proc.stdout and "elapsed, ETA 0:00" in proc.stdout

    proc = _train(config, out, "--train.max_steps", "1", "--train.checkpoint.overwrite", "true")
    (old,) = glob.glob(f"{out}.old-*")
    assert f"previous run moved to {old}" in proc.stdout
    assert [m["step"] for m in read_metrics(old)] == list(range(1, counted + 1))
    assert list_checkpoints(f"{old}/checkpoints")[-1] == counted  # nothing of the old run was deleted
    assert [m["step"] for m in read_metrics(out)] == [1] and list_checkpoints(f"{out}/checkpoints") == [1]


# ------------------------------------------------------------------------------------- step counts
@pytest.mark.parametrize(
    "dyn_bsz,workers,drop_last,dp_size",
    [(True, 0, True, 1), (True, 0, True, 2), (False, 0, False, 2), (True, 2, True, 1)],
)
def test_step_count_equals_the_batches_the_loader_yields(tmp_path, dyn_bsz, workers, drop_last, dp_size):
    from veomni.data import build_dataloader, build_dataset, process_pretrain_example

    data = write_token_data(str(tmp_path / "d.jsonl"), n=90, low=10, high=300)
    dataset = build_dataset(
        "mapping", partial(process_pretrain_example, tokenizer=None, max_seq_len=64), train_path=data
    )
    for dp_rank in range(dp_size):
        loader = build_dataloader(
            dataset=dataset,
            micro_batch_size=2,
            dataloader_batch_size=3,
            max_seq_len=64,
            dyn_bsz=dyn_bsz,
            num_workers=workers,
            drop_last=drop_last,
            dp_rank=dp_rank,
            dp_size=dp_size,
            collate_fn_kwargs={"pad_token_id": 0},
        )
        counted = loader.num_batches()
        assert counted == sum(1 for _ in loader) > 0
        assert loader.num_batches(limit=3) == 3 and loader.num_batches() == counted  # the count changes nothing


def test_zero_step_run_is_refused_before_the_model_is_built(tmp_path):
    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    zero = _train(config, f"{tmp}/zero", "--train.global_batch_size", "4096", check=False)
    assert zero.returncode != 0 and "this run would train 0 steps" in zero.stderr
    assert "parameters" not in zero.stdout and not os.path.exists(f"{tmp}/zero/checkpoints")


def _step_plan(argv, epoch_batches):
    """(trainer, what step_count logged): only the step computation of a BaseTrainer, on a loader that yields
    `epoch_batches` batches an epoch."""
    import logging

    from veomni.trainer.base import BaseTrainer

    args = parse_args(VeOmniArguments, argv)

    class Probe(BaseTrainer):
        def __init__(self):
            self.args, self.train_dataset, self.train_dataloader = args, [], None

        def _count_loader_steps(self, limit):
            return min(epoch_batches, limit or epoch_batches)

    probe, records, handler = Probe(), [], logging.Handler()
    handler.emit = records.append
    logging.getLogger("veomni.trainer.step_count").addHandler(handler)
    try:
        probe.compute_train_steps()
    finally:
        logging.getLogger("veomni.trainer.step_count").removeHandler(handler)
    return probe, " ".join(r.getMessage() for r in records)


def test_max_steps_beyond_the_data_says_what_happens(tmp_path):
    probe, text = _step_plan(["--train.max_steps", "20", "--train.dyn_bsz", "false"], 6)
    assert probe.total_steps == 6 and "--train.num_train_epochs 4" in text and "the LR schedule spans 6" in text
    probe._count_loader_steps = lambda limit: 0  # data that fills no global batch: an error, not an empty run
    with pytest.raises(ConfigError, match="this run would train 0 steps"):
        probe.compute_train_steps()


@pytest.mark.parametrize("max_steps, epochs", [(5, [5, 0]), (40, [31, 9]), (62, [31, 31]), (None, [31, 31])])
def test_max_steps_is_the_total_of_the_run(max_steps, epochs):
    """`--train.max_steps 5` on a 2-epoch config trained 10 steps and spanned the LR schedule over 10 (a cap per
    epoch); HF Trainer, LLaMA-Factory and torchtitan mean the run's total. The start line says where it stops."""
    argv = ["--train.num_train_epochs", "2", "--train.dyn_bsz", "false"]
    probe, text = _step_plan(argv + (["--train.max_steps", str(max_steps)] if max_steps else []), 31)
    assert probe.epoch_steps == epochs and probe.total_steps == sum(epochs), text
    assert f"the LR schedule spans {sum(epochs)}" in text
    assert ("train.max_steps 5 stops the run there" in text) == (max_steps == 5)
    assert probe.whole_epochs == (sum(epochs) == 62)


# ------------------------------------------------------------------------------------- early errors
class _CharTokenizer:
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 500 + 1 for c in text]


def _dataset_of(tmp_path, records):
    from veomni.data import build_dataset, process_pretrain_example

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    transform = partial(process_pretrain_example, tokenizer=_CharTokenizer(), max_seq_len=64)
    return build_dataset("mapping", transform, train_path=str(path), skip_bad_samples=True)


def test_every_record_failing_names_the_key_that_would_fix_it(tmp_path):
    from veomni.data import DataFormatError
    from veomni.trainer.preflight import check_first_records

    records = [{"id": str(i), "content": "some long text " * (i + 1)} for i in range(20)]
    args = parse_args(VeOmniArguments, ["--data.skip_bad_samples", "true"])  # skipping would train nothing
    with pytest.raises(DataFormatError, match=r"all of the first 16 records fail the same way: no text key \['text'\]"):
        check_first_records(_dataset_of(tmp_path, records), args.data)
    with pytest.raises(
        DataFormatError, match=r"set --data.text_keys content \(fields of that kind: \['content', 'id'\]"
    ):
        check_first_records(_dataset_of(tmp_path, records), args.data)
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    with pytest.raises(DataFormatError, match="set --data.data_type conversation"):
        check_first_records(_dataset_of(tmp_path, chats), args.data)
    check_first_records(_dataset_of(tmp_path, [{"text": "fine"}] + records), args.data)  # one good record: ok


def test_batch_that_does_not_split_names_the_nearest_valid_values(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    demo = os.path.join(REPO, "configs", "text", "demo.yaml")
    with pytest.raises(ValueError) as err:
        parse_args(VeOmniArguments, [demo])
    message = str(err.value)
    assert "global_batch_size=8 does not split over 3 data-parallel ranks" in message
    assert "train.global_batch_size 12" in message and "1 or 2 data-parallel ranks" in message
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"train.global_batch_size 4 or 8; train.micro_batch_size 1 or 3"):
        parse_args(VeOmniArguments, ["--train.micro_batch_size", "2", "--train.global_batch_size", "6"])
    monkeypatch.setenv("WORLD_SIZE", "3")  # only a per-device batch: any world size works
    args = parse_args(VeOmniArguments, [demo, "--train.global_batch_size", "null"])
    assert args.train.global_batch_size == 12 and args.train.dataloader_batch_size == 1


# ------------------------------------------------------------------------------------------- --help
def _leaves(cls, prefix=""):
    """(dotted key, doc) of every user key, walking the dataclasses themselves (not the help text)."""
    types = _field_types(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(types[f.name]):
            yield from _leaves(types[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.metadata.get("help", "")


def test_help_lists_every_key_with_type_default_and_doc(capsys):
    with pytest.raises(SystemExit) as done:
        parse_args(VeOmniArguments, ["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    leaves = dict(_leaves(VeOmniArguments))
    assert len(leaves) > 80
    for key, doc in leaves.items():
        assert doc, f"{key} has no doc where it is defined"
        assert f"--{key}  (" in text and f"\n      {doc.split()[0]}" in text.split(f"--{key}  (", 1)[1][:300], key
    assert "--train.optimizer.lr  (float; default: 5e-05)\n      Peak learning rate." in text
    assert "train.checkpoint:  Outputs and checkpoints." in text  # groups are headed by their docstring
    narrow = format_help(VeOmniArguments, "train.optimizer")
    assert "--train.optimizer.lr  (" in narrow and "--data." not in narrow and "--train.seed" not in narrow
    with pytest.raises(ConfigError, match="did you mean 'train.optimizer'"):
        format_help(VeOmniArguments, "train.optimzer")


def test_help_through_the_task_and_train_sh():
    env = dict(child_env(), PYTHON=sys.executable)
    for cmd in (
        [sys.executable, TASK, "--help"],
        ["bash", "train.sh", "tasks/train_text.py", "--help", "train.optimizer"],
    ):
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.count("--train.optimizer.lr  (") == 1, proc.stderr
    assert "--data.train_path" not in proc.stdout  # narrowed to the group


def test_package_has_a_description():
    import veomni

    assert "training" in (veomni.__doc__ or "")


def test_exported_safetensors_are_readable_by_others(tmp_path):
    import torch

    from veomni.checkpoint.safetensors_layout import Layout, shard_names

    def write_safetensors(tensors, out_dir, files=1):  # the export's writer: one file, or one tensor per file
        specs = [[(n, tuple(t.shape), t.dtype)] for n, t in tensors.items()]
        layout = Layout(dict(zip(shard_names(files), specs if files > 1 else [sum(specs, [])])))
        layout.create(out_dir)
        for name, tensor in tensors.items():
            layout.write(out_dir, name, tensor)
        layout.close()

    old = os.umask(0o022)
    try:
        write_safetensors({"w": torch.zeros(2)}, str(tmp_path / "one"))
        write_safetensors({"a": torch.zeros(4), "b": torch.zeros(4)}, str(tmp_path / "two"), files=2)
    finally:
        os.umask(old)
    files = glob.glob(str(tmp_path / "*" / "*.safetensors"))
    assert len(files) == 3
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o644 for f in files)


def test_a_completed_run_is_refused_and_a_changed_schedule_is_said(tmp_path):
    """Re-running a finished command trains nothing: it stops with one line and exit 1 (not `steps 4..3` and 0).
    A resume with another LR and max_steps prints what changed and follows the new schedule from the resume step:
    its learning rates equal those of a fresh run under the new settings."""
    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=60, low=20, high=120)
    config, out = tiny_run_config(tmp), f"{tmp}/run"
    _train(config, out, "--train.max_steps", "3")
    proc = _train(config, out, "--train.max_steps", "3", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "holds a completed run (checkpoint of step 3" in said, said[-2000:]
    assert "--train.checkpoint.overwrite true" in said and "training starts" not in said
    assert "resuming from" not in said  # it does not resume: no line may say it does
    new = ["--train.max_steps", "6", "--train.optimizer.lr", "1e-2"]
    proc = _train(config, out, *new)
    assert "train.max_steps: 3 -> 6; train.optimizer.lr: 0.003 -> 0.01" in proc.stdout
    assert "the learning-rate schedule follows this run's settings from the resume step on" in proc.stdout
    _train(config, f"{tmp}/fresh", *new)
    resumed, fresh = read_metrics(out), read_metrics(f"{tmp}/fresh")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    assert [m["lr"] for m in resumed[3:]] == [m["lr"] for m in fresh[3:]]


def test_model_path_on_the_command_line_beats_the_yaml_config_path(tmp_path):
    from veomni.arguments import VeOmniArguments, parse_args

    config = tiny_run_config(str(tmp_path))
    hf = str(tmp_path / "hf_model")
    os.makedirs(hf)
    args = parse_args(VeOmniArguments, [config, "--model.model_path", hf])
    assert args.model.config_path == hf and args.model.tokenizer_path == hf
    keep = str(tmp_path / "tokenizer")
    args = parse_args(VeOmniArguments, [config, "--model.model_path", hf, "--model.tokenizer_path", keep])
    assert args.model.config_path == hf and args.model.tokenizer_path == keep
    args = parse_args(VeOmniArguments, [config])  # the YAML alone: its own paths
    assert args.model.config_path == str(tmp_path / "model")


def test_a_run_says_what_a_step_holds_and_nothing_false_at_its_end(tmp_path):
    """2 ranks, stopped by max_steps mid-epoch: the start says what a step holds; the end does not claim the epoch
    left data out (it did not end), torchdata's deprecation noise is gone, and --help says what a batch is."""
    from helpers import torchrun

    tmp = str(tmp_path)
    write_token_data(f"{tmp}/data.jsonl", n=200, low=20, high=120)
    config = tiny_run_config(tmp)
    proc = torchrun(TASK, [config, "--train.max_steps", "2", "--train.dyn_bsz", "true",
                           "--train.checkpoint.output_dir", f"{tmp}/run"], 2)  # fmt: skip
    said = proc.stdout + proc.stderr
    assert "a step packs up to 1,024 tokens (dyn_bsz: global_batch_size 8 x max_seq_len 128)" in said
    assert "left out" not in said and "set_vital" not in said, said[-3000:]
    help_text = subprocess.run([sys.executable, TASK, "--help", "train"], capture_output=True, text=True).stdout
    assert "with dyn_bsz (the default) a token budget of global_batch_size * max_seq_len tokens" in " ".join(
        help_text.split()
    )


def test_a_missing_demo_asset_names_the_command_that_builds_it(tmp_path):
    """README's SFT `--preview` on a fresh clone said only `tokenizer not found: .assets/chat/tokenizer`."""
    from veomni.data.readers import resolve_data_files
    from veomni.models import build_tokenizer

    chat = str(tmp_path / ".assets" / "chat")
    with pytest.raises(FileNotFoundError, match=r"build it with `python -m veomni.utils.demo_assets --chat`"):
        build_tokenizer(os.path.join(chat, "tokenizer"))
    with pytest.raises(FileNotFoundError, match=r"build it with `python -m veomni.utils.demo_assets`"):
        resolve_data_files(str(tmp_path / ".assets" / "shakespeare" / "train.jsonl"))
    with pytest.raises(FileNotFoundError) as err:  # not a demo asset: no hint
        build_tokenizer(str(tmp_path / "my_tokenizer"))
    assert "demo_assets" not in str(err.value)
