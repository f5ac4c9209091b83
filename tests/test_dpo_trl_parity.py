"""DPO equals TRL's DPOTrainer: the same 4 pairs (tokenised by TRL) through TRL 1.16's own concatenated forward,
log-probs and loss (`DPOTrainer._compute_loss`, `compute_ref_log_probs`) and through our packed path (pairs packed
as separate documents of one row, veomni.ops.preference_loss), on the same tiny Qwen3 in fp32: per-sequence
chosen/rejected log-probs, the loss and every parameter's gradient to 1e-5, for the sigmoid and the ipo loss.

TRL is a test-only dependency: installed into ~/.cache/veomni/trl-1.16 (pip, once) when the environment lacks it,
as tests/test_verl_engine.py installs verl.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

from helpers import write_model_config, write_tokenizer

TRL_VERSION = "1.16"
TRL_SITE = os.path.join(os.path.expanduser("~"), ".cache", "veomni", f"trl-{TRL_VERSION}")
TINY_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16, vocab_size=320, tie_word_embeddings=False
)
PAIRS = [
    {"prompt": "the quick brown fox", "chosen": " jumps over the lazy dog", "rejected": " is not"},
    {"prompt": "to be or not", "chosen": " to be, that is the question", "rejected": " the fox"},
    {"prompt": "that is", "chosen": " the question", "rejected": " the quick brown dog jumps over"},
    {"prompt": "the lazy dog", "chosen": " is the fox", "rejected": " or not to be"},
]


def _trl():
    """Import trl (1.16), installing it into TRL_SITE once if this environment has no trl."""
    try:
        import trl

        if trl.__version__.startswith(TRL_VERSION):
            return trl
    except ImportError:
        pass
    if TRL_SITE not in sys.path:
        sys.path.insert(0, TRL_SITE)
    try:
        import trl

        return trl
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", TRL_SITE, f"trl=={TRL_VERSION}.*"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip(f"trl=={TRL_VERSION}.* could not be installed (no network?)")
    import trl

    return trl


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    trl = _trl()
    from datasets import Dataset
    from transformers import AutoTokenizer

    from veomni.models import build_foundation_model

    tmp = str(tmp_path_factory.mktemp("dpo_trl"))
    tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(os.path.join(tmp, "tok")))
    torch.manual_seed(0)
    model = build_foundation_model(
        write_model_config(os.path.join(tmp, "model"), **TINY_QWEN3), torch_dtype="float32", attn_implementation="sdpa"
    )
    with torch.no_grad():  # a policy that already differs from its reference: log-ratios and rewards are not 0
        policy = copy.deepcopy(model)
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return trl, Dataset.from_list(PAIRS), tokenizer, model, policy, tmp


def _trl_side(setup, loss_type):
    """TRL's per-sequence log-probs, loss and gradients, through its own trainer."""
    trl, dataset, tokenizer, reference, policy, tmp = setup
    model, ref = copy.deepcopy(policy), copy.deepcopy(reference)
    config = trl.DPOConfig(
        output_dir=os.path.join(tmp, f"trl_{loss_type}"), beta=0.2, loss_type=[loss_type], report_to=[],
        per_device_train_batch_size=4, use_cpu=True, bf16=False, fp16=False, max_length=None,
        dataset_num_proc=None,
    )  # fmt: skip
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=dataset, processing_class=tokenizer)
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    inputs = trainer.data_collator(examples)
    with torch.no_grad():
        chosen, rejected = trainer.compute_ref_log_probs(trainer.model, inputs)  # the policy's, by TRL's forward
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.ref_model, inputs)
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    tokenized = [{k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in examples]
    return tokenized, (chosen, rejected, ref_chosen, ref_rejected), loss.detach(), grads


def _our_side(setup, tokenized, loss_type):
    """The same token ids through our transform, collator, packed forward and loss."""
    from veomni.data.data_collator import MainCollator
    from veomni.data.preference import PreferenceCollator, process_preference_example
    from veomni.ops.preference_loss import SequenceLogps, preference_loss, split_pairs

    _, _, _, reference, policy, _ = setup
    model = copy.deepcopy(policy)
    samples = [process_preference_example(r, None, None, max_seq_len=512)[0] for r in tokenized]
    batch = PreferenceCollator(MainCollator(sp_size=1, sp_rank=0))(samples)
    assert batch["input_ids"].shape[0] == 1  # one packed row: 8 documents
    skip = ("labels", "shift_labels", "sequence_index", "num_pairs", "loss_units", "pair_keys", "num_targets")
    inputs = {k: v for k, v in batch.items() if k not in skip}
    args = (batch["labels"], batch["sequence_index"], 2 * batch["num_pairs"], batch["num_targets"])
    logps, tokens, _ = SequenceLogps(model)(*args, **inputs, use_cache=False)
    with torch.no_grad():
        ref_logps = SequenceLogps(reference)(*args, **inputs, use_cache=False)[0]
    chosen, rejected = split_pairs(logps)
    ref_chosen, ref_rejected = split_pairs(ref_logps)
    losses = preference_loss(chosen, rejected, ref_chosen, ref_rejected, 0.2, loss_type, 0.0, *split_pairs(tokens))
    loss = losses.sum() / batch["num_pairs"]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (chosen.detach(), rejected.detach(), ref_chosen, ref_rejected), loss.detach(), grads


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_equals_trl(setup, loss_type):
    tokenized, trl_logps, trl_loss, trl_grads = _trl_side(setup, loss_type)
    logps, loss, grads = _our_side(setup, tokenized, loss_type)
    names = ("chosen", "rejected", "ref_chosen", "ref_rejected")
    for name, ours, theirs in zip(names, logps, trl_logps):
        torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=1e-5, msg=f"{name} log-probs")
    assert (logps[0] - logps[2]).abs().max() > 1e-3  # the policy differs from its reference
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7, msg="loss")
    assert set(grads) == set(trl_grads)
    for name, grad in grads.items():
        # 1e-5 of the tensor's largest entry: packed (varlen) and padded attention round differently at ~1e-7
        atol = 1e-5 * float(trl_grads[name].abs().max())
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-5, atol=atol, msg=lambda m, n=name: f"grad {n}: {m}")


def test_plain_text_pairs_tokenise_as_trl(setup):
    """Our transform on the raw strings gives TRL's prompt / response split (prompt + response + EOS)."""
    from veomni.data.preference import process_preference_example

    tokenized, *_ = _trl_side(setup, "sigmoid")
    _, _, tokenizer, *_ = setup
    for record, ids in zip(PAIRS, tokenized):
        ours = process_preference_example(record, tokenizer, None, max_seq_len=512)[0]
        expected = process_preference_example(ids, None, None, max_seq_len=512)[0]
        assert ours == expected
