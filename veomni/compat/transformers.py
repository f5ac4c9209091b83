"""Private transformers symbols: config attributes, modeling-file globals, the checkpointing wrapper, experts
internals, model class attributes and processor internals.

transformers reads the attention / experts implementation from `config._attn_implementation` /
`config._experts_implementation` at every call (its setters propagate to sub-configs); veomni swaps them after
loading (Ulysses wraps the attention, the fused experts replace the eager ones), so it must write them too.
Everything else here is a module global, wrapper or hook that veomni reuses so as not to copy transformers' code.
"""

import contextlib
import inspect
import sys
import types
from collections.abc import Mapping
from typing import Callable, Iterator, List, Optional, Tuple
from unittest import mock

from torch import nn

__all__ = [
    "bind_instance_method",
    "config_attn_implementation",
    "set_config_attn_implementation",
    "config_experts_implementation",
    "set_config_experts_implementation",
    "modeling_global",
    "experts_gate",
    "undecorated_forward",
    "no_split_modules",
    "is_experts_module",
    "keys_to_ignore_on_load_unexpected",
    "processor_without_video",
    "calculate_timestamps",
    "feat_extract_output_lengths",
    "forward_calls_global",
    "bind_forward_with_global",
    "skip_packed_sequence_detection",
]

PRIVATE_SYMBOLS: List[Tuple[str, str, str]] = [
    ("transformers", "PretrainedConfig._attn_implementation", "read/set by Ulysses and TP"),
    ("transformers", "PretrainedConfig._experts_implementation", "set for the fused MoE experts"),
    ("transformers.models.llama.modeling_llama", "rotate_half", "async Ulysses attention (per modeling file)"),
    ("transformers.models.qwen2.modeling_qwen2", "rotate_half", "async Ulysses attention"),
    ("transformers.models.qwen3.modeling_qwen3", "rotate_half", "async Ulysses attention"),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "rotate_half", "async Ulysses attention"),
    ("transformers.models.qwen2.modeling_qwen2", "eager_attention_forward", "Ulysses with eager attention inside"),
    ("transformers.integrations.moe", "_default_apply_gate", "the experts' `_apply_gate` (fused experts)"),
    ("transformers.modeling_layers", "GradientCheckpointingLayer", "its forward_with_checkpointing wrapper"),
    ("transformers.processing_utils", "MODALITY_TO_AUTOPROCESSOR_MAPPING", "processors without torchvision"),
    ("transformers.processing_utils", "ProcessorMixin.check_argument_for_proper_class", "same"),
    ("transformers.processing_utils", "ProcessorMixin.get_attributes", "same"),
    ("transformers", "Qwen3VLProcessor._calculate_timestamps", "Qwen3-VL video placeholders"),
    ("transformers.models.qwen2_5_omni.processing_qwen2_5_omni", "_get_feat_extract_output_lengths", "audio tokens"),
    ("transformers", "PreTrainedModel._no_split_modules", "FSDP units / compiled units"),
    ("transformers", "PreTrainedModel._keys_to_ignore_on_load_unexpected", "keys from_pretrained drops"),
    ("transformers.masking_utils", "_preprocess_mask_arguments", "no packed-document search for veomni_varlen"),
    # the RoPE functions an attention forward calls by name: veomni.ops.kernels binds liger's in their place, per
    # instance (bind_forward_with_global); tests/test_kernels.py's canary checks each forward still calls them
    ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb", "liger RoPE per attention instance"),
    ("transformers.models.qwen2.modeling_qwen2", "apply_rotary_pos_emb", "same"),
    ("transformers.models.qwen3.modeling_qwen3", "apply_rotary_pos_emb", "same"),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "apply_rotary_pos_emb", "same"),
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "apply_rotary_pos_emb", "same (M-RoPE: merged cos/sin)"),
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "apply_rotary_pos_emb_vision", "same, vision tower"),
    ("transformers.models.qwen3_vl.modeling_qwen3_vl", "apply_rotary_pos_emb", "same (interleaved M-RoPE)"),
    ("transformers.models.qwen3_vl.modeling_qwen3_vl", "apply_rotary_pos_emb_vision", "same, vision tower"),
]

# the name of the wrapper GradientCheckpointingLayer.__init_subclass__ installs around every layer's forward
CHECKPOINT_WRAPPER = "forward_with_checkpointing"


# ------------------------------------------------------------------------------------------- config attributes
def config_attn_implementation(config) -> Optional[str]:
    """The attention implementation transformers dispatches on (`config._attn_implementation`)."""
    return config._attn_implementation


def set_config_attn_implementation(config, name: Optional[str]) -> None:
    """Swap the attention implementation of an already-built model's config (the setter recurses into
    sub-configs). `model.set_attn_implementation` would re-validate and refuse names it does not ship."""
    config._attn_implementation = name


