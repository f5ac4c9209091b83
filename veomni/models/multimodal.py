"""Vision/audio + language models (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-Omni / Qwen3-Omni-MoE thinkers)
built by transformers' own classes, with a thin training adapter bound to each instance.

The adapter (`adapt_multimodal_model`) changes no modeling code; hooks around the instance's forward:

* accept the collator's packed M-RoPE ids: MainCollator packs per-sample (3, L) ids to (1, 3, L); HF wants (3, 1, L).
  The language model then attends per document through `cu_seq_lens_*` (veomni_varlen), and HF's M-RoPE rotates
  with the given 3-row ids, so a packed row equals its samples run one by one.
* run every encoder (image, video, audio) exactly once per forward, in a fixed order, on a 1-image (or 1-clip)
  dummy input when the micro-batch has none, adding 0 x its output to the text embeddings. Under FSDP2 every rank
  then all-gathers (and reduce-scatters) the same encoder units in the same order whatever its data, and every
  encoder parameter gets a gradient (zero, not None) on every rank. HF's forward then reuses these outputs.
* keep the language model's packing kwargs (cu_seq_lens_q, max_length_q, ...) out of the encoders, whose own
  attention is per image / per audio window (HF's, with `sdpa` by default).
* under Ulysses sequence parallelism (`MultimodalAdapter.shard_visual_outputs`), hand HF's forward only the visual
  embeddings whose placeholders lie in this rank's shard of the packed row (veomni.distributed.sequence_parallel).
"""

import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..compat.transformers import bind_instance_method
from .position_ids import ROPE_INDEX_CLASSES, build_position_id_func, thinker_config


class _Encoder(NamedTuple):
    inputs: Tuple[str, str]  # the forward's inputs of this kind
    getter: str  # HF's method giving its features
    tower: str  # the tower that runs it (`encoder_modules`)


# encoder kind -> what runs it, in the order the adapter runs them
_ENCODERS = {
    "image": _Encoder(("pixel_values", "image_grid_thw"), "get_image_features", "vit"),
    "video": _Encoder(("pixel_values_videos", "video_grid_thw"), "get_video_features", "vit"),
    "audio": _Encoder(("input_features", "feature_attention_mask"), "get_audio_features", "audio_tower"),
}
# the language model's packing kwargs: meaningful to the decoder only, never to an encoder
_LM_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_multimodal(config) -> bool:
    return getattr(thinker_config(config), "model_type", "") in ROPE_INDEX_CLASSES


# a head named by `config.architectures` that is not a language-model head: verl's critic rewrites its config to
# `<Family>ForTokenClassification` (num_labels=1, one value per token); a reward model is a sequence classifier
_HEADS = ("ForTokenClassification", "ForSequenceClassification")


def model_class_for(config):
    """The transformers auto class that builds `config`: `*ForTokenClassification` / `*ForSequenceClassification`
    when `config.architectures` names one, image-text-to-text for the VL / Omni thinker families, else causal LM."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    architecture = (getattr(config, "architectures", None) or [""])[0]
    for head in _HEADS:
        if architecture.endswith(head):
            return getattr(transformers, "AutoModel" + head)
    return AutoModelForImageTextToText if is_multimodal(config) else AutoModelForCausalLM


def attn_implementation_for(config, language_model_attn: Optional[str]):
    """The language model runs `language_model_attn` (veomni_varlen packs documents); the encoders keep HF's
    per-image / per-window attention (`sdpa`, or the same flash kernel when one was asked for and is installed).
    """
    if not is_multimodal(config) or language_model_attn is None:
        return language_model_attn
    encoder_attn = language_model_attn if language_model_attn.startswith("flash_attention") else "sdpa"
    mapping = {"": language_model_attn, "text_config": language_model_attn}
    for name in ("vision_config", "audio_config"):
        if getattr(config, name, None) is not None:
            mapping[name] = encoder_attn
    return mapping


# --------------------------------------------------------------------------------------------- dummy inputs
def _dummy_inputs(kind: str, config, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The smallest input an encoder of `kind` accepts: for the vision tower (and its merger) one image of
    merge x merge patches; for the audio tower one clip of one attention window of mel frames, all valid."""
    if kind == "audio":
        frames = 2 * getattr(config.audio_config, "n_window", 50)
        features = torch.zeros(1, config.audio_config.num_mel_bins, frames, dtype=dtype, device=device)
        return features, torch.ones(1, frames, dtype=torch.long, device=device)
    vision = config.vision_config
    m = vision.spatial_merge_size
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
    return torch.zeros(m * m, dim, dtype=dtype, device=device), grid


