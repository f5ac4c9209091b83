"""Talk to the result: `python -m veomni.chat` on a run's HF export and on its DCP checkpoint gives the same greedy
tokens as `train.eval_prompts` generated in training; the interactive mode driven through stdin. keep_best and early
stopping on a forced eval-loss sequence."""

import io
import json
import os

import pytest
from hub_cache import NEW_TOKENS, PROMPTS, trained_runs

from helpers import read_metrics
from veomni import chat

NEW_TOKENS = str(NEW_TOKENS)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """2 steps of full fine-tuning of the hub cache's tiny Qwen3 on 2 ranks, eval + samples at the end, exported
    (tests/hub_cache.py `trained_runs`: one launch with the hub test's LoRA run)."""
    runs = trained_runs(tmp_path_factory)
    return runs["full"], runs["log"]


def test_chat_answers_as_training_did_from_the_export_and_the_checkpoint(trained_run, tmp_path, capsys):
    out, log = trained_run
    samples = read_metrics(out)[-1]["samples"]
    assert [s["prompt"] for s in samples] == PROMPTS and all(s["response"] for s in samples)
    assert f"step 2 sample: {PROMPTS[0]!r} -> {samples[0]['response']!r}" in log
    summary = [line for line in log.splitlines() if f"HF export in {out}/hf" in line]  # (the launch's other run too)
    assert len(summary) == 1 and "run summary: steps 1..2 of 2" in summary[0]
    assert "best checkpoint global_step_2" in summary[0] and "eval loss" in summary[0]
    prompts = str(tmp_path / "prompts.txt")
    open(prompts, "w").write("\n".join(PROMPTS) + "\n")
    for model in (out, os.path.join(out, "checkpoints", "global_step_2")):  # the run's hf/ export; DCP consolidated
        answers = str(tmp_path / "answers.jsonl")
        assert chat.main([model, "--prompt-file", prompts, "--output", answers, "--max-new-tokens", NEW_TOKENS]) == 0
        assert [json.loads(line) for line in open(answers)] == samples, model
    assert chat.main([out, "--prompt", PROMPTS[1], "--max-new-tokens", NEW_TOKENS]) == 0
    assert capsys.readouterr().out.endswith(samples[1]["response"] + "\n")  # (after any log line)


def test_interactive_chat_through_stdin(trained_run, capsys):
    out, _ = trained_run
    samples = {s["prompt"]: s["response"] for s in read_metrics(out)[-1]["samples"]}
    with __import__("tempfile").TemporaryDirectory() as scratch:
        model, tokenizer = chat.load(out, scratch, "cpu")
    stdin = io.StringIO(f"{PROMPTS[0]}\n/reset\n{PROMPTS[1]}\n\n")
    capsys.readouterr()
    chat.interactive(model, tokenizer, int(NEW_TOKENS), None, stdin=stdin)
    text = capsys.readouterr().out
    # each turn's answer; after /reset the second prompt starts a new conversation, as in training's samples
    assert text.split("\n", 1)[1] == f"> {samples[PROMPTS[0]]}\n> > {samples[PROMPTS[1]]}\n> \n"
    assert samples[PROMPTS[0]] != samples[PROMPTS[1]]  # answers that depend on the prompt


def test_chat_says_what_it_cannot_load_in_one_line(tmp_path, capsys):
    assert chat.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_leading_empty_thinking_block_is_not_shown():
    from veomni.models.generate import visible_reply

    assert visible_reply("<think>\n\n</think>\n\nHello there. ") == "Hello there."
    assert visible_reply("<think>plan: greet</think> Hi") == "<think>plan: greet</think> Hi"
    assert visible_reply(" plain answer\n") == "plain answer"
