"""veomni.compat: every private torch / torchdata / transformers symbol veomni uses lives there, and this file is
the one place an upgrade that moves one fails.

- each symbol of the compat modules' PRIVATE_SYMBOLS resolves (the failure names it and what needs it);
- a grep over veomni/ and tasks/ finds no private use outside veomni/compat;
- the patched models (Ulysses sync and async attention, fused MoE experts) equal plain transformers (fp32 CPU, a
  process group of one), and each adapter is run once against the torch / torchdata internals it relies on.
"""

import ast
import importlib
import io
import os
import re
import tokenize
import types
from typing import List

import pytest
import torch
from torch import nn

from helpers import REPO, TINY_QWEN2, TINY_QWEN3_MOE
from veomni.compat import torch as compat_torch
from veomni.compat import torch_runtime as compat_runtime
from veomni.compat import torchdata as compat_data
from veomni.compat import transformers as compat_hf

PARTS = (compat_torch, compat_runtime, compat_data, compat_hf)

# ------------------------------------------------------------------------------------------- every symbol
SYMBOLS = [(part, *entry) for part in PARTS for entry in part.PRIVATE_SYMBOLS]


@pytest.mark.parametrize("part, module, path, why", SYMBOLS, ids=[f"{s[1]}:{s[2]}" for s in SYMBOLS])
def test_private_symbol_resolves(part, module, path, why):
    import transformers

    try:
        obj = importlib.import_module(module)
        for name in path.split("."):
            obj = getattr(obj, name)
    except (ImportError, AttributeError) as err:
        pytest.fail(
            f"{module}.{path} is gone in torch {torch.__version__} / transformers {transformers.__version__} "
            f"({type(err).__name__}: {err}); veomni needs it for {why}: adapt {part.__name__}"
        )


def test_lazy_package_exports_name_what_the_parallel_code_imports():
    from veomni.compat import flatten_mesh, replicate, unflatten_mesh  # noqa: F401  (the names parallel_dims uses)

    with pytest.raises(ImportError, match="no_such_symbol"):
        from veomni.compat import no_such_symbol  # noqa: F401


# ------------------------------------------------------------------------------------------- grep
PRIVATE_PATTERNS = {
    "torch private attribute": r"\btorch(\.\w+)*\._\w+",
    "private torch/transformers module": r"^\s*(from|import) (torch|torchdata|transformers)[\w.]*\._",
    "private name imported": r"^\s*from (torch|torchdata|transformers)[\w.]* import .*\b_[a-zA-Z]\w*",
    "DeviceMesh._flatten / _unflatten": r"\._(un)?flatten\(",
    "modeling-file global": r"sys\.modules(\.get)?[\[(]type\(",
    "mock.patch": r"\bmock\.patch|\bfrom unittest import mock|\bunittest\.mock",
    "named private symbol": r"\b("
    + "|".join(
        [
            "_prepare_output_fn|_iterator|_initial_iter_for_state_dict|_shutdown|_shutdown_workers|PContext",
            "_grouped_mm|_foreach_\\w*|_get_fused_kernels_supported_devices|_local_tensor|_StridedShard",
            "_parameters|_non_persistent_buffers_set|_optimizer_step_pre_hooks|_optimizer_step_post_hooks",
            "_get_default_store|_get_metadata_path|_StorageInfo|_MEM_FORMAT_ENCODING|_get_layout",
            "_snapshot|_worker_snapshots|_composable|_functional_collectives",
            "_attn_implementation|_experts_implementation|_apply_gate|forward_with_checkpointing",
            "_calculate_timestamps|_get_feat_extract_output_lengths|_no_split_modules",
            "_keys_to_ignore_on_load_unexpected|MODALITY_TO_AUTOPROCESSOR_MAPPING|check_argument_for_proper_class",
        ]
    )
    + r")\b",
}


