"""The optional compiled CUDA extension `vllm_dflash._C` (csrc/, built by setup.py where nvcc
and a CUDA build of torch are present). Importing it registers `torch.ops.vllm_dflash.*`."""

from collections.abc import Sequence

import torch

try:
    from vllm_dflash import _C  # noqa: F401
except ImportError as e:  # not built (CPU machine, pure-Python install) or not loadable
    import_error: str | None = str(e)
else:
    import_error = None


def available() -> bool:
    """True when the compiled extension is importable."""
    return import_error is None


def kv_injection_write(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
) -> None:
    """k_norm + RoPE + paged write of kv [T, L, 2, Hkv*D] (the fused k/v GEMM output)."""
    torch.ops.vllm_dflash.kv_injection_write(
        kv, positions, slot_mapping, k_norm_weight, eps, cos_sin_cache, list(kv_caches)
    )
