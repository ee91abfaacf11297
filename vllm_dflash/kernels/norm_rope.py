"""RMSNorm and RoPE as the drafter calls them: the compiled CPU ops (csrc/cpu/norm_rope.cpp)
at inference on CPU, Triton kernels at inference on CUDA, else the torch references in
`vllm_dflash/layers.py` (training, an install without the extension). At a few requests a
draft layer is mostly op overhead, and the references are ~7 ops each: a 5-layer drafter step
calls 21 norms and 10 rotations, ~200 small kernels on a GPU, each a node of the step's CUDA
graph."""

import torch
import triton
import triton.language as tl

from vllm_dflash import layers
from vllm_dflash.kernels import _compiled
from vllm_dflash.layers import RopeTables


def _inference(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """x contiguous, and no autograd graph to record."""
    return x.is_contiguous() and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.rms_norm`: Qwen3 RMSNorm over the last dim."""
    if _inference(x, weight) and weight.dtype == x.dtype:
        if x.is_cuda:
            return rms_norm_triton(x, weight, eps)
        if _compiled.cpu_available():
            return torch.ops.vllm_dflash_cpu.rms_norm(x, weight, eps)
    return layers.rms_norm(x, weight, eps)


def rotate(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """`layers.rotate`: RoPE of x [T, heads, head_dim] by `layers.rope_tables`."""
    if _inference(x):
        if x.is_cuda:
            return rotate_triton(x, tables)
        if _compiled.cpu_available():
            return torch.ops.vllm_dflash_cpu.rotate(x, *tables)
    return layers.rotate(x, tables)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    # One row per program, in fp32 as the reference: normalize, cast, then times the weight.
    row = tl.program_id(0).to(tl.int64) * dim
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.rms_norm` in one kernel; x contiguous, weight of x's dtype."""
    assert x.is_contiguous() and weight.dtype == x.dtype, (x.stride(), weight.dtype, x.dtype)
    out = torch.empty_like(x)
    dim = x.shape[-1]
    if x.numel():
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(x.numel() // dim,)](x, weight, out, dim, eps, BLOCK=block,
                                              num_warps=min(max(block // 256, 1), 8))
    return out


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One token per program, all its heads: out = x * cos + [x2, x1] * sin, in fp32.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (d < HALF)
    at = token * num_heads * 2 * HALF + heads * 2 * HALF + d
    x1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
    table = token * 2 * HALF + d
    cos1 = tl.load(cos_ptr + table, mask=d < HALF, other=0.0)
    cos2 = tl.load(cos_ptr + table + HALF, mask=d < HALF, other=0.0)
    sin1 = tl.load(sin_ptr + table, mask=d < HALF, other=0.0)
    sin2 = tl.load(sin_ptr + table + HALF, mask=d < HALF, other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + at, (x1 * cos1 + x2 * sin1).to(dtype), mask=mask)
    tl.store(out_ptr + at + HALF, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)


def rotate_triton(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """`layers.rotate` in one kernel; x [T, heads, head_dim] contiguous, tables as
    `layers.rope_tables` makes them ([T, 1, head_dim] fp32, contiguous)."""
    cos, sin = tables
    assert x.is_contiguous(), x.stride()
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty_like(x)
    if num_tokens:
        half = head_dim // 2
        _rotate_kernel[(num_tokens,)](
            x, cos.contiguous(), sin.contiguous(), out, num_heads, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half))
    return out
