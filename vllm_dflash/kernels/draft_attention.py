"""Draft attention: the block queries of a ragged batch over their paged context K/V plus the
block's own K/V (DFLASH.md sections 2-3).

Request r owns the queries q[query_start_loc[r]:query_start_loc[r+1]], at absolute positions
context_lens[r] + i. Its keys are the context, positions 0..context_lens[r]-1, read from the
paged cache through block_table[r], followed by the block's own k/v (never written to the
cache: they are discarded after the draft). Cache layout (vLLM 0.32): [num_blocks, Hkv,
block_size, 2 * D], K in [..., :D], V in [..., D:], any strides.

Masks: non-causal without window: every key of the request (context and whole block).
causal: key_pos <= query_pos. sliding window w: causal -> query_pos - key_pos < w,
non-causal -> |query_pos - key_pos| < w.

Four paths: a flash-style Triton kernel (online softmax, fp32 accumulation, GQA heads packed into
the query tile) on CUDA; a C++ kernel on CPU (csrc/cpu/draft_attention.cpp) that reads the pages
in place; the torch fallback, every request at once, where that kernel is not built; the
pure-torch reference, one request at a time, that all three are tested against. No CUDA version:
see csrc/kv_injection.cu.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_dflash.kernels import _compiled


@dataclass
class DraftBatch:
    """Where each request's block sits: its context for the paged draft attention, its
    position for RoPE."""

    block_table: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: valid context tokens = the anchor's index
    query_start_loc: torch.Tensor  # [B+1] int32: B blocks of block_len queries
    # [B] int32: the anchor's RoPE position; its index, except under M-RoPE after an image
    anchor_positions: torch.Tensor


def _mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, sliding_window: int | None
) -> torch.Tensor:
    """[Q, S] bool: which keys each query attends to."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if sliding_window is not None:
        mask &= diff.abs() < sliding_window
    return mask


def draft_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """Test oracle, one request at a time, fp32 softmax.

    q [Tq, Hq, D], k/v [Tq, Hkv, D], kv_cache [num_blocks, Hkv, block_size, 2D],
    block_table [N, max_blocks] int32, context_lens [N] int32, query_start_loc [N+1] int32.
    Returns [Tq, Hq, D] in q's dtype (rows past query_start_loc[-1] are left undefined).
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    bounds = query_start_loc.tolist()
    for r, ctx_len in enumerate(context_lens.tolist()):
        start, end = bounds[r], bounds[r + 1]
        blocks = block_table[r, : math.ceil(ctx_len / block_size)].long()
        ctx = kv_cache[blocks].transpose(1, 2).reshape(-1, num_kv_heads, 2 * head_dim)[:ctx_len]
        keys = torch.cat([ctx[..., :head_dim], k[start:end]]).float()
        values = torch.cat([ctx[..., head_dim:], v[start:end]]).float()
        positions = torch.arange(ctx_len + end - start, device=q.device)
        mask = _mask(positions[ctx_len:], positions, causal, sliding_window)
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def draft_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Torch fallback (CPU): `draft_attention_reference` for all requests at once, fp32 softmax.

    The reference loops over requests, ~40 ops each per layer; here a layer costs a fixed ~50
    ops whatever the batch size. Requests are padded to max_query_len queries (nothing to pad
    for the proposer's equal blocks) and to the cache blocks of the longest context.
    max_query_len: see `draft_attention_triton`.
    """
    num_requests, num_tokens = context_lens.shape[0], q.shape[0]
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max()) if num_requests else 0
    if num_requests == 0 or max_query_len == 0 or num_tokens == 0:
        return torch.empty_like(q)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    rows = _padded_rows(query_start_loc, num_tokens, max_query_len)
    # The scale goes on the queries: fewer values than on the scores.
    qg = _heads_second(_take(q, rows) * scale, num_requests, group)  # [N, Hkv, Lq * group, D]
    block_k = _heads_second(_take(k, rows), num_requests, 1)  # [N, Hkv, Lq, D]
    block_v = _heads_second(_take(v, rows), num_requests, 1)
    ctx = _context_blocks(kv_cache, block_table, context_lens).float()  # [N, Hkv, S, 2D]
    num_ctx = ctx.shape[2]
    ctx_k, ctx_v = ctx[..., :head_dim], ctx[..., head_dim:]
    scores = torch.cat([qg @ ctx_k.mT, qg @ block_k.mT], dim=-1)
    scores = scores.view(num_requests, num_kv_heads, max_query_len, group, -1)
    query_lens = None if rows is None else query_start_loc.diff()
    hidden = _hidden_keys(context_lens, num_ctx, query_lens, max_query_len, causal,
                          sliding_window)
    probs = scores.masked_fill_(hidden[:, None, :, None], float("-inf")).softmax(dim=-1)
    probs = probs.flatten(2, 3)
    out = probs[..., :num_ctx] @ ctx_v + probs[..., num_ctx:] @ block_v  # [N, Hkv, Lq*group, D]
    out = out.view(num_requests, num_kv_heads, max_query_len, group, head_dim).transpose(1, 2)
    out = out.reshape(-1, *q.shape[1:]).to(q.dtype)
    if rows is None:
        return out
    # Padded query rows land in a spare last row.
    result = q.new_empty(num_tokens + 1, *q.shape[1:])
    result[torch.where(rows >= 0, rows, num_tokens)] = out
    return result[:num_tokens]


