"""transformers' own checkpoint conversion rules, driven one tensor group at a time.

`from_pretrained` renames checkpoint keys (Qwen2.5-VL's hub `model.layers.*` -> `model.language_model.layers.*`, a
full Omni checkpoint's `thinker.*` -> the thinker's own names) and converts tensors (per-expert MoE weights -> the
fused `experts.gate_up_proj`) with the rules `transformers.conversion_mapping` ships per model class;
`save_pretrained` applies the same rules in reverse. We use exactly those rules, so a transformers release that
renames keys keeps working here, but we drive them differently: the checkpoint's key *names* are planned first
(which model tensor each key feeds, through which rule), then each group of keys is read, converted and handed on
before the next is read. Memory stays one group (one layer's experts at most), never the whole model, and a rank
can read only the slice it keeps of a tensor that is merely renamed.

This is the only module that touches `transformers.core_model_loading` and `transformers.conversion_mapping` (not
public API); tests/test_hf_conversion.py fails loudly when an upgrade moves what is used here.
"""

import copy
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    dot_natural_key,
)

# veomni's own "stacked" MoE layout (scripts/moe_merge.py --layout stacked): gate and up projections stacked per
# expert but not yet concatenated. Not a hub layout, so transformers ships no rule for it.
STACKED_EXPERTS = WeightConverter(
    source_patterns=["mlp.experts.gate_proj", "mlp.experts.up_proj"],
    target_patterns="mlp.experts.gate_up_proj",
    operations=[Concatenate(dim=1)],
)
# the other parts of a full Omni checkpoint (speech generation): not part of the thinker that is trained
OMNI_NON_THINKER_PREFIXES = ("talker.", "token2wav.", "code2wav.", "code_predictor.")


@dataclass
class TensorGroup:
    """Checkpoint tensors that become model tensors together: one key renamed, or several converted as one (a
    layer's experts fused). `sources` maps each rule pattern to its keys in natural order (expert 2 before 10)."""

    target: str
    transform: Optional[WeightTransform] = None
    sources: Dict[str, List[str]] = field(default_factory=dict)
    # saving: renamings run on what a converter produced (transformers converts model names first, renames after)
    rename_output: Optional[Callable[[str], str]] = None

    @property
    def keys(self) -> List[str]:
        return [key for keys in self.sources.values() for key in keys]

    @property
    def is_rename(self) -> bool:
        return self.transform is None

    def targets(self) -> List[str]:
        """The names this group produces (a one-to-many rule, e.g. qkv -> q, k, v, produces several)."""
        if self.transform is None or len(self.transform.target_patterns) == 1:
            return [self.target]
        first = self.transform.target_patterns[0]
        return [self.target.replace(first, pattern) for pattern in self.transform.target_patterns]


@dataclass
class LoadPlan:
    groups: List[TensorGroup]
    unexpected: List[Tuple[str, str]]  # (checkpoint key, the name it was renamed to)
    skipped: List[str]  # keys of other parts of a full checkpoint (an Omni model's talker when training its thinker)


def conversion_rules(model: nn.Module, loading: bool) -> List[WeightTransform]:
    """transformers' rules for `model`'s class: those `from_pretrained` applies (`loading`), or those whose reverse
    `save_pretrained` applies to a model it did not load (no legacy renames, no prefix changes)."""
    from torch.distributed.fsdp import FSDPModule

    reference = model
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        # the tables look models up by class name, and FSDP2 swaps in a subclass `FSDP<cls>` they don't know
        plain_class = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
        with torch.device("meta"):
            reference = plain_class(copy.deepcopy(model.config))
    rules = list(get_model_conversion_mapping(reference, add_legacy=loading) or [])
    if loading:
        return rules + [copy.deepcopy(STACKED_EXPERTS)]
    return [rule for rule in rules if not isinstance(rule, PrefixChange)]


def _split(rules: Sequence[WeightTransform]) -> Tuple[List[WeightTransform], List[WeightTransform]]:
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    return renamings, converters


