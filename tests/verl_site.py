"""verl 0.9.1, installed `--no-deps` beside this environment (never into it), with the packages it imports.

verl pins `transformers<5.11` and `torch==2.11`; we need transformers >= 5.17. So verl goes into a folder of its own
with `pip install --no-deps --target`, and runs against the torch and transformers installed here: exactly how
README's "Use from verl" installs it. The folder is cached per Python version under ~/.cache/veomni (or
$VEOMNI_VERL_SITE), so a machine installs it once; a half-written folder is never used (built aside, then renamed).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

VERL_VERSION = "0.9.1"
# what `import verl.workers.engine.veomni` (and verl's checkpoint manager) imports, beyond torch, transformers and
# our own dependencies: verl's requirements, minus the training/rollout stacks it does not import there
PACKAGES = [
    f"verl=={VERL_VERSION}",
    "tensordict==0.10.0",  # its C extension has no torch ABI: the 0.10 wheel loads under torch 2.11 - 2.14
    "pyvers<0.2",
    "cloudpickle",
    "orjson",
    "importlib_metadata",
    "zipp",
    "omegaconf",
    "antlr4-python3-runtime==4.9.3",
    "hydra-core",
    "codetiming",
    "ray",  # verl.protocol imports it at the top
    "msgpack",
    "protobuf",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "attrs",
    "click",
    "requests",
    "urllib3",
    "idna",
    "certifi",
    "charset-normalizer",
    "datasets",  # verl.utils.dataset, imported by the FSDP engine the VeOmni engine subclasses
    "pandas",
    "dill<0.4.2",
    "xxhash",
    "multiprocess<0.70.20",
    "accelerate",  # verl's FSDPCheckpointManager
    "psutil",
]


def verl_site() -> str:
    """The folder to put on PYTHONPATH for verl (installed on first use)."""
    key = hashlib.sha256(" ".join([sys.version, *PACKAGES]).encode()).hexdigest()[:12]
    root = os.environ.get("VEOMNI_VERL_SITE") or os.path.join(os.path.expanduser("~"), ".cache", "veomni")
    site = os.path.join(root, f"verl-{VERL_VERSION}-py{sys.version_info.major}{sys.version_info.minor}-{key}")
    if os.path.isdir(site):
        return site
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="verl-site-", dir=root)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", "--target", tmp]
    proc = subprocess.run(cmd + PACKAGES, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"installing verl {VERL_VERSION} into {tmp} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    try:
        os.rename(tmp, site)
    except OSError:  # another session finished the same install first
        shutil.rmtree(tmp, ignore_errors=True)
    return site
