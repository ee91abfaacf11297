"""KV injection: target-context features of newly accepted tokens -> K/V of every draft layer.

In every DFlash draft layer the context tokens only contribute K/V (DFLASH.md section 2):
k = RoPE(k_norm(ctx @ Wk^T)), v = ctx @ Wv^T. Both are pure functions of `ctx`, so they are computed
once per accepted token, for all layers at once, and written into the layers' paged KV caches.

Paged cache of one layer (vLLM 0.32): logical shape [num_blocks, num_kv_heads, block_size,
2 * head_dim], K in [..., :head_dim], V in [..., head_dim:], any strides.
slot = block_id * block_size + offset_in_block; slot < 0 marks padding and is skipped.

Five paths with one signature: the compiled CUDA op (`csrc/kv_injection.cu`), one Triton kernel
for all layers (a per-layer pointer/stride table), the compiled CPU op
(`csrc/cpu/kv_injection.cpp`), the torch fallback where that is not built, and the pure-torch
reference, layer by layer, that the others are tested against.
"""

from collections.abc import Sequence
from functools import lru_cache

import torch
import triton
import triton.language as tl

from vllm_dflash.kernels import _compiled
from vllm_dflash.layers import apply_rope, rms_norm


def _project(ctx: torch.Tensor, kv_weight: torch.Tensor, num_layers: int) -> torch.Tensor:
    """One GEMM for all layers: [T, H] -> [T, L, 2, Hkv*D] (contiguous)."""
    width = kv_weight.shape[0] // (2 * num_layers)
    return (ctx @ kv_weight.t()).view(ctx.shape[0], num_layers, 2, width)


def _check_shapes(
    ctx: torch.Tensor, kv_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
) -> tuple[int, int, int]:
    """Returns (num_layers, num_kv_heads, head_dim)."""
    num_layers, head_dim = k_norm_weight.shape
    assert len(kv_caches) == num_layers, (len(kv_caches), num_layers)
    num_kv_heads = kv_caches[0].shape[1]
    assert kv_weight.shape == (num_layers * 2 * num_kv_heads * head_dim, ctx.shape[1])
    for cache in kv_caches:
        assert cache.dim() == 4 and cache.shape[1] == num_kv_heads
        assert cache.shape[3] == 2 * head_dim and cache.dtype == kv_caches[0].dtype
    return num_layers, num_kv_heads, head_dim


def kv_injection_reference(
    ctx: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
) -> None:
    """Test oracle, layer by layer: writes K/V of all layers into `kv_caches` in place.

    ctx [T, H], positions [T] int64, slot_mapping [T] int64, kv_weight [L*2*Hkv*D, H]
    (per layer [k_proj.weight; v_proj.weight]), k_norm_weight [L, D], cos_sin_cache [max_pos, D].
    """
    num_layers, num_kv_heads, head_dim = _check_shapes(ctx, kv_weight, k_norm_weight, kv_caches)
    valid = slot_mapping >= 0
    kv = _project(ctx[valid], kv_weight, num_layers)
    positions, slots = positions[valid], slot_mapping[valid]
    block_size = kv_caches[0].shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    for layer, cache in enumerate(kv_caches):
        k = kv[:, layer, 0].view(-1, num_kv_heads, head_dim)
        v = kv[:, layer, 1].view(-1, num_kv_heads, head_dim)
        k = apply_rope(rms_norm(k, k_norm_weight[layer], eps), positions, cos_sin_cache)
        cache[blocks, :, offsets] = torch.cat([k, v], dim=-1).to(cache.dtype)


def kv_injection_torch(
    ctx: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
) -> None:
    """Torch fallback (CPU): `kv_injection_reference`'s result, bit for bit, in fewer ops.

    k_norm and RoPE run once for all layers, and padding (slot < 0) is filtered out only when
    the step has some: boolean indexing costs a pass and a host sync per tensor.
    """
    num_layers, num_kv_heads, head_dim = _check_shapes(ctx, kv_weight, k_norm_weight, kv_caches)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        keep = valid.nonzero()[:, 0]
        ctx, positions, slot_mapping = ctx[keep], positions[keep], slot_mapping[keep]
    num_tokens = ctx.shape[0]
    kv = _project(ctx, kv_weight, num_layers).view(num_tokens, num_layers, 2, num_kv_heads,
                                                   head_dim)
    k = rms_norm(kv[:, :, 0], k_norm_weight[:, None], eps)  # [T, L, Hkv, D]
    k = apply_rope(k.flatten(1, 2), positions, cos_sin_cache).view_as(k)
    kv = torch.cat([k, kv[:, :, 1]], dim=-1)  # [T, L, Hkv, 2D]
    block_size = kv_caches[0].shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for layer, cache in enumerate(kv_caches):
        cache[blocks, :, offsets] = kv[:, layer].to(cache.dtype)


