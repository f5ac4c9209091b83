"""The model as the planner's formulas see it: sizes read from the HF config, and FLOPs and activation bytes per
token derived from them.

Activation bytes are what autograd keeps from forward to backward, counted tensor by tensor for the decoder layer
transformers runs (c: compute dtype bytes, 2 for bf16; f = 4, fp32):
    RMSNorm (x.float(), * rsqrt, .to(c), * weight)   fp32 copy of x (f*h; none when c == f) + normalised x (c*h)
    attention  q, k after RoPE and v (c*(nh + 2*nkv)*dh), output (c*nh*dh), log-sum-exp (f*nh); Qwen3's per-head
               q/k norms keep their own fp32 copy and output as a norm does; projections save their input, which is
               already counted (the norm's output, the attention output)
    dense MLP  gate, up, silu(gate), silu(gate)*up: 4*c*I (down saves the last one)
    MoE        router logits (c*E) and fp32 softmax (f*E); per routed copy (top-k per token): the gathered row
               (c*h), gate_up (2*c*Im), silu(gate) and the product (2*c*Im), the expert output (c*h); with expert
               parallel the received rows, their expert-major copy and the returned output (3*c*h)
Tensor parallel splits everything but the norms by tp; Ulysses splits every tensor by sp (attention sees the full
sequence for 1/sp of the heads: the same bytes). With activation checkpointing a layer keeps only its input (c*h)
and one layer at a time is recomputed in backward.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

F32 = 4


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    moe_layers: int = 0
    qk_norm: bool = False
    router_logits: bool = False  # output_router_logits: the aux loss is logged beside the loss

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_metric_values(self) -> int:
        """What veomni.trainer.moe_metrics packs beside the loss: the aux sum (with router logits) and a
        [MoE layers, experts] count table."""
        return int(self.router_logits) + self.moe_layers * self.experts if self.is_moe else 0

    def tp_refusal(self, tp: int) -> Optional[str]:
        """Why tensor parallel of size `tp` cannot split this model, or None when it can."""
        if self.is_moe:
            return "tensor parallel does not take MoE models (use EP)"
        if any(size % tp for size in (self.heads, self.kv_heads, self.intermediate, self.vocab)):
            return f"heads, KV heads, intermediate or vocab size not divisible by {tp}"
        return None

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        router_logits = bool(getattr(config, "output_router_logits", False))  # the model's, as MoEMetrics reads it
        config = getattr(config, "get_text_config", lambda: config)()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        experts = getattr(config, "num_experts", None) or 0
        layers = config.num_hidden_layers
        moe_layers = 0
        if experts:
            step = getattr(config, "decoder_sparse_step", 1) or 1
            dense = set(getattr(config, "mlp_only_layers", None) or [])
            moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            model_type=config.model_type,
            hidden=config.hidden_size,
            layers=layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            experts=experts,
            top_k=getattr(config, "num_experts_per_tok", 0) or 0,
            moe_intermediate=getattr(config, "moe_intermediate_size", 0) or 0,
            moe_layers=moe_layers,
            qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
            router_logits=router_logits,
        )

    # ------------------------------------------------------------------------------------------- FLOPs
    def matmul_params(self, experts: int) -> int:
        """Weights of the layers (with `experts` experts of each MoE layer) and of the output head: top_k gives what
        each token multiplies by, all experts the model's size."""
        h, attn = self.hidden, self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        dense_mlp = 3 * h * self.intermediate
        moe_mlp = experts * 3 * h * self.moe_intermediate + h * self.experts
        mlps = (self.layers - self.moe_layers) * dense_mlp + self.moe_layers * moe_mlp
        return self.layers * attn + mlps + self.vocab * h

    @property
    def billions(self) -> float:
        """Total parameters in billions (the input embedding too, unless tied to the head)."""
        return (self.matmul_params(self.experts) + (0 if self.tied else self.vocab * self.hidden)) / 1e9

    def flops_per_token(self, context: int, checkpointing: bool) -> float:
        """Training FLOPs of one token: 2 per weight in forward, 4 in backward (6N), plus causal attention over a
        document of `context` tokens (QK^T and PV: 4*nh*dh*context/2 forward); recomputation adds a forward."""
        passes = 4 if checkpointing else 3  # forward counted as 1, backward as 2
        linear = 2 * self.matmul_params(self.top_k)
        attention = 4 * self.heads * self.head_dim * (context / 2) * self.layers
        return passes * (linear + attention)

    # ------------------------------------------------------------------------------------- activations
    def _norm_bytes(self, width: int, c: int) -> int:
        return (F32 * width if c != F32 else 0) + c * width + F32

    def layer_activation_bytes(self, c: int, tp: int, ep: int, moe: bool) -> float:
        """Bytes one (MoE or dense) decoder layer keeps per (local) token; see the module docstring."""
        h, nh, nkv, dh = self.hidden, self.heads, self.kv_heads, self.head_dim
        norms = 2 * self._norm_bytes(h, c)
        attention = (c * (nh + 2 * nkv) * dh + c * nh * dh + F32 * nh) / tp
        if self.qk_norm:
            attention += (self._norm_bytes(nh * dh, c) + self._norm_bytes(nkv * dh, c)) / tp
        if moe:
            per_copy = c * h + 4 * c * self.moe_intermediate + c * h + (3 * c * h if ep > 1 else 0)
            mlp = (c + F32) * self.experts + self.top_k * per_copy
        else:
            mlp = 4 * c * self.intermediate / tp
        return norms + attention + mlp

    def activation_bytes(self, tokens: int, c: int, tp: int, ep: int, checkpointing: bool) -> Tuple[float, float]:
        """(kept from forward to backward, one layer's working set in backward) for `tokens` local tokens."""
        layers = {True: self.moe_layers, False: self.layers - self.moe_layers}  # MoE and dense layers
        per_layer = {moe: self.layer_activation_bytes(c, tp, ep, moe) for moe, n in layers.items() if n}
        if checkpointing:
            kept = self.layers * c * self.hidden
        else:
            kept = sum(layers[moe] * size for moe, size in per_layer.items())
        kept += self._norm_bytes(self.hidden, c)  # the final norm
        # backward of one layer: its recomputed activations (checkpointing) or their gradients, about as large
        return tokens * kept, tokens * max(per_layer.values())

    def loss_bytes(self, tokens: int, c: int, chunk: int, tp: int) -> float:
        """Peak of the output head and loss. Chunked (fused linear + cross-entropy): the fp32 head gradient
        accumulated in forward and its compute-dtype copy (V*h*(f + c)), the input gradient (c*h per token) and one
        chunk's fp32 logits with their compute-dtype softmax gradient. Tensor parallel: a checkpointed chunk of
        vocab-sharded logits. Unchunked: compute-dtype logits, their fp32 copy and the softmax (c + 2f per logit)."""
        vocab = self.vocab // tp
        if chunk <= 0:
            return tokens * vocab * (c + 2 * F32)
        rows = min(chunk, tokens)
        if tp > 1:
            return rows * vocab * 3 * F32 + tokens * c * self.hidden
        return vocab * self.hidden * (F32 + c) + tokens * c * self.hidden + rows * vocab * (F32 + c)
