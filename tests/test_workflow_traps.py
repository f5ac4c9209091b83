"""The remaining traps of the whole-workflow review (issue 39): torch's TP notice said once with its meaning."""

import logging

from veomni.compat.torch_runtime import REDISTRIBUTE_NOTE, explain_redistribute_notice

TORCH_LOGGER = "torch.distributed.tensor._redistribute"
TORCH_TEXT = (
    "While redistributing from %s to %s, %d sequential %s operations will be performed. This is suboptimal: multiple "
    "collective operations have higher latency (separate kernel launches and synchronization points) and may give "
    "inconsistent results between ranks due to different reduction orders. %s"
)


def _emit_twice(caplog, rank):
    caplog.clear()
    explain_redistribute_notice(rank)
    with caplog.at_level(logging.WARNING, logger=TORCH_LOGGER):
        for mesh in ("dp", "tp"):  # torch warns once per mesh and dims
            logging.getLogger(TORCH_LOGGER).warning(TORCH_TEXT, "(P, P)", "(R, R)", 2, "all_reduce", mesh)
        logging.getLogger(TORCH_LOGGER).warning("another notice")
    return [r.getMessage() for r in caplog.records if r.name == TORCH_LOGGER]


def test_the_tp_redistribution_notice_is_said_once_on_rank_0_with_what_it_means_here(caplog):
    assert _emit_twice(caplog, rank=0) == [REDISTRIBUTE_NOTE, "another notice"]
    assert _emit_twice(caplog, rank=1) == ["another notice"]  # (the filter of the call before is replaced)
    assert "rounding-level differences only" in REDISTRIBUTE_NOTE and "once, on rank 0" in REDISTRIBUTE_NOTE


def test_a_dataset_yaml_source_path_is_said_normalised(tmp_path):
    from veomni.data.dataset import load_interleave_spec

    folder = tmp_path / "configs" / "multimodal" / "data"
    folder.mkdir(parents=True)
    (folder / "mix.yaml").write_text("sources:\n  - path: ../../../.assets/vlm/easy_vqa.jsonl\n")
    (source,) = load_interleave_spec(str(folder / "mix.yaml"))["sources"]
    assert source["path"] == str(tmp_path / ".assets" / "vlm" / "easy_vqa.jsonl")  # no `configs/.../../../..`