def _encoder_call(inner: nn.Module, kind: str, getter: Callable, batch: Dict[str, Any]):
    """Run one encoder on the batch's inputs of `kind`, or on a dummy input when the batch has none.
    Returns (outputs, is_dummy)."""
    first, second = _ENCODERS[kind].inputs
    if batch.get(first) is not None:
        lengths = (batch.get("audio_feature_lengths"),) if kind == "audio" else ()
        return getter(batch[first], batch.get(second), *lengths, return_dict=True), False
    param = next(inner.parameters())
    return getter(*_dummy_inputs(kind, inner.config, param.device, param.dtype), return_dict=True), True


def _tensors(value) -> List[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict) or hasattr(value, "values"):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


_ENCODER_OUTPUTS = ("image_outputs", "video_outputs", "audio_outputs")


def _zero_of(outputs) -> Optional[torch.Tensor]:
    """0 x every output tensor of an encoder call, as one scalar on the autograd graph."""
    parts = [t.float().sum() for t in _tensors(outputs) if t.is_floating_point() and t.requires_grad]
    return sum(parts) * 0.0 if parts else None


# ------------------------------------------------------------------------------------------------ adapter
def encoder_kinds(model: nn.Module) -> List[str]:
    towers = encoder_modules(model)
    return [kind for kind, encoder in _ENCODERS.items() if encoder.tower in towers]


def encoder_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """The encoder towers by option name: `vit` (vision tower) and `audio_tower`."""
    inner = getattr(model, "model", model)
    found = {"vit": getattr(inner, "visual", None), "audio_tower": getattr(inner, "audio_tower", None)}
    return {k: v for k, v in found.items() if v is not None}


def freeze_encoders(model: nn.Module, freeze_vit: bool = False, freeze_audio_tower: bool = False) -> List[str]:
    """requires_grad=False on the vision tower and/or the audio tower (model.freeze_vit / freeze_audio_tower).
    The towers still run (under no_grad) and still take part in FSDP's collectives. Returns what was frozen."""
    towers = encoder_modules(model)
    frozen = [name for name, freeze in (("vit", freeze_vit), ("audio_tower", freeze_audio_tower)) if freeze]
    if not set(frozen) <= set(towers):
        raise ValueError(f"{type(model).__name__} has no such tower to freeze (towers: {list(towers)})")
    for name in frozen:
        towers[name].requires_grad_(False)
    return frozen


# model -> its adapter; weak, so an entry goes with its model (nothing planted on the model instance)
_ADAPTERS: "weakref.WeakKeyDictionary[nn.Module, MultimodalAdapter]" = weakref.WeakKeyDictionary()


def multimodal_adapter(model: nn.Module) -> Optional["MultimodalAdapter"]:
    """The adapter `adapt_multimodal_model` bound to `model`, or None."""
    return _ADAPTERS.get(model)


def adapt_multimodal_model(model: nn.Module) -> nn.Module:
    """Bind the training adapter (module docstring) to a VL / Omni-thinker instance; returns the same object.

    Through hooks torch gives every module: a forward pre-hook (with kwargs) runs the encoders before HF's forward
    and a forward hook cleans up after it (both registered before any sharding: FSDP2's own pre-hook is prepended,
    its post-hook appended, so the root's parameters are gathered first and the encoders' outputs are stripped
    before FSDP sees them); a forward hook on the text embeddings adds the dummy encoders' zero. HF's forward then
    takes the encoders' outputs from its own `get_*_features` methods, which transformers gives no hook for: they
    are bound to the instance through veomni.compat (`bind_instance_method`, with its canary in test_compat.py)."""
    if model in _ADAPTERS:
        return model
    adapter = _ADAPTERS[model] = MultimodalAdapter(model)
    for kind in adapter.kinds:
        bind_instance_method(model.model, _ENCODERS[kind].getter, adapter.getter(kind))
    model.get_input_embeddings().register_forward_hook(adapter.add_pending_zero)
    model.register_forward_pre_hook(adapter.before_forward, with_kwargs=True)
    model.register_forward_hook(adapter.after_forward)
    return model