def _code_lines(source: str) -> List[str]:
    """The file's lines with comments and docstrings blanked (they may name private symbols; code may not)."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i in range(node.lineno - 1, node.end_lineno):
                lines[i] = ""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    return lines


def private_uses(source: str) -> List[str]:
    """'line: what' for each private torch / transformers use in `source`."""
    hits = []
    for number, line in enumerate(_code_lines(source), 1):
        for what, pattern in PRIVATE_PATTERNS.items():
            if re.search(pattern, line):
                hits.append(f"{number}: {what}: {line.strip()}")
    return hits


def _sources():
    for top in ("veomni", "tasks"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(files):
                path = os.path.relpath(os.path.join(root, name), REPO)
                if name.endswith(".py") and not path.startswith(os.path.join("veomni", "compat")):
                    yield path


def test_private_apis_only_in_compat():
    hits = []
    for path in _sources():
        with open(os.path.join(REPO, path)) as f:
            hits += [f"{path}:{hit}" for hit in private_uses(f.read())]
    assert not hits, "private torch/transformers API outside veomni/compat (add an adapter there):\n" + "\n".join(hits)


def test_the_grep_sees_code_and_not_comments():
    source = '''"""Docstring naming torch._grouped_mm."""
import torch  # torch._foreach_norm in a comment
from torch.distributed._composable.replicate import replicate
x = torch._foreach_norm([])
cfg._attn_implementation = "sdpa"
rotate = sys.modules[type(m).__module__].rotate_half
mesh["a", "b"]._flatten("ab")
name = getattr(config, "_experts_implementation", None)
data_iterator = iter(loader)
'''
    assert sorted({int(hit.split(":")[0]) for hit in private_uses(source)}) == [3, 4, 5, 6, 7, 8]


# ------------------------------------------------------------------------------------------- patched models
def _tiny(model_type: str, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    families = {
        "llama": dict(TINY_QWEN2, model_type="llama", architectures=["LlamaForCausalLM"]),
        "qwen2": TINY_QWEN2,
        "qwen3": dict(TINY_QWEN2, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
        "qwen3_moe": TINY_QWEN3_MOE,
    }
    fields = {k: v for k, v in families[model_type].items() if k != "model_type"}
    config = AutoConfig.for_model(model_type, **fields, attn_implementation=attn)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits


@pytest.fixture
def sp_of_one(one_process_group, monkeypatch):
    """Ulysses over a group of one (its all-to-alls the identity): the patched code paths, transformers' own
    kernels, in this process."""
    import torch.distributed as dist

    from veomni.distributed.sequence_parallel import async_attention, ulysses

    for module in (ulysses, async_attention):
        monkeypatch.setattr(module, "sp_group", lambda: dist.group.WORLD)


@pytest.mark.parametrize(
    "model_type, attn", [("llama", "sdpa"), ("qwen2", "eager"), ("qwen3", "sdpa"), ("qwen3_moe", "sdpa")]
)
def test_ulysses_and_async_attention_equal_transformers(sp_of_one, model_type, attn):
    from veomni.distributed.sequence_parallel.async_attention import patch_async_attention
    from veomni.distributed.sequence_parallel.ulysses import PREFIX, apply_ulysses

    model = _tiny(model_type, attn)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    assert apply_ulysses(model) == PREFIX + attn
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    patched, skipped = patch_async_attention(model)  # the copied attention forward, against transformers' own
    assert (patched, skipped) == (model.config.num_hidden_layers, set())
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_fused_experts_equal_transformers_eager_experts():
    from veomni.ops.moe import FUSED

    model = _tiny("qwen3_moe", "sdpa")
    compat_hf.set_config_experts_implementation(model.config, "eager")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    want = _logits(model, ids)
    compat_hf.set_config_experts_implementation(model.config, FUSED)
    assert compat_hf.config_experts_implementation(model.model.layers[0].mlp.experts.config) == FUSED
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_checkpoint_wrapper_is_recognised():
    """A renamed wrapper would make the compiled layers skip activation checkpointing without a word."""
    layer = _tiny("qwen2", "sdpa").model.layers[0]
    wrapped = type(layer).forward
    assert wrapped.__code__.co_name == compat_hf.CHECKPOINT_WRAPPER, "transformers renamed its checkpoint wrapper"
    own = compat_hf.undecorated_forward(layer)
    assert own is not wrapped and own.__code__.co_name != compat_hf.CHECKPOINT_WRAPPER


# ------------------------------------------------------------------------------------------- torch adapters
def test_meshes_local_tensors_and_the_passthrough_head(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from veomni.distributed.tensor_parallel import VocabParallelHead

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    assert compat_torch.flatten_mesh(mesh, "ab").mesh_dim_names == ("ab",)
    world = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
    assert compat_torch.unflatten_mesh(world, 0, (1, 1), ("x", "y")).mesh_dim_names == ("x", "y")
    with pytest.raises(RuntimeError, match=f"torch {re.escape(torch.__version__)} has no DeviceMesh._unflatten"):
        compat_torch.unflatten_mesh(object(), 0, (1,), ("x",))
    weight = distribute_tensor(torch.randn(4, 4, requires_grad=True), world, [Shard(0)])
    local = compat_torch.local_tensor(weight)
    assert local.data_ptr() == weight.to_local().data_ptr() and local.grad_fn is None

    head = parallelize_module(nn.Linear(4, 6), world, VocabParallelHead())
    x = torch.randn(3, 4)
    out = head(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)  # sharded on the vocabulary
    torch.testing.assert_close(out.full_tensor(), x @ head.weight.full_tensor().T + head.bias.full_tensor())

    class PlainOut(nn.Linear):  # the chunked loss returns a plain, reduced tensor: it must pass untouched
        def forward(self, x):
            return torch.ones(())

    assert type(parallelize_module(PlainOut(4, 6), world, VocabParallelHead())(x)) is torch.Tensor


def test_kernels_and_module_internals():
    assert "cuda" in compat_torch.fused_kernel_devices()
    tensors = [torch.randn(5), torch.randn(3)]
    norms = compat_torch.foreach_norm(tensors, 2.0, dtype=torch.float32)
    torch.testing.assert_close(torch.stack(norms), torch.stack([t.norm() for t in tensors]))
    expected = [t * 0.5 for t in tensors]
    compat_torch.foreach_mul_(tensors, 0.5)
    torch.testing.assert_close(tensors, expected)
    assert not compat_torch.grouped_mm_available(torch.ones(2, dtype=torch.bfloat16))  # CPU: never

    module = nn.Linear(2, 2)
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert set(compat_torch.parameter_slots(module)) == {"weight", "bias"}
    assert "scratch" not in module.state_dict()  # the loader expects no non-persistent buffer among the keys

    from veomni.optim.multi_optimizer import MultiOptimizer

    MultiOptimizer({"sgd": torch.optim.SGD(module.parameters(), lr=0.1)}).step()  # torch's step wrapper: hooks


def test_grouped_mm_fallback_is_logged_once(monkeypatch):
    said = []
    monkeypatch.setattr(compat_torch, "_GROUPED_MM", None)
    compat_torch._log_once.cache_clear()
    monkeypatch.setattr(compat_torch.logger, "info", said.append)
    cuda_bf16 = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert not compat_torch.grouped_mm_available(cuda_bf16) and not compat_torch.grouped_mm_available(cuda_bf16)
    assert len(said) == 1 and "per-expert matmuls" in said[0]


def test_safe_dcp_metadata_read(tmp_path):
    import torch.distributed.checkpoint as dcp

    from veomni.checkpoint.safe_reader import SafeFileSystemReader

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    reader = SafeFileSystemReader(str(tmp_path))
    metadata = reader.read_metadata()
    assert list(metadata.state_dict_metadata) == ["w"] and metadata.storage_meta.load_id == reader.load_id
    target = {"w": torch.zeros(3)}
    dcp.load(target, storage_reader=reader, no_dist=True)
    torch.testing.assert_close(target["w"], torch.ones(3))


def test_torchrun_and_store_adapters(one_process_group, monkeypatch):
    import inspect

    from torch.distributed.elastic.multiprocessing.api import PContext

    assert list(inspect.signature(PContext.close).parameters) == ["self", "death_sig", "timeout"]
    calls = []
    monkeypatch.setattr(PContext, "close", lambda self, death_sig=None, timeout=30: calls.append(timeout))
    assert compat_runtime.bound_worker_close_grace(7)
    PContext.close(None)
    assert calls == [7]
    assert compat_runtime.default_store() is not None


# ------------------------------------------------------------------------------------------- torchdata adapters
class _Loader(compat_data.IteratorSlotLoader):
    def __init__(self, *args, **kwargs):
        self.replaced = []
        super().__init__(*args, **kwargs)

    def iterator_replaced(self, previous, new):
        self.replaced.append((previous is not None, new is not None))


def test_loader_iterator_slot_and_state_layout():
    loader = _Loader(list(range(8)), batch_size=2, num_workers=1)
    state = loader.state_dict()  # makes an iterator through `_iterator` that nobody iterated yet
    assert loader._live[0] is not None and loader.replaced[-1] == (False, True), "torchdata renamed `_iterator`"
    assert loader._initial_iter_for_state_dict
    assert [s["worker_id"] for s in compat_data.worker_snapshots(state).values()] == [0], state
    iterator = loader._live[0]
    assert not compat_data.iterator_shut_down(iterator)
    compat_data.shutdown_iterator_workers(iterator)
    assert compat_data.iterator_shut_down(iterator)
    compat_data.keep_unstarted_iterator_state(loader, iterator)
    assert loader.next_iter_state is not None and not loader._initial_iter_for_state_dict
    loader.load_state_dict(state)
    assert loader._live[0] is None and loader.replaced[-1] == (True, False)


# ------------------------------------------------------------------------------------------- processors
def test_processor_without_video_patches_and_restores():
    from transformers import Qwen2VLProcessor, processing_utils

    assert "video_processor" in Qwen2VLProcessor.get_attributes()
    mapping = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING
    with compat_hf.processor_without_video(Qwen2VLProcessor, saving=True):
        assert "video_processor" not in Qwen2VLProcessor.get_attributes()
        assert processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING["video_processor"].from_pretrained("x") is None
    assert processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING is mapping
    assert "video_processor" in Qwen2VLProcessor.get_attributes()


def test_processor_helpers():
    from transformers import Qwen2_5OmniProcessor, Qwen3VLProcessor

    qwen3 = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    assert compat_hf.calculate_timestamps(qwen3, [0, 1, 2, 3], 2.0, merge_size=2) == [0.25, 1.25]
    omni = Qwen2_5OmniProcessor.__new__(Qwen2_5OmniProcessor)
    assert compat_hf.feat_extract_output_lengths(omni)(torch.tensor([3000])).tolist() == [750]
    assert compat_hf.feat_extract_output_lengths(qwen3) is None


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_multimodal_forward_takes_the_adapters_encoder_outputs(name):
    """The multimodal adapter runs each encoder before HF's forward and hands the outputs to it through the
    `get_*_features` methods it binds (compat.bind_instance_method): HF's forward must still ask for them by name.
    If it stopped, the vision tower would run a second time in the forward (and a dummy micro-batch's would not)."""
    from vlm_inputs import TINY, make_sample, pack

    from veomni.models import build_foundation_model
    from veomni.models.multimodal import encoder_kinds

    torch.manual_seed(0)
    model = build_foundation_model(TINY[name], torch_dtype="float32", moe_implementation="eager")
    runs = len(encoder_kinds(model))  # image and video: each kind once, real or dummy
    calls = []
    model.model.visual.register_forward_pre_hook(lambda module, args: calls.append(1))
    g = torch.Generator().manual_seed(1)
    batch = pack([make_sample(model, 4, [(4, 4)], g), make_sample(model, 3, [(4, 8)], g)])
    batch.pop("labels"), batch.pop("shift_labels"), batch.pop("image_mask", None)
    model(**batch, use_cache=False)
    assert len(calls) == runs == 2  # the adapter's runs only: HF's forward took their outputs
    calls.clear()
    text_only = pack([{k: v for k, v in make_sample(model, 5, [], g).items()}])
    text_only.pop("labels"), text_only.pop("shift_labels")
    model(**text_only, use_cache=False)
    assert len(calls) == runs  # the dummy inputs every rank runs, so FSDP gathers the same units everywhere


def test_fused_adamw_skips_its_whole_update_on_found_inf():
    """The trainer's device-side skip of a non-finite step: fused AdamW reads `found_inf` on the device and leaves
    parameters, moments and step count untouched; `found_inf` 0 is an ordinary step. Other kernels do not offer it."""
    param = nn.Parameter(torch.ones(4))
    fused = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1, fused=True)
    assert compat_torch.skips_on_found_inf(fused)
    assert not compat_torch.skips_on_found_inf(torch.optim.AdamW([nn.Parameter(torch.ones(1))], foreach=True))
    param.grad = torch.full((4,), 0.5)
    fused.step()  # one ordinary step first: moments and step count exist
    before = param.detach().clone(), {k: v.clone() for k, v in fused.state[param].items()}
    param.grad = torch.full((4,), float("nan"))
    compat_torch.set_found_inf(fused, torch.ones((), dtype=torch.float32))
    fused.step()
    assert torch.equal(param.detach(), before[0])
    assert all(torch.equal(fused.state[param][k], v) for k, v in before[1].items())
    param.grad = torch.full((4,), 0.5)
    compat_torch.set_found_inf(fused, torch.zeros((), dtype=torch.float32))
    fused.step()
    assert not torch.equal(param.detach(), before[0]) and fused.state[param]["step"].item() == 2
    compat_torch.set_found_inf(fused, None)


class _Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), i)


def test_a_loader_copied_into_a_forked_process_is_not_shut_down_there():
    """A DataLoader worker forked while another loader iterates holds a copy of it; when that copy is collected
    there, the iterator's shutdown must not run (it would tell the owner's workers to exit: the owner then waits for
    a batch that never comes). The owner still stops its workers as before."""
    import gc

    loader = compat_data.IteratorSlotLoader(_Numbers(), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    kind = type(iterator)
    del iterator
    pid = os.fork()
    if pid == 0:  # the child: count shutdowns of the copied iterator when the copied loader goes
        calls = []
        kind._shutdown_workers = lambda self: calls.append(1)
        del loader
        gc.collect()
        os._exit(3 if calls else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked copy's iterator was shut down in the child"
    workers = list(loader._live[0]._workers)
    del loader
    gc.collect()
    for w in workers:
        w.join(timeout=10)
    assert not any(w.is_alive() for w in workers), "the owner no longer stops its workers"
