"""DistributedMuon on 2 and 4 gloo ranks: every path equals one process, and a Muon run resumes exactly from a
checkpoint on 2 ranks and on 1. (Single-process Muon: tests/test_muon.py.)"""

import os

import pytest

from helpers import REPO, read_metrics, run_text_task, tiny_run_config, torchrun, write_model_config, write_moe_config

CHECK = os.path.join(REPO, "tests", "dist", "check_muon.py")
# cases per launch (see check_muon.py); on 2 ranks EP 2 has ep_fsdp 1, so ep and ep_zero are the same layout
CASES = {
    2: ["fsdp_dense", "fsdp_moe", "ep"],
    4: ["fsdp_dense", "ep", "ep_zero", "ep_uneven", "ep:all_gather"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon_models")
    # a small vocabulary: every embedding row gets gradient most steps. Rows hit once then idle make AdamW's
    # update hinge on eps-sized gradients, which amplifies fp32 noise past 1e-5 whatever Muon does.
    moe = dict(output_router_logits=False, vocab_size=96)  # no aux loss: the loss splits exactly over ranks
    return [
        write_model_config(str(tmp / "dense"), vocab_size=96),
        write_moe_config(str(tmp / "moe"), **moe),
        write_moe_config(str(tmp / "moe6"), num_experts=6, **moe),
    ]


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_path_matches_one_process(models, nproc):
    proc = torchrun(CHECK, [*models, *CASES[nproc]], nproc)
    for case in CASES[nproc]:
        name, _, strategy = case.partition(":")
        marker = f"MUON_CASE_OK {name}:{strategy or 'owner'} world={nproc}" if name != "ep_uneven" else name
        assert proc.stdout.count(marker) == nproc, (case, proc.stdout[-3000:])
    paths = set(
        p
        for line in proc.stdout.splitlines()
        if "paths=" in line
        for p in ("fsdp_gather_2d", "moe_local_3d", "moe_gather_3d")
        if p in line
    )
    assert paths == ({"fsdp_gather_2d", "moe_local_3d"} | ({"moe_gather_3d"} if nproc == 4 else set()))


def test_resume_on_two_and_one_rank_continues_exactly(tmp_path):
    """MoE + EP 2 with whole experts per rank (zero comm), Muon momentum in DCP: saved at step 5 of 10 by 2 ranks,
    resumed by 2 ranks (same layout) and by 1 process (no EP: DCP reshards weights and Muon state)."""
    tmp = str(tmp_path)
    config = tiny_run_config(tmp)
    write_moe_config(f"{tmp}/model", output_router_logits=False)
    muon = [
        "--model.ops_implementation.moe_implementation",
        "fused",
        "--train.optimizer.type",
        "muon",
        "--train.optimizer.muon_expert_zero_comm",
        "true",
        "--train.checkpoint.save_steps",
        "5",
    ]
    ep = ["--train.accelerator.extra_parallel_sizes", "2", "--train.accelerator.extra_parallel_names", "ep"]
    ref = run_text_task(config, 2, f"{tmp}/ref", muon + ep)
    assert [m["step"] for m in ref] == list(range(1, 11))
    assert ref[0]["lr_muon"] / ref[0]["lr_adamw"] == pytest.approx(2e-2 / 3e-3)  # each group on its own base lr
    saved = os.path.join(tmp, "ref", "checkpoints", "global_step_5")
    for nproc, layout in ((2, ep), (1, [])):
        out = f"{tmp}/resumed{nproc}"
        got = run_text_task(config, nproc, out, muon + layout + ["--train.checkpoint.load_path", saved])
        assert [m["step"] for m in got] == list(range(6, 11))
        for a, b in zip(ref[5:], got):
            for key in ("loss", "grad_norm", "lr_muon", "lr_adamw"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (nproc, key, a, b)
    assert read_metrics(f"{tmp}/resumed2")[-1]["loss"] < ref[0]["loss"]
