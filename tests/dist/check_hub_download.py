"""Under torchrun (2 ranks, HF_HUB_OFFLINE=1, HF_HUB_CACHE set by the test): hub names resolved once per node.

argv: CACHE WORKDIR. Writes WORKDIR/rank<r>.json with what each scenario gave this rank:
- "download": `snapshot_download` patched to lay out the cache (slowly): who called it, when, and the paths;
- "raise": the same patched to raise: the error each rank got;
- "missing": the real `snapshot_download` on a name the cache does not hold."""

import json
import os
import sys
import time

import huggingface_hub
import torch.distributed as dist
from hub_cache import add_to_hub_cache
from huggingface_hub.errors import LocalEntryNotFoundError

from veomni.utils.hub import HubNameError, resolve_on_every_rank

cache, workdir = sys.argv[1:3]
dist.init_process_group("gloo")
rank = dist.get_rank()
calls = os.path.join(workdir, "calls.txt")
report = {}


def fake_download(repo_id, revision=None, repo_type="model", allow_patterns=None):
    with open(calls, "a") as f:
        f.write(f"{rank} {repo_id} {revision}\n")
    time.sleep(1.0)  # the node's other ranks must wait for it
    source = os.path.join(workdir, f"src-{rank}")
    os.makedirs(source, exist_ok=True)
    with open(os.path.join(source, "config.json"), "w") as f:
        f.write("{}")
    report["download_done"] = time.time()
    return add_to_hub_cache(cache, repo_id, source, "c" * 40)


def failing_download(repo_id, **kwargs):
    with open(calls, "a") as f:
        f.write(f"{rank} {repo_id} raise\n")
    raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache")


def resolve(items):
    try:
        return resolve_on_every_rank(items), None
    except HubNameError as err:
        return None, str(err)


real = huggingface_hub.snapshot_download
huggingface_hub.snapshot_download = fake_download
found, error = resolve([("model.model_path", "fetch-org/model@v1", False), ("data.eval_path", "local.jsonl", True)])
report.update(download={"found": found, "error": error, "returned": time.time()})
dist.barrier()
huggingface_hub.snapshot_download = failing_download
report["raise"] = dict(zip(("found", "error"), resolve([("model.tokenizer_path", "fetch-org/broken", False)])))
huggingface_hub.snapshot_download = real
report["missing"] = dict(zip(("found", "error"), resolve([("model.model_path", "nobody/nothing", False)])))
with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.barrier()
dist.destroy_process_group()
