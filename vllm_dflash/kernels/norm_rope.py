"""RMSNorm and RoPE as the drafter calls them: the compiled CPU ops (csrc/cpu/norm_rope.cpp)
at inference on CPU, else the torch references in `vllm_dflash/layers.py` (training, CUDA, an
install without the extension). At a few requests a draft layer is mostly op overhead, and the
references are ~7 ops each."""

import torch

from vllm_dflash import layers
from vllm_dflash.kernels import _compiled
from vllm_dflash.layers import RopeTables


def _compiled_applies(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """CPU, the extension built, x contiguous, and no autograd graph to record."""
    return (x.device.type == "cpu" and _compiled.cpu_available() and x.is_contiguous()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.rms_norm`: Qwen3 RMSNorm over the last dim."""
    if _compiled_applies(x, weight) and weight.dtype == x.dtype:
        return torch.ops.vllm_dflash_cpu.rms_norm(x, weight, eps)
    return layers.rms_norm(x, weight, eps)


def rotate(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """`layers.rotate`: RoPE of x [T, heads, head_dim] by `layers.rope_tables`."""
    if _compiled_applies(x):
        return torch.ops.vllm_dflash_cpu.rotate(x, *tables)
    return layers.rotate(x, tables)
