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


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its absolute positions [T] (rotate-half / neox layout)."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