def config_experts_implementation(config) -> Optional[str]:
    """The experts implementation transformers dispatches on (None where the config has none)."""
    return getattr(config, "_experts_implementation", None)


def set_config_experts_implementation(config, name: Optional[str]) -> None:
    """Swap the experts implementation (read at every experts call, so it may change after loading)."""
    config._experts_implementation = name


# ------------------------------------------------------------------------------------------- modeling files
def modeling_global(module: nn.Module, name: str):
    """A global of the modeling file that defines `module`'s class (`rotate_half`, `eager_attention_forward`):
    each file has its own copy, and veomni must use the one the model was written against."""
    source = sys.modules[type(module).__module__]
    if not hasattr(source, name):
        raise _moved(
            f"{source.__name__} has no `{name}`, which veomni takes from {type(module).__name__}'s modeling file"
        )
    return getattr(source, name)


def experts_gate(experts: nn.Module) -> Callable:
    """The experts' `_apply_gate` (act(gate) * up, or the model's own) that transformers' `use_experts_implementation`
    installs; the fused experts call it so each model's gating is transformers' own."""
    if not hasattr(experts, "_apply_gate"):
        raise _moved(
            f"{type(experts).__name__} has no `_apply_gate`, transformers' experts gating hook the fused MoE experts need",
            "run moe_implementation=eager or ",
        )
    return experts._apply_gate


def undecorated_forward(unit: nn.Module) -> Callable:
    """The class's own `forward`, without transformers' activation-checkpointing wrappers (one per subclass level,
    FSDP's `FSDP<Layer>` included). Recognised by the wrapper's function name: if transformers renames it, the
    compiled forward would silently skip veomni's own checkpointing, so the canary asserts a wrapper is found."""
    forward = type(unit).forward
    while forward.__code__.co_name == CHECKPOINT_WRAPPER and hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return forward


def bind_instance_method(module: nn.Module, name: str, function: Callable) -> None:
    """`module.<name>` is `function` for this instance only: how veomni reaches a step inside a transformers forward
    that offers no hook (the multimodal adapter's `get_image_features` / `get_video_features` /
    `get_audio_features`, the async Ulysses attention's and a compiled layer's `forward`). Each use relies on the
    forward still calling that method by name: tests/test_compat.py checks every one."""
    if not callable(getattr(module, name, None)):
        raise _moved(f"{type(module).__name__} has no method {name!r}")
    setattr(module, name, function)


def no_split_modules(model) -> List[str]:
    """Class names of the model's basic blocks (`_no_split_modules`): FSDP and compile units."""
    return list(getattr(model, "_no_split_modules", None) or [])


def is_experts_module(module) -> bool:
    """A fused experts module (transformers 5's `use_experts_implementation` classes mark themselves with
    `_is_expert_parallel`); shared experts and dense MLPs are not."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")


def keys_to_ignore_on_load_unexpected(model) -> List[str]:
    """Patterns of checkpoint keys `from_pretrained` drops silently (an MTP head, an Omni talker)."""
    return list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def forward_calls_global(cls, name: str) -> bool:
    """Whether `cls.forward` looks up the modeling-file global `name` (e.g. `apply_rotary_pos_emb`) when it runs.
    The forward is read without its decorators (`deprecate_kwarg`'s wrapper: the model's own layers already call
    the forward with the current argument names)."""
    forward = inspect.unwrap(cls.forward)
    return name in forward.__code__.co_names and name in forward.__globals__


_REBOUND: dict = {}  # (forward, name, replacement) -> the rebuilt function, shared by every instance of a class


def bind_forward_with_global(module: nn.Module, name: str, replacement: Callable) -> None:
    """Give `module` (this instance only) its class's forward in which the modeling-file global `name` means
    `replacement`: the class's code over a copy of the modeling file's globals with that one name changed.

    This is how a fused RoPE reaches one model and not the next: liger's own patch assigns the module global, which
    every model of the family in the process then runs. The copy is taken at binding time (a later reassignment of
    another global of that file is not seen by the bound instances). All instances of a class share one rebuilt
    function, so torch.compile sees one code for all layers. Raises if the forward does not call `name` (transformers
    moved the function): binding would then silently do nothing."""
    cls = type(module)
    if not forward_calls_global(cls, name):
        raise _moved(
            f"{cls.__name__}.forward no longer calls the global `{name}` that veomni binds a fused kernel in place of",
            "run model.ops_implementation.kernels eager or ",
        )
    forward = inspect.unwrap(cls.forward)  # as forward_calls_global reads it
    key = (forward, name, replacement)
    if key not in _REBOUND:
        namespace = dict(forward.__globals__)
        namespace[name] = replacement
        # A code object of its own: torch.compile caches per code object and puts the functions that resume after a
        # graph break (veomni's attention runs outside the graph) into the globals of the frame it first compiled.
        # Sharing the class's code, the bound copy would find an unbound twin's cache entry and look those up in
        # this namespace: NameError `__compiled_fn_...` (seen on an H200 with kernels=liger and compile).
        code = forward.__code__.replace(co_qualname=f"{forward.__code__.co_qualname}[{name}]")
        rebuilt = types.FunctionType(code, namespace, forward.__name__, forward.__defaults__, forward.__closure__)
        rebuilt.__kwdefaults__ = forward.__kwdefaults__
        rebuilt.__qualname__ = forward.__qualname__
        _REBOUND[key] = rebuilt
    module.forward = types.MethodType(_REBOUND[key], module)


# ------------------------------------------------------------------------------------------- processors
class _NoVideoProcessor:
    """Stands in for AutoVideoProcessor while loading: the processor's video part is None."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return None


