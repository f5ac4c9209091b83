"""Loading files from disk never runs code: crafted payloads through every loader path (DCP metadata on resume
and on HF export, per-rank extra state, PyTorch `.bin` weights, configs and tokenizers naming custom code).

Each payload, if it ran, would create a marker file; each test asserts the marker is absent and that the error
names the offending file. Positive controls show the same paths still load genuine files."""

import json
import os
import pickle
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from helpers import write_model_config, write_tokenizer
from veomni.checkpoint import Checkpointer, CheckpointError, dcp_to_hf, resolve_checkpoint
from veomni.checkpoint.integrity import write_checksums
from veomni.models import build_config, build_foundation_model, build_tokenizer

pytestmark = pytest.mark.usefixtures("one_process_group")  # the Checkpointer is collective (conftest.py)


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"\x8d" + struct.pack("<Q", len(data))


def _call_payload(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle that calls `module`.`name`(*args): STACK_GLOBAL, then REDUCE. Built by hand so that
    dotted names (which `pickle.dumps` would refuse to write) can be tried too."""
    out = b"\x80\x04" + _str(module) + module.encode() + _str(name) + name.encode() + b"\x93("
    for arg in args:
        out += _str(arg) + arg.encode()
    return out + b"tR."


class _Reduce:
    """Unpickles as a call of `fn(*args)`: the classic `__reduce__` payload."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _tiny_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    model[1].to(torch.bfloat16)  # two dtypes in the metadata
    return model


def _save_checkpoint(out: str) -> str:
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[1](model[0](torch.randn(2, 4)).bfloat16()).float().sum().backward()
    opt.step()

    def attach(folder):  # what the trainer adds: the HF config the export path reads
        write_model_config(os.path.join(folder, "hf_config"))

    Checkpointer(out).save(3, model, opt, {"trainer": {"step": 3}, "rng": torch.get_rng_state()}, {}, attach)
    return resolve_checkpoint("auto", out)


def _resume(out: str):
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return Checkpointer(out).load(resolve_checkpoint("auto", out), model, opt), model


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "CODE_RAN"
    yield str(path)
    assert not path.exists(), "a payload ran code"


def test_genuine_checkpoint_still_loads(tmp_path):
    """The allow-list admits everything DCP writes (fp32, bf16, optimizer step tensors, storage info)."""
    out = str(tmp_path / "run")
    saved = _save_checkpoint(out)
    loaded, model = _resume(out)
    assert loaded["meta"]["step"] == 3 and loaded["extra_states"][0]["trainer"] == {"step": 3}
    assert model[1].weight.dtype == torch.bfloat16
    assert not torch.equal(model[0].weight, _tiny_model()[0].weight)  # the trained weights came back
    assert os.path.isfile(os.path.join(saved, "model_optimizer", ".metadata"))


def _dcp_payloads(marker, genuine_dcp):
    return {
        # a dotted name walks attributes: DCP's metadata module imports os, so this is os.system
        "dotted_os_system": ("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"),
        "builtins_eval": ("builtins", "eval", f"open({marker!r}, 'w')"),
        "os_system": ("os", "system", f"touch {marker}"),
        # a real DCP function that writes a file: a module-prefix allow-list would let it through
        "dcp_function": ("torch.distributed.checkpoint.format_utils", "dcp_to_torch_save", genuine_dcp, marker),
        "torch_load": ("torch", "load", marker),
    }


@pytest.mark.parametrize("payload", ["dotted_os_system", "builtins_eval", "os_system", "dcp_function", "torch_load"])
@pytest.mark.parametrize("path", ["resume", "export"])
def test_crafted_dcp_metadata_runs_nothing(tmp_path, marker, payload, path):
    out = str(tmp_path / "run")
    ckpt = _save_checkpoint(out)
    genuine = shutil.copytree(os.path.join(ckpt, "model_optimizer"), str(tmp_path / "genuine"))
    metadata = os.path.join(ckpt, "model_optimizer", ".metadata")
    with open(metadata, "wb") as f:
        f.write(_call_payload(*_dcp_payloads(marker, genuine)[payload]))
    with pytest.raises(Exception) as err:
        _resume(out) if path == "resume" else dcp_to_hf(ckpt, str(tmp_path / "hf"))
    assert metadata in str(err.value), f"the error does not name the file: {err.value}"
    assert "refusing" in str(err.value)


def test_garbage_metadata_names_the_file(tmp_path):
    out = str(tmp_path / "run")
    metadata = os.path.join(_save_checkpoint(out), "model_optimizer", ".metadata")
    with open(metadata, "r+b") as f:
        f.truncate(40)
    with pytest.raises(Exception, match="unreadable checkpoint metadata") as err:
        _resume(out)
    assert metadata in str(err.value)


def test_crafted_extra_state_runs_nothing(tmp_path, marker):
    out = str(tmp_path / "run")
    ckpt = _save_checkpoint(out)
    extra = os.path.join(ckpt, "extra_state", "rank_0.pt")
    torch.save({"trainer": _Reduce(os.system, f"touch {marker}")}, extra)
    with pytest.raises(CheckpointError, match="does not match its checksum"):  # the checksums catch it first
        _resume(out)
    write_checksums(ckpt)  # an attacker who can write the file can rewrite its checksum too: nothing runs anyway
    with pytest.raises((pickle.UnpicklingError, CheckpointError), match="weights_only") as err:
        _resume(out)[0]["extra_states"][0]  # (each rank's extra state is read when asked for)
    assert extra in str(err.value)


def test_latest_cannot_point_outside_the_run(tmp_path):
    """`latest` names a step folder of this run; a path elsewhere (`../other`) is ignored."""
    out = str(tmp_path / "run")
    _save_checkpoint(out)
    other = str(tmp_path / "other")
    _save_checkpoint(other)
    with open(os.path.join(out, "checkpoints", "latest"), "w") as f:
        f.write("../../other/checkpoints/global_step_3")
    assert resolve_checkpoint("auto", out) == os.path.join(out, "checkpoints", "global_step_3")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("model"))
    write_model_config(folder)
    torch.manual_seed(1)
    state = build_foundation_model(folder, torch_dtype="float32").state_dict()
    return folder, {k: v.contiguous() for k, v in state.items()}


