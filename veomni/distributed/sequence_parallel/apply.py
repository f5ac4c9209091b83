"""`apply_sp`: the sequence-parallel step of `parallelize`."""

from torch import nn

from ...models.multimodal import is_multimodal
from ...utils.logging import get_logger
from ..parallel_state import ParallelState
from .async_attention import patch_async_attention
from .multimodal import enable_multimodal_sequence_parallel
from .ulysses import apply_ulysses

logger = get_logger(__name__)


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
    name = apply_ulysses(model)
    if not state.async_enabled:
        logger.info(f"Ulysses sequence parallel ({name})")
        return
    # each supported attention module's forward swapped for the overlapped one (async_attention.py)
    patched, skipped = patch_async_attention(model)
    if skipped:
        logger.warning(
            f"enable_async: no overlapped adapter for {sorted(skipped)}; those layers run synchronous Ulysses"
        )
    logger.info(f"Ulysses sequence parallel ({name}), async on {patched} attention modules")
