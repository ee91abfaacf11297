"""Random kernel inputs shaped as vLLM passes them: paged KV caches in strided layouts, ragged
draft attention batches, KV injection batches and verification batches.

The kernel tests, benchmarks/kernels.py and scripts/gpu_check.py build their inputs here. Each
builder draws from its own generator on the target device: a seed gives the same batch on every
call, whatever ran before.
"""

import itertools
import math
from collections.abc import Sequence

import torch

from vllm_dflash.kernels.verify import sampling_probs
from vllm_dflash.layers import rope_cos_sin_cache

EPS = 1e-6  # injection_batch's RMSNorm epsilon
THETA = 10000.0  # injection_batch's default RoPE base


def paged_cache(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                dtype: torch.dtype, layout: str, gen: torch.Generator) -> torch.Tensor:
    """Random cache of logical shape [num_blocks, Hkv, block_size, 2D] on gen's device, stored
    as `layout`: "contiguous"; "permuted" (vLLM's, [num_blocks, block_size, Hkv, 2D] storage);
    "padded" (rows longer than 2D); "strided_dim" (innermost stride 2)."""
    shape = (num_blocks, num_kv_heads, block_size, 2 * head_dim)
    device = gen.device
    if layout == "contiguous":
        cache = torch.empty(shape, dtype=dtype, device=device)
    elif layout == "permuted":
        cache = torch.empty(num_blocks, block_size, num_kv_heads, 2 * head_dim, dtype=dtype,
                            device=device).permute(0, 2, 1, 3)
    elif layout == "padded":
        cache = torch.empty(*shape[:3], 2 * head_dim + 8, dtype=dtype, device=device)
        cache = cache[..., :2 * head_dim]
    elif layout == "strided_dim":
        cache = torch.empty(*shape, 2, dtype=dtype, device=device)[..., 0]
    else:
        raise ValueError(f"unknown cache layout {layout!r}")
    return cache.copy_(torch.randn(shape, generator=gen, device=device))


def block_table(blocks_needed: Sequence[int], num_blocks: int, width: int,
                gen: torch.Generator) -> torch.Tensor:
    """[len(blocks_needed), width] int32 on gen's device: row r starts with blocks_needed[r]
    distinct blocks, dealt in turn from a shuffle of all num_blocks; its other entries are
    valid but wrong block ids, so that reading one shows as a mismatch."""
    table = torch.randint(0, num_blocks, (len(blocks_needed), width), generator=gen,
                          dtype=torch.int32, device=gen.device)
    shuffled = torch.randperm(num_blocks, generator=gen, device=gen.device)
    start = 0
    for row, count in enumerate(blocks_needed):
        table[row, :count] = shuffled[start:start + count]
        start += count
    return table


def attention_batch(context_lens: Sequence[int], query_lens: Sequence[int], num_heads: int,
                    num_kv_heads: int, head_dim: int, dtype: torch.dtype, layout: str,
                    seed: int = 0, block_size: int = 4,
                    device: torch.device | str = "cpu") -> dict:
    """Arguments of draft_attention_* (without scale and mask flags) for a ragged batch: request
    r attends to context_lens[r] cached tokens and its query_lens[r] queries. The block table
    has two spare columns and the cache three spare blocks; q, k and v are strided views of one
    fused qkv projection."""
    gen = torch.Generator(device).manual_seed(seed)
    blocks_needed = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_needed) + 3
    table = block_table(blocks_needed, num_blocks, max(blocks_needed) + 2, gen)
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen,
                      device=device)
    q, k, v = qkv.to(dtype).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return {
        "q": q.view(num_tokens, num_heads, head_dim),
        "k": k.view(num_tokens, num_kv_heads, head_dim),
        "v": v.view(num_tokens, num_kv_heads, head_dim),
        "kv_cache": paged_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, layout,
                                gen),
        "block_table": table,
        "context_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor([0, *itertools.accumulate(query_lens)],
                                        dtype=torch.int32, device=device),
    }