@lru_cache(maxsize=16)
def _cache_table(
    device: torch.device, entries: tuple[tuple[int, int, int, int, int], ...]
) -> torch.Tensor:
    """[L, 5] int64 on `device`: (data_ptr, stride_block, stride_head, stride_slot, stride_dim).

    Memoised: vLLM's caches never move, so steady state costs no host->device copy.
    """
    return torch.tensor(entries, dtype=torch.int64).to(device)


def _kv_cache_table(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-layer pointer/stride table of the paged caches, read by the Triton kernel."""
    entries = tuple((c.data_ptr(), *c.stride()) for c in kv_caches)
    return _cache_table(kv_caches[0].device, entries)


@triton.jit
def _kv_injection_kernel(
    kv_ptr,  # [T, L, 2, Hkv, D] contiguous
    positions_ptr,
    slot_mapping_ptr,
    k_norm_weight_ptr,  # [L, D] contiguous
    cos_sin_ptr,  # [max_pos, D] fp32 contiguous
    table_ptr,  # [L, 5] int64, see _cache_table
    eps,
    CACHE_DTYPE: tl.constexpr,
    NUM_LAYERS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per (token, layer): all KV heads of that layer, each head as two halves
    # (x1 = [:D/2], x2 = [D/2:]) so that the neox rotate-half RoPE needs no shuffles.
    token = tl.program_id(0)
    layer = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    pos = tl.load(positions_ptr + token)
    half = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < half
    mask = (h < NUM_KV_HEADS) & d_mask

    k_src = kv_ptr + ((token * NUM_LAYERS + layer) * 2 * NUM_KV_HEADS + h) * HEAD_DIM + d
    v_src = k_src + NUM_KV_HEADS * HEAD_DIM
    k1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + half, mask=mask, other=0.0).to(tl.float32)
    v1 = tl.load(v_src, mask=mask)
    v2 = tl.load(v_src + half, mask=mask)

    # k_norm (RMSNorm over head_dim, fp32)
    inv_rms = tl.rsqrt((tl.sum(k1 * k1, axis=1) + tl.sum(k2 * k2, axis=1)) / HEAD_DIM + eps)
    w = k_norm_weight_ptr + layer * HEAD_DIM + d
    k1 = k1 * inv_rms[:, None] * tl.load(w, mask=d_mask).to(tl.float32)
    k2 = k2 * inv_rms[:, None] * tl.load(w + half, mask=d_mask).to(tl.float32)

    # RoPE (neox): [x1 cos - x2 sin, x2 cos + x1 sin]
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + d, mask=d_mask)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + d, mask=d_mask)
    o1 = k1 * cos - k2 * sin
    o2 = k2 * cos + k1 * sin

    entry = table_ptr + layer * 5
    cache = tl.load(entry).to(tl.pointer_type(CACHE_DTYPE))
    stride_block = tl.load(entry + 1)
    stride_head = tl.load(entry + 2)
    stride_slot = tl.load(entry + 3)
    stride_dim = tl.load(entry + 4)
    dst = (cache + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
           + h * stride_head + d * stride_dim)
    tl.store(dst, o1.to(CACHE_DTYPE), mask=mask)
    tl.store(dst + half * stride_dim, o2.to(CACHE_DTYPE), mask=mask)
    tl.store(dst + HEAD_DIM * stride_dim, v1.to(CACHE_DTYPE), mask=mask)
    tl.store(dst + (HEAD_DIM + half) * stride_dim, v2.to(CACHE_DTYPE), mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def kv_injection_triton(
    ctx: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
) -> None:
    """Same contract as `kv_injection_reference`: torch GEMM, then one Triton launch."""
    num_layers, num_kv_heads, head_dim = _check_shapes(ctx, kv_weight, k_norm_weight, kv_caches)
    num_tokens = ctx.shape[0]
    if num_tokens == 0:
        return
    kv = _project(ctx, kv_weight, num_layers)
    _kv_injection_kernel[(num_tokens, num_layers)](
        kv,
        positions,
        slot_mapping,
        k_norm_weight.contiguous(),
        cos_sin_cache.contiguous(),
        _kv_cache_table(kv_caches),
        eps,
        CACHE_DTYPE=_TL_DTYPES[kv_caches[0].dtype],
        NUM_LAYERS=num_layers,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_caches[0].shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )


def kv_injection(
    ctx: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
) -> None:
    """Dispatch: the compiled op of ctx's device where it is built, else Triton on CUDA and
    the torch fallback on CPU."""
    args = (ctx, positions, slot_mapping, kv_weight, k_norm_weight, eps, cos_sin_cache, kv_caches)
    compiled = _compiled.cuda_available() if ctx.is_cuda else _compiled.cpu_available()
    if compiled:
        num_layers = _check_shapes(ctx, kv_weight, k_norm_weight, kv_caches)[0]
        _compiled.kv_injection_write(
            _project(ctx, kv_weight, num_layers), positions, slot_mapping,
            k_norm_weight, eps, cos_sin_cache, kv_caches,
        )
    elif ctx.is_cuda:
        kv_injection_triton(*args)
    else:
        kv_injection_torch(*args)
