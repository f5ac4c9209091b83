"""SFT without silent traps (#26): the tokenizer's own chat template by default (real Qwen3), thinking blocks trained
or masked as configured, Alpaca records, and `--preview` marking exactly what carries loss."""

import json
import logging
import os
import sys

import pytest
import yaml
from real_tokenizers import real_tokenizer_dir
from transformers import AutoTokenizer

from helpers import REPO, child_env, run_python, write_model_config, write_tokenizer
from veomni.arguments import VeOmniArguments, parse_args
from veomni.data.data_transform import IGNORE_INDEX, DataFormatError

REASONING = [  # Qwen3 drops the reasoning of turns before the last user query
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\n\nIt is 6."},
]
NO_REASONING = [  # Qwen3 writes an empty <think></think> block into the last turn
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
EXPECTED = {  # the texts the preview marks, per think_loss
    "train": [
        ["It is 4.<|im_end|>", "<think>\nadd again\n</think>\n\nIt is 6.<|im_end|>"],
        ["<think>\n\n</think>\n\nParis.<|im_end|>"],
    ],
    "mask": [["It is 4.<|im_end|>", "It is 6.<|im_end|>"], ["Paris.<|im_end|>"]],
}


@pytest.fixture(scope="module")
def qwen3():
    return real_tokenizer_dir("qwen3")


def _config(tmp, tokenizer_dir, records, **data):
    os.makedirs(tmp, exist_ok=True)
    path = os.path.join(tmp, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    model = write_model_config(os.path.join(tmp, "model"), vocab_size=152000)
    config = {
        "model": {"config_path": model, "tokenizer_path": tokenizer_dir},
        "data": {"train_path": path, "data_type": "conversation", "max_seq_len": 512, **data},
        "train": {"micro_batch_size": 1, "checkpoint": {"output_dir": os.path.join(tmp, "out")}},
    }
    with open(os.path.join(tmp, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    return os.path.join(tmp, "config.yaml")


def _transform(config, *cli):
    """The trainer's own transform for this config (no model, no process group)."""
    from veomni.trainer import TextTrainer

    trainer = TextTrainer.__new__(TextTrainer)
    trainer.args, trainer.is_main = parse_args(VeOmniArguments, [config, *cli]), True
    return trainer, trainer.build_data_transform()


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _captured(name):
    __import__(name)  # its logger gets its handler and level first (get_logger leaves a logger with handlers as is)
    handler = _Captured()
    logging.getLogger(name).addHandler(handler)
    return handler


def test_conversations_default_to_the_tokenizers_own_template_real_qwen3(tmp_path, qwen3):
    """Trap 1: the default trained Qwen3 on a plain `User:/Assistant:` format; now the ids are Qwen3's own
    apply_chat_template, a log line says so, and another template is warned about."""
    tok = AutoTokenizer.from_pretrained(qwen3)
    config = _config(str(tmp_path), qwen3, [{"messages": NO_REASONING}])
    log = _captured("veomni.trainer.text_trainer")
    try:
        trainer, transform = _transform(config)
        [sample] = transform({"messages": NO_REASONING})
        expected = tok.apply_chat_template(NO_REASONING, tokenize=True)
        assert sample["input_ids"] == list(expected if isinstance(expected, list) else expected["input_ids"])
        assert trainer.training_chat_template == tok.chat_template
        assert any(level == "INFO" and "chat template: the tokenizer's own" in m for level, m in log.lines)
        assert not any(level == "WARNING" for level, _ in log.lines)
        _transform(config, "--data.chat_template", "chatml")  # a choice still, but said at start
        assert any(level == "WARNING" and "not the tokenizer's own chat template" in m for level, m in log.lines)
    finally:
        logging.getLogger("veomni.trainer.text_trainer").removeHandler(log)
    plain = write_tokenizer(str(tmp_path / "plain"))  # no chat template: the plain format, as before
    _, transform = _transform(_config(str(tmp_path / "p"), plain, [{"messages": NO_REASONING}]))
    assert type(transform.keywords["chat_template"]).__name__ == "DefaultTemplate"


@pytest.mark.parametrize("think_loss", ["train", "mask"])
def test_preview_marks_exactly_the_assistant_tokens_of_real_qwen3(tmp_path, qwen3, think_loss):
    """Trap 6: what carries loss is shown: the marked text is exactly each assistant turn as Qwen3 renders it with
    its end-of-turn token, its <think> block (also the empty one) marked or not as data.think_loss says."""
    from veomni.trainer.preview import loss_flags, marked_spans, render_sample

    config = _config(str(tmp_path), qwen3, [{"messages": NO_REASONING}])
    trainer, transform = _transform(config, "--data.think_loss", think_loss)
    for conversation, expected in zip([REASONING, NO_REASONING], EXPECTED[think_loss]):
        [sample] = transform({"messages": conversation})
        rendered = render_sample(trainer.tokenizer, sample["input_ids"], sample["labels"])
        assert marked_spans(rendered) == expected
        assert rendered.replace("[[", "").replace("]]", "") == trainer.tokenizer.decode(sample["input_ids"])
        flags = loss_flags(sample["labels"])  # exactly the labelled tokens are marked, each labelled by itself
        assert sum(flags) == sum(lab != IGNORE_INDEX for lab in sample["labels"])
        assert all(lab == t for t, lab, f in zip(sample["input_ids"], sample["labels"], flags) if f)


def test_preview_command_shows_samples_packing_and_steps_without_a_model(tmp_path, qwen3):
    """`tasks/train_text.py CONFIG --preview N`: marked samples, the packing of a micro-batch, tokens per step and
    steps per epoch; exit 0 without building the model."""
    records = [{"messages": NO_REASONING}] * 6 + [{"instruction": "Say hi", "input": "", "output": "hi"}]
    config = _config(str(tmp_path), qwen3, records)
    proc = run_python(
        [sys.executable, os.path.join(REPO, "tasks", "train_text.py"), config, "--preview", "2"]
        + ["--data.think_loss", "mask", "--data.max_seq_len", "64", "--train.global_batch_size", "2"],
        env=child_env(),
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("[[Paris.<|im_end|>]]") + out.count("[[hi<|im_end|>]]") == 2 and "[[<think>" not in out
    assert "=== packing of micro-batch 1 of step 1: 3 document(s)" in out and "document 3: tokens " in out
    assert "step 1: " in out and "carry loss" in out and "1 step(s) per epoch" in out
    assert "no model was built" in out and "parameters" not in out


def test_alpaca_records_train_the_output_only(tmp_path, qwen3):
    """Trap 9: an Alpaca record is one user turn (instruction, input; system prompt kept) and the output is all
    that carries loss; data.last_turn_only and data.over_length are config keys."""
    from veomni.trainer.preview import marked_spans, render_sample

    record = {"system": "Be exact.", "instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    config = _config(str(tmp_path), qwen3, [record])
    trainer, transform = _transform(config, "--data.think_loss", "mask")
    [sample] = transform(record)
    rendered = render_sample(trainer.tokenizer, sample["input_ids"], sample["labels"])
    assert marked_spans(rendered) == ["5<|im_end|>"]
    assert "system\nBe exact.<|im_end|>" in rendered and "user\nAdd the numbers.\n2 and 3<|im_end|>" in rendered
    _, transform = _transform(config, "--data.last_turn_only", "true", "--data.over_length", "truncate")
    [sample] = transform({"messages": REASONING})
    assert marked_spans(render_sample(trainer.tokenizer, sample["input_ids"], sample["labels"])) == [
        "<think>\nadd again\n</think>\n\nIt is 6.<|im_end|>"
    ]
    _, transform = _transform(config, "--data.over_length", "truncate", "--data.max_seq_len", "40")
    [sample] = transform({"messages": REASONING})
    assert len(sample["input_ids"]) == 40


def test_missing_alpaca_field_names_the_record_and_the_fields(tmp_path, qwen3):
    """A record that is almost Alpaca fails naming its file:line, the fields it holds and the fields needed."""
    from veomni.trainer.preflight import check_first_records

    config = _config(str(tmp_path), qwen3, [{"instruction": "Say hi", "input": ""}] * 2)
    trainer, _ = _transform(config, "--data.cache_dir", str(tmp_path / "cache"))
    dataset = trainer.build_dataset()
    with pytest.raises(DataFormatError) as err:
        check_first_records(dataset, trainer.args.data)
    message = str(err.value)
    assert "data.jsonl:1" in message
    assert "Alpaca record lacks ['output']: it holds fields ['input', 'instruction']" in message
    assert "needs ['instruction', 'output']" in message


def test_first_sample_is_logged_marked_at_the_start_of_a_run(tmp_path, qwen3):
    from veomni.trainer.preview import log_first_sample

    config = _config(str(tmp_path), qwen3, [{"messages": NO_REASONING}])
    trainer, _ = _transform(config, "--data.cache_dir", str(tmp_path / "cache"))
    trainer.train_dataset = trainer.build_dataset()
    log = _captured("veomni.trainer.preview")
    try:
        log_first_sample(trainer)
    finally:
        logging.getLogger("veomni.trainer.preview").removeHandler(log)
    [(level, message)] = log.lines
    assert "first sample (" in message and "data.jsonl:1" in message
    assert "[[<think>\n\n</think>\n\nParis.<|im_end|>]]" in message


def test_hf_export_carries_the_template_the_run_trained_on(tmp_path, qwen3):
    """Trained on ChatML with a Qwen3 tokenizer: the exported tokenizer's template is the ChatML one (a server
    that applies it feeds the model the format it saw), and the start warns that it is not the tokenizer's own."""
    from veomni.data.chat_template import build_chat_template

    config = _config(str(tmp_path), qwen3, [{"messages": NO_REASONING}] * 8, chat_template="chatml")
    out = str(tmp_path / "out")
    proc = run_python(
        [sys.executable, os.path.join(REPO, "tasks", "train_text.py"), config, "--train.max_steps", "1",
         "--train.checkpoint.save_hf_weights", "true", "--data.cache_dir", str(tmp_path / "cache")],
        env=child_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not the tokenizer's own chat template" in proc.stdout
    exported = AutoTokenizer.from_pretrained(os.path.join(out, "hf"))
    chatml = build_chat_template("chatml", exported).get_jinja_template()
    assert exported.chat_template == chatml != AutoTokenizer.from_pretrained(qwen3).chat_template


def test_templates_refuse_tokenizers_that_lack_their_special_tokens(tmp_path):
    """Before the model is built: ChatML without <|im_start|>/<|im_end|> (they would be split into pieces), the
    plain template without an eos_token (replies would end nowhere)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from veomni.data.chat_template import ChatTemplateError, build_chat_template

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["plain words only"] * 5, trainer=trainers.BpeTrainer(vocab_size=120, show_progress=False))
    bare = PreTrainedTokenizerFast(tokenizer_object=raw)
    with pytest.raises(ChatTemplateError, match=r"'chatml' needs the special tokens \['<\|im_start\|>', '<\|im_end"):
        build_chat_template("chatml", bare)
    with pytest.raises(ChatTemplateError, match="'default' ends each assistant reply with the tokenizer's eos_token"):
        build_chat_template("default", bare)
    with_eos = write_tokenizer(str(tmp_path / "tok"))
    build_chat_template("default", AutoTokenizer.from_pretrained(with_eos))