class _VideoStub(Mapping):
    """transformers' modality -> Auto class mapping, with the video entry answered by `_NoVideoProcessor`."""

    def __init__(self, base):
        self.base = base

    def __getitem__(self, key):
        return _NoVideoProcessor if key == "video_processor" else self.base[key]

    def __iter__(self):
        return iter(self.base.keys())

    def __len__(self):
        return len(self.base.keys())


@contextlib.contextmanager
def processor_without_video(processor_cls, saving: bool = False) -> Iterator[None]:
    """Within the block, `processor_cls` is built and loaded (with `saving`, also saved) with no video processor.

    transformers has no switch for it: the processor's argument check, the module's modality -> Auto class
    mapping and (for saving) the class's attribute list are patched for the block only."""
    from transformers import processing_utils

    original_check = processor_cls.check_argument_for_proper_class

    def check(self, name, argument):
        return None if argument is None else original_check(self, name, argument)

    mapping = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING
    patches = [
        mock.patch.object(processor_cls, "check_argument_for_proper_class", check),
        mock.patch.object(processing_utils, "MODALITY_TO_AUTOPROCESSOR_MAPPING", _VideoStub(mapping)),
    ]
    if saving:  # `save_pretrained` walks the attributes by name; positional construction needs them all
        attributes = [a for a in processor_cls.get_attributes() if a != "video_processor"]
        patches.append(mock.patch.object(processor_cls, "get_attributes", classmethod(lambda cls: list(attributes))))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def calculate_timestamps(processor, frames: List[int], fps: float, merge_size: int) -> List[float]:
    """Seconds of each temporal patch, as Qwen3-VL's processor writes them (`_calculate_timestamps`)."""
    return processor._calculate_timestamps(frames, fps, merge_size=merge_size)


def feat_extract_output_lengths(processor) -> Optional[Callable]:
    """The processor module's own audio-length rule (`_get_feat_extract_output_lengths`, Qwen-Omni), or None."""
    return getattr(sys.modules.get(type(processor).__module__), "_get_feat_extract_output_lengths", None)


def _moved(what: str, remedy: str = "") -> AttributeError:
    """The error for a transformers symbol veomni needs that this version lacks: what is missing, the version, and
    where its adapter lives."""
    import transformers

    return AttributeError(
        f"{what} (transformers {transformers.__version__}): {remedy}see veomni/compat/transformers.py"
    )


_MASK_PREPROCESSING_SKIPS_PACKING: set = set()


def skip_packed_sequence_detection(attn_implementation: str) -> None:
    """transformers' mask preprocessing (masking_utils._preprocess_mask_arguments) looks for packed documents in
    `position_ids` when no 2-D mask is given: `find_packed_sequence_indices` branches on a device tensor, one host
    read (a GPU sync) per forward. An attention that finds the documents itself never uses what it finds: for
    `attn_implementation`, the preprocessing is handed no `position_ids` (they serve nothing else there)."""
    import transformers.masking_utils as masking

    _MASK_PREPROCESSING_SKIPS_PACKING.add(attn_implementation)
    original = masking._preprocess_mask_arguments
    if getattr(original, "__wrapped__", None) is not None:
        return  # wrapped already: the set above is what it reads
    parameters = list(inspect.signature(original).parameters)
    position = parameters.index("position_ids")

    def preprocess(config, *args, **kwargs):
        if config._attn_implementation in _MASK_PREPROCESSING_SKIPS_PACKING:
            if "position_ids" in kwargs:
                kwargs["position_ids"] = None
            elif len(args) >= position:  # args start after `config`
                args = (*args[: position - 1], None, *args[position:])
        return original(config, *args, **kwargs)

    preprocess.__wrapped__ = original
    masking._preprocess_mask_arguments = preprocess
