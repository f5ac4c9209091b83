"""One torchrun launch (tests/dist/check_vlm_parallel.py): 2-rank FSDP2 vs one process on the tiny Qwen2.5-VL
(10 steps, 1e-5, ranks without images included) and on the tiny Qwen2.5-Omni thinker (nested encoder units, dummy
audio), expert parallel 2 on the tiny Qwen3-VL-MoE, and Ulysses SP 2 vs one process on the tiny Qwen2.5-VL (10 steps,
images across the shard border and shards without any)."""

import os

from vlm_inputs import TINY

from helpers import REPO, torchrun


def test_fsdp2_and_expert_parallel_match_one_process():
    script = os.path.join(REPO, "tests", "dist", "check_vlm_parallel.py")
    configs = [TINY["qwen2_5_vl"], TINY["qwen3_vl_moe"], TINY["qwen2_5_omni_thinker"]]
    proc = torchrun(script, configs, nproc=2, timeout=240)
    assert proc.stdout.count("FSDP_VL_OK") == 2 and proc.stdout.count("EP_VL_MOE_OK") == 2
    assert proc.stdout.count("FSDP_OMNI_OK") == 2, proc.stdout[-2000:]
    assert proc.stdout.count("SP_VL_OK") == 2, proc.stdout[-2000:]
