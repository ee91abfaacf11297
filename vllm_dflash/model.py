"""The DFlash drafter in pure torch: one module for training, tests and serving.

Tokens are flat (`[T, ...]`, no batch dim), as in vLLM. The drafter never stores context K/V:
attention goes through an `attend` callable, so the same weights run against dense K/V
(`dense_attend`: training, tests) or a paged KV cache (serving).
"""

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from vllm_dflash.config import DFlashConfig
from vllm_dflash.kernels.norm_rope import rms_norm, rotate
from vllm_dflash.layers import RopeTables, rope_cos_sin_cache, rope_tables

KV = tuple[torch.Tensor, torch.Tensor]
# attend(layer_idx, q [Tq, Hq, D], k [Tq, Hkv, D], v [Tq, Hkv, D]) -> [Tq, Hq, D], where k/v are
# the block tokens' own K/V; the callable adds that layer's context K/V.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LayerAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: RopeTables) -> KV:
        """K/V of tokens x [T, H]: k_proj -> k_norm -> RoPE; v_proj. Context and block alike."""
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return rotate(k, rope), v

    def forward(self, x: torch.Tensor, rope: RopeTables, attend: LayerAttend) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        q = rotate(q, rope)
        k, v = self.kv(x, rope)
        return self.o_proj(attend(q, k, v).flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: RopeTables, attend: LayerAttend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """Parameter names are the z-lab checkpoint keys, so `load_state_dict` takes them as is.

    Embedding and lm_head belong to the target and are passed in (`embed`, `logits`).
    """

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        # Not a buffer: keeps state_dict() equal to the checkpoint keys, and lets a model built
        # on the meta device get its table on first use.
        self._cos_sin: torch.Tensor | None = None

    def rope_cache(self, device: torch.device, min_positions: int = 0) -> torch.Tensor:
        """[P, head_dim] fp32 cos|sin table, P = max(max_position_embeddings, min_positions),
        built on first use and rebuilt larger when asked for more positions."""
        cfg = self.cfg
        positions = max(cfg.max_position_embeddings, min_positions)
        table = self._cos_sin
        if table is None or table.device != device or table.shape[0] < positions:
            self._cos_sin = rope_cos_sin_cache(cfg.head_dim, positions, cfg.rope_theta, device)
        return self._cos_sin

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, K*H_target] -> context states [T, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Per-layer context K/V ([T, Hkv, D] each) of fused states ctx [T, H] at positions [T].

        A pure function of the target features: compute it once per accepted token and cache it.
        """
        rope = rope_tables(positions, self.rope_cache(ctx.device))
        return [layer.self_attn.kv(ctx, rope) for layer in self.layers]

    def kv_weight(self) -> torch.Tensor:
        """[L*2*Hkv*D, H]: per layer [k_proj.weight; v_proj.weight], for a fused KV kernel.

        Built on each call (a copy): callers cache it. No bias term: needs attention_bias=False.
        """
        if self.cfg.attention_bias:
            raise NotImplementedError("kv_weight() has no bias term; attention_bias is set")
        attns = [layer.self_attn for layer in self.layers]
        return torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])

    def k_norm_weight(self) -> torch.Tensor:
        """[L, D] k_norm weights, matching kv_weight()'s layer order. Built on each call."""
        return torch.stack([layer.self_attn.k_norm.weight for layer in self.layers])

    def forward(
        self, block_embeds: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Block embeddings [Tq, H] at positions [Tq] -> final-normed hidden states [Tq, H]."""
        rope = rope_tables(positions, self.rope_cache(block_embeds.device))
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, partial(attend, i))
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits through the target's lm_head [V, H]."""
        logits = F.linear(hidden, lm_head_weight) * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, token_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Block embeddings through the target's embedding table [V, H]."""
        return F.embedding(token_ids, embed_weight) * self.cfg.input_embedding_scale


def block_mask(
    context_len: int,
    block_len: int,
    causal: bool,
    window: int | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Bool mask [block_len, context_len + block_len] (True = visible) for one request.

    Keys are the context at positions 0..context_len-1 followed by the block; block token i sits
    at position context_len + i. Non-causal windows extend both ways, as in the reference.
    """
    q_pos = torch.arange(context_len, context_len + block_len, device=device)[:, None]
    k_pos = torch.arange(context_len + block_len, device=device)[None, :]
    visible = torch.ones(block_len, context_len + block_len, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
        if not causal:
            visible &= k_pos - q_pos < window
    return visible


def dense_attend(
    context_kv: list[KV], mask: torch.Tensor | list[torch.Tensor], scale: float
) -> Attend:
    """Attend over [context K/V; block K/V] with SDPA.

    mask: bool [Tq, Tc+Tq] for every layer, or one per layer (sliding layers differ).
    """
    masks = mask if isinstance(mask, list) else [mask] * len(context_kv)

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx_k, ctx_v = context_kv[layer_idx]
        groups = q.shape[1] // k.shape[1]
        # SDPA wants [heads, T, D]; GQA by repeating each KV head for its query group.
        k = torch.cat([ctx_k, k]).repeat_interleave(groups, dim=1).transpose(0, 1)
        v = torch.cat([ctx_v, v]).repeat_interleave(groups, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=masks[layer_idx], scale=scale
        )
        return out.transpose(0, 1)

    return attend