def _padded_rows(
    query_start_loc: torch.Tensor, num_tokens: int, max_query_len: int
) -> torch.Tensor | None:
    """[N * Lq] the row of query i of request r (query_start_loc[r] + i), -1 for padding; None
    when there is no padding: every request has Lq queries and q no rows past them."""
    num_requests = query_start_loc.shape[0] - 1
    if num_tokens == num_requests * max_query_len and int(query_start_loc[-1]) == num_tokens:
        return None
    rows = query_start_loc[:-1, None] + torch.arange(max_query_len, device=query_start_loc.device)
    return torch.where(rows < query_start_loc[1:, None], rows, -1).flatten()


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x's rows in padded order (padding reads row 0), fp32."""
    return (x if rows is None else x[rows.clamp(min=0)]).float()


def _heads_second(x: torch.Tensor, num_requests: int, group: int) -> torch.Tensor:
    """[N * Lq, Hkv * group, D] -> [N, Hkv, Lq * group, D], row = query * group + head in group:
    the layout of `_context_blocks`, so each matmul batches (request, KV head) without copies."""
    num_kv_heads, head_dim = x.shape[1] // group, x.shape[2]
    x = x.view(num_requests, -1, num_kv_heads, group, head_dim).transpose(1, 2)
    return x.reshape(num_requests, num_kv_heads, -1, head_dim)