def _rename(key: str, renamings: Sequence[WeightTransform]) -> str:
    for rule in renamings:
        key, _ = rule.rename_source_key(key)
    return key


def _convert_key(
    key: str, converters: Sequence[WeightTransform]
) -> Tuple[str, Optional[str], Optional[WeightTransform]]:
    """At most one converter applies to a key (transformers' rule): (new name, its source pattern, the rule)."""
    for rule in converters:
        renamed, pattern = rule.rename_source_key(key)
        if pattern is not None:
            return renamed, pattern, rule
    return key, None, None


def _fix_base_prefix(name: str, prefix: str, model_keys: Set[str]) -> str:
    """A base model's checkpoint loads into its `ForCausalLM` (and back): add or drop `base_model_prefix`."""
    if not prefix:
        return name
    if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in model_keys:
        return name[len(prefix) + 1 :]
    if f"{prefix}.{name}" in model_keys:
        return f"{prefix}.{name}"
    return name


def plan_load(model: nn.Module, checkpoint_keys: Iterable[str], model_keys: Iterable[str]) -> LoadPlan:
    """Which model tensor each checkpoint key feeds, as `from_pretrained` decides it (an Omni thinker skips the
    speech-output parts of a full Omni checkpoint)."""
    model_keys = set(model_keys)
    renamings, converters = _split(conversion_rules(model, loading=True))
    prefix = getattr(model, "base_model_prefix", "") or ""
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    skip_prefixes = OMNI_NON_THINKER_PREFIXES if model_type.endswith("_thinker") else ()
    groups: Dict[str, TensorGroup] = {}
    unexpected, skipped = [], []
    for key in sorted(checkpoint_keys, key=dot_natural_key):  # sorted: experts stack in numeric order
        name, pattern, rule = _convert_key(_rename(key, renamings), converters)
        name = _fix_base_prefix(name, prefix, model_keys)
        if name not in model_keys and key in model_keys:  # already in the model's own layout
            name, pattern, rule = key, None, None
        if name not in model_keys:
            if key.startswith(skip_prefixes):
                skipped.append(key)
            else:
                unexpected.append((key, name))
            continue
        group = groups.get(name)
        if group is None:
            group = groups[name] = TensorGroup(name, copy.deepcopy(rule))
        elif group.is_rename or pattern is None:
            raise ValueError(f"checkpoint keys {group.keys[0]!r} and {key!r} both map to the model's {name!r}")
        group.sources.setdefault(pattern or key, []).append(key)
    return LoadPlan(list(groups.values()), unexpected, skipped)


def plan_save(model: nn.Module, model_keys: Iterable[str]) -> List[TensorGroup]:
    """How `save_pretrained` writes these model tensors (of a model it did not load): the rules reversed."""
    rules = conversion_rules(model, loading=False)[::-1]  # sub-models' rules first, as transformers reverses them
    renamings, converters = _split([rule.reverse_transform() for rule in rules])
    groups: Dict[str, TensorGroup] = {}
    for key in sorted(model_keys, key=dot_natural_key):
        name, pattern, rule = _convert_key(key, converters)
        if rule is None:
            name, pattern = _rename(key, renamings), key
        group = groups.get(name)
        if group is None:
            rename_output = (lambda produced: _rename(produced, renamings)) if rule is not None else None
            group = groups[name] = TensorGroup(name, copy.deepcopy(rule), rename_output=rename_output)
        group.sources.setdefault(pattern, []).append(key)
    return list(groups.values())


def convert_group(group: TensorGroup, tensors: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Run one group's rule on its source tensors (keyed by checkpoint key): {produced name: tensor}."""
    if group.is_rename:
        (key,) = group.keys
        return {group.target: tensors[key]}
    rule = copy.deepcopy(group.transform)
    for pattern, keys in group.sources.items():
        for key in keys:
            rule.add_tensor(group.target, key, pattern, tensors[key])
    produced = rule.convert(group.target, model=model, config=getattr(model, "config", None))
    rename = group.rename_output or (lambda name: name)
    return {rename(name): value[0] if isinstance(value, list) else value for name, value in produced.items()}
