"""Small pure-torch building blocks shared by the drafter and the kernel references."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm over the last dim, computed in fp32 and cast back."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos in the first half, sin in the second (neox style)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


RopeTables = tuple[torch.Tensor, torch.Tensor]


def rope_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> RopeTables:
    """cos and sin [T, 1, head_dim] fp32 at positions [T], each half repeated and sin's first
    half negated: what `rotate` multiplies every head by. Built once per forward pass and
    shared by every layer's queries and keys."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """RoPE of x [T, heads, head_dim] (rotate-half / neox layout), computed in fp32:
    [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]."""
    cos, sin = tables
    half = x.shape[-1] // 2
    xf = x.float()
    swapped = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + swapped * sin).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its absolute positions [T]."""
    return rotate(x, rope_tables(positions, cos_sin_cache))


def exponential_(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fills x in place with Exp(1) draws, as -log(U) with U ~ U[0, 1) (U = 0 gives +inf),
    and returns it. The same distribution as torch's `exponential_`, which on CPU is ~5x
    slower (6.8 against 1.3 ms for [112, 4096] fp32 on one core)."""
    return x.uniform_(generator=generator).log_().neg_()
