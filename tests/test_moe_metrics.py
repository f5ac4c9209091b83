"""MoE metrics (veomni/trainer/moe_metrics.py), in this process on the tiny Qwen3-MoE: the per-expert counts equal a
recount from the router logits transformers returns, whether the experts run eager or fused, summed over several
forwards (gradient accumulation), and an activation-checkpointing recompute adds nothing; a router forced to one
expert gives max load = number of experts and entropy 0, an expert no token picks gives min load 0; the counts and
the aux sum ride in the loss all-reduce and come out as metrics. The same counts on 1, 2 (EP 2) and 4 ranks (EP 2 x
ep_fsdp 2) are in test_expert_parallel.py, which trains with these metrics on."""

import math

import pytest
import torch

from helpers import write_moe_config
from veomni.models import build_foundation_model
from veomni.trainer.callbacks import scalar_items
from veomni.trainer.moe_metrics import MoEMetrics, load_stats, moe_summary

EXPERTS = 8


def _model(tmp_path, implementation="fused", **overrides):
    torch.manual_seed(0)
    folder = write_moe_config(str(tmp_path / "model"), **overrides)
    return build_foundation_model(folder, torch_dtype="float32", moe_implementation=implementation)


def _inputs(seed=0, rows=2, length=24):
    return torch.randint(3, 512, (rows, length), generator=torch.Generator().manual_seed(seed))


def _recount(router_logits, top_k):
    """What each layer's router picked, from the logits transformers hands back (the router's own top-k)."""
    rows = []
    for logits in router_logits:
        picks = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1).indices
        rows.append(torch.bincount(picks.reshape(-1), minlength=EXPERTS))
    return torch.stack(rows)


@pytest.mark.parametrize("implementation", ["eager", "fused"])
def test_counts_equal_a_recount_from_the_router_logits_summed_over_micro_batches(tmp_path, implementation):
    model = _model(tmp_path, implementation)
    metrics = MoEMetrics(model, torch.device("cpu"))
    assert (metrics.counter.num_layers, metrics.counter.num_experts) == (2, EXPERTS)
    expected = torch.zeros(2, EXPERTS, dtype=torch.int64)
    with torch.no_grad():
        for seed in range(3):  # three micro-batches of one step
            out = model(input_ids=_inputs(seed), output_router_logits=True)
            expected += _recount(out.router_logits, top_k=2)
    assert torch.equal(metrics.counter.counts, expected)
    assert expected.sum(-1).tolist() == [3 * 2 * 24 * 2] * 2  # each layer: every token's two choices, once
    metrics.start_step()
    assert int(metrics.counter.counts.sum()) == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_activation_checkpointing_recompute_is_not_counted(tmp_path, reentrant):
    model = _model(tmp_path).train()
    ids = _inputs(1)
    with torch.no_grad():
        expected = _recount(model(input_ids=ids, output_router_logits=True).router_logits, top_k=2)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    metrics = MoEMetrics(model, torch.device("cpu"))
    model(input_ids=ids, labels=ids).loss.backward()  # the backward recomputes both layers' forwards
    assert torch.equal(metrics.counter.counts, expected)


def _force_expert(router, expert):
    """The router picks `expert` for every token (top-1)."""

    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        index = torch.full((logits.shape[0], 1), expert, dtype=torch.long)
        return logits, torch.ones(logits.shape[0], 1), index

    router.forward = forward


def test_a_router_forced_to_one_expert_loads_it_num_experts_times_the_mean(tmp_path):
    model = _model(tmp_path, num_experts_per_tok=1)
    _force_expert(model.model.layers[0].mlp.gate, expert=5)
    metrics = MoEMetrics(model, torch.device("cpu"))
    with torch.no_grad():
        model(input_ids=_inputs())
    counts = metrics.counter.counts
    assert counts[0].tolist() == [0, 0, 0, 0, 0, 48, 0, 0] and int(counts[1].sum()) == 48
    stats = load_stats(counts)
    assert stats["max_load"][0] == EXPERTS and stats["min_load"][0] == 0 and stats["entropy"][0] == 0
    assert 0 < stats["entropy"][1] <= 1 and stats["max_load"][1] < EXPERTS  # the natural router of layer 1


def test_load_stats_uniform_skewed_and_an_empty_expert():
    counts = torch.tensor([[5] * 8, [40, 0, 0, 0, 0, 0, 0, 0], [6, 6, 6, 6, 6, 6, 4, 0]])
    stats = load_stats(counts)
    assert stats["max_load"].tolist() == [1.0, 8.0, 8 * 6 / 40]
    assert stats["min_load"].tolist() == [1.0, 0.0, 0.0]
    p = torch.tensor([6, 6, 6, 6, 6, 6, 4], dtype=torch.float64) / 40
    assert stats["entropy"][0] == pytest.approx(1.0, abs=1e-12) and stats["entropy"][1] == 0
    assert stats["entropy"][2] == pytest.approx(float(-(p * p.log()).sum()) / math.log(8), abs=1e-12)


def test_step_metrics_come_out_of_the_loss_all_reduce(tmp_path, one_process_group):
    model = _model(tmp_path)
    metrics = MoEMetrics(model, torch.device("cpu"))
    metrics.start_step()
    with torch.no_grad():
        model(input_ids=_inputs())
    metrics.add_aux(torch.tensor(30.0))
    loss_sum = metrics.all_reduce(torch.tensor(120.0, dtype=torch.float64), group=None)
    assert loss_sum.item() == 120.0
    out = metrics.step_metrics(loss=loss_sum.item() / 40, loss_tokens=40)
    assert out["aux_loss"] == 0.75 and out["lm_loss"] == pytest.approx(3.0 - 0.01 * 0.75)
    assert metrics.last_counts() == metrics.counter.counts.tolist()
    layers = {name: out[f"moe_{name}_layers"] for name in ("max_load", "min_load", "entropy")}  # 4 decimals
    assert len(layers["entropy"]) == 2 and out["moe_entropy"] == pytest.approx(min(layers["entropy"]), abs=1e-4)
    assert out["moe_max_load"] == pytest.approx(max(layers["max_load"]), abs=1e-4)
    assert out["moe_min_load"] == pytest.approx(min(layers["min_load"]), abs=1e-4)
    flat = dict(scalar_items({"step": 3, **out}))
    assert "moe_entropy_layers/1" in flat and "step" not in flat
    assert "aux_loss 0.7500 expert load max" in moe_summary(out)


def test_a_dense_model_adds_no_metric_and_reduces_only_the_loss(tmp_path, one_process_group):
    from helpers import write_model_config

    dense = build_foundation_model(write_model_config(str(tmp_path / "dense")), torch_dtype="float32")
    metrics = MoEMetrics(dense, torch.device("cpu"))
    assert metrics.all_reduce(torch.tensor(2.0, dtype=torch.float64), group=None).item() == 2.0
    assert metrics.step_metrics(loss=1.0, loss_tokens=2) == {} and moe_summary({}) == ""
