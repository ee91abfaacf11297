"""The compiled extensions that setup.py builds from csrc/; importing one registers its torch
ops.

- `vllm_dflash._C_cpu` (`torch.ops.vllm_dflash_cpu`): CPU draft attention, KV injection and the
  drafter's RMSNorm and RoPE (csrc/cpu/), built wherever torch and a C++ compiler are present at install time
  (`pip install --no-build-isolation`).
- `vllm_dflash._C` (`torch.ops.vllm_dflash`): the CUDA KV-injection kernel (csrc/*.cu), built
  where nvcc and a CUDA build of torch are.
A missing extension leaves the Triton / torch paths in use.
"""

import importlib
from collections.abc import Sequence

import torch


def _import(module: str) -> str | None:
    """None when `module` imports, else why not."""
    try:
        importlib.import_module(module)
    except ImportError as e:  # not built (pure-Python install) or not loadable
        return str(e)
    return None


cpu_import_error = _import("vllm_dflash._C_cpu")
cuda_import_error = _import("vllm_dflash._C")


def cpu_available() -> bool:
    """True when the CPU kernels are importable."""
    return cpu_import_error is None


def cuda_available() -> bool:
    """True when the CUDA kernels are importable."""
    return cuda_import_error is None


def kv_injection_write(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
) -> None:
    """k_norm + RoPE + paged write of kv [T, L, 2, Hkv*D] (the fused k/v GEMM output), by the
    CUDA or the CPU op as kv's device says."""
    ops = torch.ops.vllm_dflash if kv.is_cuda else torch.ops.vllm_dflash_cpu
    ops.kv_injection_write(
        kv, positions, slot_mapping, k_norm_weight, eps, cos_sin_cache, list(kv_caches)
    )