def injection_batch(num_tokens: int, hidden: int, num_layers: int, num_kv_heads: int,
                    head_dim: int, dtype: torch.dtype, layouts: Sequence[str], seed: int = 0,
                    block_size: int = 4, max_position: int = 200, rope_theta: float = THETA,
                    device: torch.device | str = "cpu") -> dict:
    """Arguments of kv_injection_* for num_tokens tokens at random positions below max_position,
    every fifth one padding (slot -1); layer i's cache is stored as layouts[i % len(layouts)],
    with four blocks more than the tokens need."""
    gen = torch.Generator(device).manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) + 4
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[::5] = -1
    weight = torch.randn(num_layers * 2 * num_kv_heads * head_dim, hidden, generator=gen,
                         device=device)
    return {
        "ctx": torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype),
        "positions": torch.randint(0, max_position, (num_tokens,), generator=gen, device=device),
        "slot_mapping": slots,
        "kv_weight": (weight / math.sqrt(hidden)).to(dtype),
        "k_norm_weight": (torch.rand(num_layers, head_dim, generator=gen, device=device)
                          + 0.5).to(dtype),
        "eps": EPS,
        "cos_sin_cache": rope_cos_sin_cache(head_dim, max_position, rope_theta, device),
        "kv_caches": [paged_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype,
                                  layouts[i % len(layouts)], gen) for i in range(num_layers)],
    }


def with_padding(args: dict, padding: str) -> dict:
    """injection_batch's arguments, in place, with its padding tokens kept ("some"), dropped
    ("none"), or every token padding ("all")."""
    if padding == "none":
        keep = args["slot_mapping"] >= 0
        args |= {name: args[name][keep] for name in ("ctx", "positions", "slot_mapping")}
    elif padding == "all":
        args["slot_mapping"][:] = -1
    elif padding != "some":
        raise ValueError(f"unknown padding {padding!r}")
    return args


def with_cache_copies(args: dict) -> dict:
    """injection_batch's arguments with fresh copies of the caches (same strides, same
    values): one kernel writes these while another writes the originals."""
    copies = []
    for cache in args["kv_caches"]:
        copy = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype,
                                   device=cache.device)
        copies.append(copy.copy_(cache))
    return {**args, "kv_caches": copies}


def cu_num_draft_tokens(counts: Sequence[int],
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """vLLM's cu_num_draft_tokens: the running totals of the requests' draft counts, int32."""
    return torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def verify_batch(batch: int = 12, max_spec_len: int = 5, vocab: int = 2500, seed: int = 0,
                 device: torch.device | str = "cpu") -> dict:
    """Arguments of verify_* (without generators) for a ragged batch: request 0 drafts nothing,
    request 1 max_spec_len tokens, the others a random number; about 30% of the requests are
    greedy. The targets are sampling_probs at temperature 0.7, top-k 40 and top-p 0.9 (zeros
    included); drafts are sampled from draft_probs near them, the first third replaced by the
    target's argmax (accepted), the last by vLLM's padding id -1. Draft row 1 is twice its
    target row, unnormalised: a zero residual, which falls back to the target. The default
    vocab spans several of the Triton kernel's vocabulary blocks."""
    gen = torch.Generator(device).manual_seed(seed)
    counts = torch.randint(0, max_spec_len + 1, (batch,), generator=gen, device=device).tolist()
    counts[0], counts[1] = 0, max_spec_len
    num_tokens = sum(counts)
    logits = torch.randn(num_tokens, vocab, generator=gen, device=device)
    target_probs = sampling_probs(logits, torch.full((num_tokens,), 0.7, device=device),
                                  torch.full((num_tokens,), 40, device=device),
                                  torch.full((num_tokens,), 0.9, device=device))
    noise = torch.randn(num_tokens, vocab, generator=gen, device=device)
    draft_probs = torch.softmax(logits + noise, dim=-1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen)[:, 0]
    drafts[:num_tokens // 3] = target_probs[:num_tokens // 3].argmax(dim=-1)
    drafts[-1] = -1
    draft_probs[1] = 2 * target_probs[1]
    return {
        "draft_token_ids": drafts,
        "cu_num_draft_tokens": cu_num_draft_tokens(counts, device),
        "max_spec_len": max_spec_len,
        "draft_probs": draft_probs,
        "target_probs": target_probs,
        "bonus_token_ids": torch.randint(vocab, (batch,), generator=gen, device=device),
        "is_greedy": torch.rand(batch, generator=gen, device=device) < 0.3,
    }