def test_bin_weights_load_with_weights_only(weights, tmp_path):
    """A genuine `pytorch_model.bin` loads exactly like the same weights in safetensors."""
    folder, state = weights
    write_model_config(str(tmp_path))
    torch.save(state, tmp_path / "pytorch_model.bin")
    model = build_foundation_model(str(tmp_path), str(tmp_path), torch_dtype="float32")
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_crafted_bin_weights_run_nothing(weights, tmp_path, marker, layout):
    folder, state = weights
    write_model_config(str(tmp_path))
    poisoned = dict(state, **{"model.norm.weight": _Reduce(os.system, f"touch {marker}")})
    if layout == "single":
        bad = str(tmp_path / "pytorch_model.bin")
        torch.save(poisoned, bad)
    else:  # the poisoned shard second, after a clean one, both named by the index
        names = sorted(state)
        first = {k: state[k] for k in names[:3]}
        second = {k: poisoned[k] for k in names[3:]}
        torch.save(first, tmp_path / "pytorch_model-00001-of-00002.bin")
        bad = str(tmp_path / "pytorch_model-00002-of-00002.bin")
        torch.save(second, bad)
        weight_map = {k: "pytorch_model-00001-of-00002.bin" for k in first}
        weight_map.update({k: os.path.basename(bad) for k in second})
        with open(tmp_path / "pytorch_model.bin.index.json", "w") as f:
            json.dump({"weight_map": weight_map}, f)
    with pytest.raises(ValueError, match="weights_only=True") as err:
        build_foundation_model(str(tmp_path), str(tmp_path), torch_dtype="float32")
    assert bad in str(err.value)


def test_safetensors_preferred_over_bin(weights, tmp_path, marker):
    """With both formats present the pickle file is never opened."""
    folder, state = weights
    write_model_config(str(tmp_path))
    save_file(state, str(tmp_path / "model.safetensors"))
    torch.save({"x": _Reduce(os.system, f"touch {marker}")}, tmp_path / "pytorch_model.bin")
    build_foundation_model(str(tmp_path), str(tmp_path), torch_dtype="float32")


def _custom_code_folder(folder, marker: str, kind: str) -> str:
    """A model (or tokenizer) folder whose config names Python in the folder that would create `marker`."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "custom_code.py"), "w") as f:
        f.write(f"open({marker!r}, 'w').write('ran')\n")
        f.write("from transformers import PretrainedConfig, PreTrainedTokenizerFast\n")
        f.write("class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
        f.write("class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    if kind == "config":
        # an unknown model_type: transformers can only build it from the folder's code (a known type with an
        # auto_map loads the built-in class and runs nothing, which the marker check covers as well)
        write_model_config(folder, model_type="evil", auto_map={"AutoConfig": "custom_code.EvilConfig"})
    else:
        write_tokenizer(folder)
        path = os.path.join(folder, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        config["auto_map"] = {"AutoTokenizer": [None, "custom_code.EvilTokenizer"]}
        config["tokenizer_class"] = "EvilTokenizer"
        with open(path, "w") as f:
            json.dump(config, f)
    return folder


@pytest.mark.parametrize("kind", ["config", "model", "tokenizer"])
def test_custom_code_refused_without_trust_remote_code(tmp_path, marker, kind):
    folder = _custom_code_folder(str(tmp_path / "repo"), marker, "tokenizer" if kind == "tokenizer" else "config")
    load = {"config": build_config, "model": build_foundation_model, "tokenizer": build_tokenizer}[kind]
    with pytest.raises(ValueError, match="trust_remote_code") as err:
        load(folder)
    assert folder in str(err.value)


def test_trust_remote_code_is_a_config_key_off_by_default(tmp_path):
    from veomni.arguments import VeOmniArguments, parse_args

    assert parse_args(VeOmniArguments, []).model.trust_remote_code is False
    assert parse_args(VeOmniArguments, ["--model.trust_remote_code", "true"]).model.trust_remote_code is True
