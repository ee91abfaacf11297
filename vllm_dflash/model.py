"""The DFlash drafter in pure torch: one module for training, tests and serving.

Tokens are flat (`[T, ...]`, no batch dim), as in vLLM. The drafter never stores context K/V:
attention goes through an `attend` callable, so the same weights run against dense K/V
(`dense_attend`: training, tests) or a paged KV cache (serving).
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

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


def grouped_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                        block_len: int) -> torch.Tensor:
    """DFlash2's convolution along each block: out[t] = sum_o (base[o] + dynamic[t, o]) * x[t-o]
    with x[t-o] = 0 before the block's first token. x [T, H] holds T / block_len blocks;
    dynamic [T, taps, G] is one coefficient per channel group (H / G channels); base
    [taps, H]."""
    taps, groups = dynamic.shape[1:]
    hidden = x.shape[-1]
    # [N, L, H, taps] views: [..., j] = x[t - (taps - 1) + j], zeros before the block's start.
    windows = F.pad(x.view(-1, block_len, hidden), (0, 0, taps - 1, 0)).unfold(1, taps, 1)
    grouped = windows.view(*windows.shape[:2], groups, hidden // groups, taps)
    # Coefficients in the windows' order: [..., j] multiplies x[t - (taps - 1 - j)].
    dynamic = dynamic.view(-1, block_len, taps, groups).flip(2).transpose(2, 3)[..., None, :]
    out = (grouped * dynamic).sum(-1).flatten(2)
    out += (windows * base.flip(0).t().to(x.dtype)).sum(-1)
    return out.view_as(x)


class GroupedConv(nn.Module):
    """A DFlash2 layer's convolution pair around a sublayer: `prepare` convolves the sublayer's
    input and returns the coefficients that `finish` applies to its output; both sets come from
    the input (kernel_projection)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.taps = cfg.conv_kernel_size
        self.groups = cfg.hidden_size // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, cfg.hidden_size))
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * self.taps * self.groups,
                                           bias=False)

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(-1, 2, self.taps, self.groups)
        return grouped_causal_conv(x, dynamic[:, 0], self.base_kernel[0], block_len), dynamic[:, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block_len: int) -> torch.Tensor:
        return grouped_causal_conv(x, dynamic, self.base_kernel[1], block_len)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv = GroupedConv(cfg) if cfg.has_convs else None
        self.mlp_conv = GroupedConv(cfg) if cfg.has_convs else None

    def forward(self, h: torch.Tensor, rope: RopeTables, attend: LayerAttend,
                block_len: int | None = None) -> torch.Tensor:
        """block_len: the length of the equal blocks h holds; DFlash2 layers need it."""
        attention = partial(self.self_attn, rope=rope, attend=attend)
        h = h + convolved(self.attention_conv, attention, self.input_layernorm(h), block_len)
        return h + convolved(self.mlp_conv, self.mlp, self.post_attention_layernorm(h),
                             block_len)


def convolved(conv: GroupedConv | None, sublayer: Callable[[torch.Tensor], torch.Tensor],
              x: torch.Tensor, block_len: int | None) -> torch.Tensor:
    """sublayer(x), between conv's two convolutions where the layer has them (DFlash2)."""
    if conv is None:
        return sublayer(x)
    if block_len is None:
        raise ValueError("a DFlash2 drafter's forward needs block_len")
    x, dynamic = conv.prepare(x, block_len)
    return conv.finish(sublayer(x), dynamic, block_len)


class SelectorInputs(NamedTuple):
    """What a candidate selector reads beside the drafter's hidden states and logits."""

    anchors: torch.Tensor  # [B] anchor token ids (DFlash2's first edges start there)
    # LiLiCorr: [B, H] fused context state (DFlashDrafter.fuse) of each request's last
    # accepted token, and the target's embedding (token ids -> [..., H]).
    anchor_states: torch.Tensor | None = None
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None


class CandidateSelector(nn.Module):
    """DFlash2's draft choice. Each position keeps its top_k tokens by logit; an edge from the
    previous position's token u to candidate c scores logit(c) + <pred[u] * proj(h), succ[c]>,
    and the drafts are a walk from the anchor along the best (or a sampled) edge."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        # Parameters, not nn.Embedding: the checkpoint keys carry no ".weight".
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def scores(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor,
               unary: torch.Tensor) -> torch.Tensor:
        """fp32 scores [..., P, C] of the edges from tokens previous [..., P] to candidates
        [..., C] whose logits are unary [..., C], at hidden states [..., H]."""
        h = self.hidden_projection(hidden).float()
        pred = F.embedding(previous, self.predecessor_codebook).float() * h[..., None, :]
        succ = F.embedding(candidates, self.successor_codebook).float()
        return unary.float()[..., None, :] + pred @ succ.transpose(-1, -2)

    def edge_scores(self, hidden: torch.Tensor, logits: torch.Tensor, inputs: SelectorInputs
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, K, H], logits [B, K, V] -> candidates [B, K, k] and fp32 scores
        [B, K, k, k]: [b, p, i, j] for the edge from the previous position's i-th candidate
        (the anchor at p = 0, every i) to this position's j-th."""
        # topk in the logits' dtype (fp32 conversion is exact): no fp32 copy of [B, K, V].
        unary, candidates = logits.topk(self.top_k, dim=-1, sorted=False)
        previous = torch.cat([inputs.anchors.view(-1, 1, 1).expand(-1, 1, self.top_k),
                              candidates[:, :-1]], dim=1)
        return candidates, self.scores(hidden, previous, candidates, unary)