def _context_blocks(
    kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """[N, Hkv, S, 2D]: the first S slots of every request, S = the longest context rounded up
    to whole blocks; one index_select of whole blocks (copied again only when S > one block).

    Slots past a request's context hold its stale slots or other requests' K/V: finite values
    (vLLM zero-fills the cache and only writes K/V to it) that the mask gives probability 0.
    """
    num_kv_heads, block_size, width = kv_cache.shape[1:]
    num_blocks = -(-int(context_lens.max()) // block_size)
    blocks = kv_cache.index_select(0, block_table[:, :num_blocks].flatten())
    num_requests = context_lens.shape[0]
    blocks = blocks.view(num_requests, num_blocks, num_kv_heads, block_size, width).transpose(1, 2)
    return blocks.reshape(num_requests, num_kv_heads, num_blocks * block_size, width)


def _hidden_keys(
    context_lens: torch.Tensor, num_ctx: int, query_lens: torch.Tensor | None,
    max_query_len: int, causal: bool, sliding_window: int | None,
) -> torch.Tensor:
    """[N, Lq, num_ctx + Lq] bool, True = hidden; keys: num_ctx context slots, then the block.

    Causality never hides a context key (all precede every query). Within the block the mask is
    the same for every request, and padded queries (query_lens None: none) are no keys.
    """
    device = context_lens.device
    offsets = torch.arange(max_query_len, device=device)
    ctx_pos = torch.arange(num_ctx, device=device)
    ctx_hidden = ctx_pos >= context_lens[:, None, None]  # [N, 1, S]
    if sliding_window is not None:
        q_pos = context_lens[:, None, None] + offsets[:, None]  # [N, Lq, 1]
        ctx_hidden = ctx_hidden | (q_pos - ctx_pos >= sliding_window)
    block_hidden = ~_mask(offsets, offsets, causal, sliding_window)  # [Lq, Lq]
    if query_lens is not None:
        block_hidden = block_hidden | (offsets >= query_lens[:, None, None])  # [N, Lq, Lq]
    shape = (context_lens.shape[0], max_query_len, -1)
    return torch.cat([ctx_hidden.expand(shape), block_hidden.expand(shape)], dim=-1)


@triton.jit
def _attend_tile(
    q, k_t, v, q_pos, k_pos, k_valid, m_i, l_i, acc, scale_log2, window,
    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, WIDEN_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a key tile: k_t [D, N], v [N, D], k_pos/k_valid [N]."""
    mask = k_valid[None, :]
    diff = q_pos[:, None] - k_pos[None, :]
    if CAUSAL:
        mask &= diff >= 0
    if SLIDING:
        mask &= tl.abs(diff) < window
    if WIDEN_DOT:
        k_t = k_t.to(tl.float32)
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v.dtype)
    if WIDEN_DOT:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _draft_attention_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, out_ptr,
    block_table_ptr, context_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_ch, stride_cs, stride_cd,
    stride_bt,
    scale_log2,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid (request, kv head, query tile). A tile holds BLOCK_Q queries x the GROUP query heads
    # sharing this kv head: row = query * GROUP_PAD + head-in-group.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_lo = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_lo >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + req)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = q_lo + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (qi < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx_len + qi
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if WIDEN_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)

    # Context keys from the paged cache (all before every query: only the window can hide them).
    ctx_lo = 0
    if SLIDING:
        ctx_lo = tl.maximum(ctx_len + q_lo - window + 1, 0) // BLOCK_N * BLOCK_N
    for n_lo in range(ctx_lo, ctx_len, BLOCK_N):
        k_pos = n_lo + n
        k_valid = k_pos < ctx_len
        block = tl.load(block_table_ptr + req * stride_bt + k_pos // BLOCK_SIZE, mask=k_valid)
        kv_base = (cache_ptr + block.to(tl.int64) * stride_cb + kv_head * stride_ch
                   + (k_pos % BLOCK_SIZE) * stride_cs)
        kv_mask = k_valid[:, None] & d_valid[None, :]
        kv_mask_t = d_valid[:, None] & k_valid[None, :]
        k_t = tl.load(kv_base[None, :] + d[:, None] * stride_cd, mask=kv_mask_t, other=0.0)
        v = tl.load(kv_base[:, None] + (HEAD_DIM + d[None, :]) * stride_cd, mask=kv_mask,
                    other=0.0)
        m_i, l_i, acc = _attend_tile(q, k_t, v, q_pos, k_pos, k_valid, m_i, l_i, acc,
                                     scale_log2, window, CAUSAL, SLIDING, WIDEN_DOT,
                                     DOT_PRECISION)

    # The block's own keys (not in the cache).
    n_hi = q_len
    if CAUSAL:
        n_hi = tl.minimum(q_len, q_lo + BLOCK_Q)
    for n_lo in range(0, n_hi, BLOCK_N):
        j = n_lo + n
        k_valid = j < q_len
        kv_mask = k_valid[:, None] & d_valid[None, :]
        kv_mask_t = d_valid[:, None] & k_valid[None, :]
        k_t = tl.load(k_ptr + (q_start + j)[None, :] * stride_kt + kv_head * stride_kh
                      + d[:, None] * stride_kd, mask=kv_mask_t, other=0.0)
        v = tl.load(v_ptr + (q_start + j)[:, None] * stride_vt + kv_head * stride_vh
                    + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k_t, v, q_pos, ctx_len + j, k_valid, m_i, l_i, acc,
                                     scale_log2, window, CAUSAL, SLIDING, WIDEN_DOT,
                                     DOT_PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# The Triton interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies bf16 dot operands as raw
# integers. There the operands, already rounded to their dtype, are widened to fp32 for tl.dot
# (WIDEN_DOT): the same exact products that a bf16 tensor core accumulates in fp32.
_INTERPRETED = triton.knobs.runtime.interpret


def tile_config(dtype: torch.dtype, head_dim: int, group: int, max_query_len: int) -> dict:
    """The launch's tile constexprs and pipeline depth (num_stages) for `dtype`."""
    group_pad = triton.next_power_of_2(group)
    # fp32 on an H200: "ieee" dots of these tiles had not compiled after 3 minutes, and 64-key
    # tiles in 3 stages asked for 256 KiB of shared memory (227 KiB there). tf32x3 keeps fp32
    # accuracy on tensor cores; 32-key tiles in 2 stages fit.
    fp32 = dtype == torch.float32
    return {
        "BLOCK_D": max(triton.next_power_of_2(head_dim), 16),
        "GROUP_PAD": group_pad,
        # ~64 rows per tile, at least 16 (the smallest tl.dot).
        "BLOCK_Q": max(min(triton.next_power_of_2(max_query_len), 64 // group_pad),
                       16 // group_pad, 1),
        "BLOCK_N": 32 if fp32 else 64,
        "DOT_PRECISION": "tf32x3" if fp32 else "tf32",
        "num_stages": 2 if fp32 else 3,
    }


def draft_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Same contract as `draft_attention_reference`. max_query_len: a host-side bound on the
    per-request query lengths (the grid size); computed from query_start_loc, a device sync,
    when not given."""
    num_requests = context_lens.shape[0]
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    assert num_heads % num_kv_heads == 0 and kv_cache.shape[1] == num_kv_heads
    assert kv_cache.shape[3] == 2 * head_dim
    if max_query_len is None:
        query_lens = query_start_loc.diff()
        max_query_len = int(query_lens.max()) if num_requests else 0
    out = torch.empty_like(q)
    if max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    tiles = tile_config(q.dtype, head_dim, group, max_query_len)
    grid = (num_requests, num_kv_heads, triton.cdiv(max_query_len, tiles["BLOCK_Q"]))
    _draft_attention_kernel[grid](
        q, k, v, kv_cache, out,
        block_table, context_lens, query_start_loc,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *kv_cache.stride(),
        block_table.stride(0),
        scale * math.log2(math.e),
        sliding_window or 0,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_SIZE=kv_cache.shape[2],
        CAUSAL=causal,
        SLIDING=sliding_window is not None,
        WIDEN_DOT=_INTERPRETED,
        **tiles,
    )
    return out


def draft_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """The C++ CPU kernel (csrc/cpu/draft_attention.cpp), same contract as
    `draft_attention_reference`; the last dim of q, k, v and kv_cache must be contiguous."""
    return torch.ops.vllm_dflash_cpu.draft_attention(
        q, k, v, kv_cache, block_table, context_lens, query_start_loc, scale, causal,
        sliding_window or 0,
    )


def draft_attention_path(device: torch.device) -> str:
    """The path `draft_attention` takes on `device` (for the start-up log)."""
    if device.type == "cuda":
        return "triton"
    return "c++" if _compiled.cpu_available() else "torch"


def draft_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Dispatch: Triton on CUDA; on CPU the C++ kernel where it is built and the last dims are
    contiguous (vLLM's caches and the drafter's q/k/v views are), else the torch fallback.
    max_query_len: see Triton."""
    args = (q, k, v, kv_cache, block_table, context_lens, query_start_loc, scale, causal,
            sliding_window)
    if q.is_cuda:
        return draft_attention_triton(*args, max_query_len=max_query_len)
    if _compiled.cpu_available() and all(t.stride(-1) == 1 for t in (q, k, v, kv_cache)):
        return draft_attention_cpu(*args)
    return draft_attention_torch(*args, max_query_len=max_query_len)
