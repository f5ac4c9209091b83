"""`apply_sp`: the sequence-parallel step of `parallelize`."""

from torch import nn

from ...models.multimodal import is_multimodal
from ..parallel_state import ParallelState
from .multimodal import enable_multimodal_sequence_parallel
from .ulysses import apply_ulysses


def apply_sp(model: nn.Module, state: ParallelState) -> None:
    """Ulysses over the sp group: attention gathers the sequence per head; parameters stay replicated over sp.
    A vision-language model also keeps only the visual embeddings of its own sequence shard (and is refused here,
    before any step, when its family cannot shard them)."""
    if state.tp_enabled:
        raise NotImplementedError(
            f"ulysses_size={state.ulysses_size} with tp_size={state.tp_size}: Ulysses sequence parallel and tensor "
            "parallel do not compose yet; use one of them"
        )
    if is_multimodal(model.config):
        enable_multimodal_sequence_parallel(model, state.sp_group)
    apply_ulysses(model, async_enabled=state.async_enabled)