class LatticeLayer(nn.Module):
    """One pre-norm transformer layer over a LiLiCorr candidate lattice: full attention with a
    learned per-head additive bias (no mask, no KV cache), then a plain (ungated) MLP."""

    def __init__(self, hidden: int, num_heads: int, mlp_hidden: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = nn.Module()  # checkpoint keys: attn.in_proj_weight, attn.in_proj_bias, ...
        self.attn.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.attn.in_proj_bias = nn.Parameter(torch.empty(3 * hidden))
        self.attn.out_proj = nn.Linear(hidden, hidden)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(hidden, mlp_hidden)
        self.mlp.down_proj = nn.Linear(mlp_hidden, hidden)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """h [B, L, hidden], bias [heads, L, L] -> [B, L, hidden]."""
        batch, length, hidden = h.shape
        qkv = F.linear(self.attn_norm(h), self.attn.in_proj_weight, self.attn.in_proj_bias)
        q, k, v = (x.view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for x in qkv.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
        h = h + self.attn.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))
        return h + self.mlp.down_proj(F.silu(self.mlp.up_proj(self.mlp_norm(h))))


class LiLiCorrHead(nn.Module):
    """LiLiCorr's draft choice. Each draft position keeps its top_k tokens; a transformer reads
    the whole lattice of (position, candidate) pairs (token embedding, the drafter's hidden
    state there, the candidate's log-prob features) and gives every candidate an outgoing and
    an incoming unit vector, conditioned on the anchor's context state. An edge from candidate
    i at position p - 1 to candidate j at p scores logit_scale * <out[p-1, i], in[p, j]>; the
    anchor's own vector scores the first position. The drafts are the walk along these edges
    (the same walk as DFlash2's)."""

    NUM_FEATURES = 5  # log-prob, prob, log-prob minus the position's best, rank / (k-1), top-1

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        lc = cfg.lilicorr
        self.top_k, self.logit_scale, self.eps = lc.candidate_topk, lc.logit_scale, lc.vector_eps
        self.block_size = cfg.block_size
        hidden, slots = lc.hidden_size, cfg.block_size - 1
        # Linear layers with bias, as vLLM's ReplicatedLinear; token_proj only when the widths
        # differ (the checkpoint has no key otherwise).
        self.token_proj = nn.Identity() if hidden == cfg.hidden_size else nn.Linear(
            cfg.hidden_size, hidden)
        self.pass_hidden_proj = nn.Linear(cfg.hidden_size, hidden)
        self.context_proj = nn.Linear(cfg.hidden_size, hidden)
        self.feature_norm = nn.LayerNorm(self.NUM_FEATURES)
        self.feature_mlp = nn.Module()
        self.feature_mlp.up_proj = nn.Linear(self.NUM_FEATURES, hidden)
        self.feature_mlp.down_proj = nn.Linear(hidden, hidden)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, slots, 1, hidden))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.top_k, hidden))
        self.relative_slot_bias = nn.Parameter(torch.zeros(lc.num_heads, 2 * cfg.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(lc.num_heads))
        self.layers = nn.ModuleList(
            LatticeLayer(hidden, lc.num_heads, int(hidden * lc.mlp_ratio), cfg.rms_norm_eps)
            for _ in range(lc.num_layers))
        self.output_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.anchor_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        # Reads [state, anchor, state * anchor].
        self.factor_input_proj = nn.Linear(3 * hidden, hidden)
        self.out_head = nn.Linear(hidden, lc.factor_dim)
        self.in_head = nn.Linear(hidden, lc.factor_dim)
        self.anchor_out_head = nn.Linear(hidden, lc.factor_dim)

    def attention_bias(self, num_slots: int) -> torch.Tensor:
        """[heads, L, L] over the lattice flattened slot-major (L = num_slots * top_k): a learned
        weight per slot distance (indexed as trained at block_size - 1 slots, so a shorter
        draft reads the same weights), plus one for two candidates of the same slot."""
        slot = torch.arange(num_slots, device=self.same_slot_bias.device)
        slot = slot.repeat_interleave(self.top_k)
        distance = slot[:, None] - slot[None, :]
        same = (distance == 0).to(self.same_slot_bias.dtype)
        return (self.relative_slot_bias[:, distance + self.block_size - 1]
                + same * self.same_slot_bias[:, None, None])

    def features(self, log_probs: torch.Tensor) -> torch.Tensor:
        """[B, S, k] candidate log-probs (in rank order) -> [B, S, k, 5] fp32."""
        k = self.top_k
        rank = torch.arange(k, device=log_probs.device, dtype=torch.float32) / max(k - 1, 1)
        top1 = (torch.arange(k, device=log_probs.device) == 0).float()
        return torch.stack([log_probs, log_probs.exp(),
                            log_probs - log_probs.amax(dim=-1, keepdim=True),
                            rank.expand_as(log_probs), top1.expand_as(log_probs)], dim=-1)

    def edge_scores(self, hidden: torch.Tensor, logits: torch.Tensor, inputs: SelectorInputs
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As CandidateSelector.edge_scores; reads inputs.anchor_states and inputs.embed."""
        # Candidates in rank order, with log-probs over the whole vocabulary.
        log_probs, candidates = logits.float().log_softmax(dim=-1).topk(self.top_k, dim=-1)
        return candidates, self.scores(hidden, candidates, log_probs, inputs)

    def scores(self, hidden: torch.Tensor, candidates: torch.Tensor, log_probs: torch.Tensor,
               inputs: SelectorInputs) -> torch.Tensor:
        """fp32 edge scores [B, S, k, k] of candidates [B, S, k] (rank order) whose log-probs
        are log_probs [B, S, k], at the drafter's hidden states [B, S, H]."""
        batch, num_slots = hidden.shape[:2]
        dtype = self.slot_embedding.dtype
        h = (self.token_proj(inputs.embed(candidates).to(dtype))
             + self.pass_hidden_proj(hidden.to(dtype))[:, :, None]
             + self.feature_mlp.down_proj(F.silu(self.feature_mlp.up_proj(
                 self.feature_norm(self.features(log_probs).to(dtype)))))
             + self.slot_embedding[:, 0, :num_slots] + self.rank_embedding[:, 0])
        h = h.reshape(batch, num_slots * self.top_k, -1)
        bias = self.attention_bias(num_slots).to(dtype)
        for layer in self.layers:
            h = layer(h, bias)
        h = self.output_norm(h).view(batch, num_slots, self.top_k, -1)
        anchor = self.anchor_norm(self.context_proj(inputs.anchor_states.to(dtype)))
        a = anchor[:, None, None]
        factors = F.silu(self.factor_input_proj(torch.cat([h, a.expand_as(h), h * a], dim=-1)))
        out_vec = F.normalize(self.out_head(factors), dim=-1, eps=self.eps)
        in_vec = F.normalize(self.in_head(factors), dim=-1, eps=self.eps)
        anchor_out = F.normalize(self.anchor_out_head(anchor), dim=-1, eps=self.eps)
        start = (anchor_out[:, None] * in_vec[:, 0]).sum(dim=-1)  # [B, k]
        pairs = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)  # [B, S-1, k, k]
        first = start[:, None, None, :].expand(-1, 1, self.top_k, -1)
        return self.logit_scale * torch.cat([first, pairs], dim=1).float()


def walk(candidates: torch.Tensor, next_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's walk from the anchor: next_index [B, K, k] names, for each position p and
    candidate i taken at p - 1 (row 0 at p = 0), the candidate to take at p. Returns the tokens
    [B, K] and the rows [B, K] it took them from (the index taken at p - 1)."""
    index = candidates.new_zeros(candidates.shape[0], 1)
    rows, taken = [], []
    for p in range(candidates.shape[1]):
        rows.append(index)
        index = next_index[:, p].gather(1, index)
        taken.append(index)
    tokens = candidates.gather(2, torch.cat(taken, dim=1)[..., None])[..., 0]
    return tokens, torch.cat(rows, dim=1)


class DFlashDrafter(nn.Module):
    """Parameter names are the z-lab checkpoint keys, so `load_state_dict` takes them as is.

    Embedding and lm_head belong to the target and are passed in (`embed`, `logits`); a LiLiCorr
    drafter may have its own lm_head (`has_own_lm_head`), which then gives its logits.
    """

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.is_dflash2 else None
        self.lilicorr = LiLiCorrHead(cfg) if cfg.lilicorr is not None else None
        self.lm_head = (nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                        if cfg.has_own_lm_head else None)
        self.scale = cfg.head_dim**-0.5
        # Not a buffer: keeps state_dict() equal to the checkpoint keys, and lets a model built
        # on the meta device get its table on first use.
        self._cos_sin: torch.Tensor | None = None

    @property
    def selector(self) -> CandidateSelector | LiLiCorrHead | None:
        """The head that chooses the drafts among each position's candidates, if any."""
        return self.candidate_selector if self.lilicorr is None else self.lilicorr

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
        self, block_embeds: torch.Tensor, positions: torch.Tensor, attend: Attend,
        block_len: int | None = None,
    ) -> torch.Tensor:
        """Block embeddings [Tq, H] at positions [Tq] -> final-normed hidden states [Tq, H].
        block_len: the length of the equal blocks of Tq (DFlash2 convolves along them)."""
        rope = rope_tables(positions, self.rope_cache(block_embeds.device))
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, partial(attend, i), block_len)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits through the target's lm_head [V, H]."""
        logits = F.linear(hidden, lm_head_weight) * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, token_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Block embeddings through the target's embedding table [V, H], in the drafter's
        dtype (the table may be the target's, in another)."""
        rows = F.embedding(token_ids, embed_weight).to(self.fc.weight.dtype)
        return rows * self.cfg.input_embedding_scale


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