class MultimodalAdapter:
    """One forward's encoder outputs: run by `before_forward`, handed to HF's forward by the bound getters, and
    forgotten by `after_forward`.

    `shard_visual_outputs(config, ran, input_ids)`, installed by Ulysses sequence parallel
    (veomni.distributed.sequence_parallel.multimodal), replaces each encoder's outputs in `ran` by the slice whose
    placeholders lie in this rank's sequence shard; None: every embedding is kept."""

    def __init__(self, model: nn.Module):
        self.model, self.inner = model, model.model
        self.kinds = encoder_kinds(model)
        self.originals = {kind: getattr(self.inner, _ENCODERS[kind].getter) for kind in self.kinds}
        self.precomputed: Dict[str, Any] = {}
        self.pending_zero: List[torch.Tensor] = []
        self.shard_visual_outputs: Optional[Callable[[Any, Dict[str, Any], Optional[torch.Tensor]], None]] = None

    def getter(self, kind: str) -> Callable:
        original = self.originals[kind]

        def get_features(*args, **kwargs):
            if kind in self.precomputed:  # HF's forward asks for what the adapter already ran
                return self.precomputed.pop(kind)
            for key in _LM_PACKING_KWARGS:
                kwargs.pop(key, None)
            return original(*args, **kwargs)

        return get_features

    def add_pending_zero(self, module, args, output):
        if self.pending_zero:
            return output + self.pending_zero.pop().to(output.dtype)
        return output

    def before_forward(self, module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        # (1, 3|4, L) from MainCollator's packing of per-sample (3|4, L) ids -> HF's (3|4, 1, L)
        if torch.is_tensor(position_ids) and position_ids.dim() == 3 and position_ids.shape[:2] in ((1, 3), (1, 4)):
            kwargs["position_ids"] = position_ids.transpose(0, 1)
        self.precomputed.clear()
        self.pending_zero.clear()
        zero, ran = None, {}
        towers = encoder_modules(self.model)
        for kind in self.kinds:
            tower = towers[_ENCODERS[kind].tower]
            frozen = not any(p.requires_grad for p in tower.parameters())
            with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
                outputs, dummy = _encoder_call(self.inner, kind, self.originals[kind], kwargs)
            if dummy:
                part = _zero_of(outputs)
                zero = part if zero is None else zero + part
            else:
                ran[kind] = outputs
        if self.shard_visual_outputs is not None:
            # a slice stays on the graph even when empty: a rank whose shard holds no visual token still gives the
            # tower a (zero) gradient, so FSDP reduces the same units on every rank
            self.shard_visual_outputs(self.inner.config, ran, kwargs.get("input_ids"))
        self.precomputed.update(ran)  # only now: Qwen3-VL's video getter calls the image getter while it runs
        if zero is not None:
            self.pending_zero.append(zero)
        return args, kwargs

    def after_forward(self, module, args, output):
        self.precomputed.clear()
        self.pending_zero.clear()
        # the towers' outputs, returned beside the logits: training never reads them, and as views (one per image)
        # under FSDP2 they draw its "view tensor" warning and keep the features alive until backward. (A ModelOutput
        # keeps a key set to None in its dict, which FSDP walks: the output is rebuilt without them.)
        if any(output.get(name) is not None for name in _ENCODER_OUTPUTS):
            output = type(output)(**{k: v for k, v in output.items() if k not in _ENCODER_OUTPUTS})
        return output


def get_position_id_func(model: nn.Module) -> Optional[Callable]:
    """A picklable callable giving a sample's position ids (M-RoPE (3, L) ids equal to the model's own
    `get_rope_index`), or None for a text model (the collator numbers tokens itself)."""
    return build_position_id_func(model.config) if is_multimodal(model.config) else None
