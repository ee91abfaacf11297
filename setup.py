"""Build script: the compiled kernels of csrc/ (package metadata lives in pyproject.toml).

- `vllm_dflash._C_cpu`, the CPU kernels (csrc/cpu/: draft attention, KV injection, RMSNorm,
  RoPE): built whenever torch is importable at build time (`pip install --no-build-isolation .`)
  and a C++ compiler works. They are compiled for the build machine's CPU (-march=native); set
  VLLM_DFLASH_CPU_MARCH (e.g. x86-64-v3) to build a binary for other machines.
  VLLM_DFLASH_BUILD_CPU=0 never builds them; =1 makes a failure an error.
- `vllm_dflash._C`, the CUDA kernels: built when nvcc is found and torch is a CUDA build.
  VLLM_DFLASH_BUILD_CUDA=0 never builds them; =1 makes a missing requirement an error.
Without an extension the Triton / torch paths are used.
"""

import importlib.util
import os
import shutil
import sys

from setuptools import setup


def _torch_skip_reason() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not importable at build time (use pip install --no-build-isolation)"
    return None


def _cpu_skip_reason() -> str | None:
    """None when the CPU extension can be built, else why not."""
    reason = _torch_skip_reason()
    if reason is None and shutil.which(os.environ.get("CXX", "c++")) is None:
        reason = "no C++ compiler (install g++ or set CXX)"
    return reason


def _cuda_skip_reason() -> str | None:
    """None when the CUDA extension can be built, else why not."""
    reason = _torch_skip_reason()
    if reason is not None:
        return reason
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if nvcc is None or not os.path.exists(nvcc):
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def _wanted(kind: str, flag_name: str, skip_reason: str | None) -> bool:
    """Whether to build the `kind` extension; a refusal is printed, or fatal under flag=1."""
    flag = os.environ.get(flag_name, "").strip()
    reason = f"{flag_name}=0" if flag == "0" else skip_reason
    if reason is None:
        return True
    if flag == "1":
        sys.exit(f"vllm-dflash: {flag_name}=1 but cannot build the {kind} kernels: {reason}")
    print(f"vllm-dflash: skipping the {kind} kernels: {reason}; Triton/torch paths will be used")
    return False


def _build_kwargs() -> dict:
    extensions = []
    if _wanted("CPU", "VLLM_DFLASH_BUILD_CPU", _cpu_skip_reason()):
        from torch.utils.cpp_extension import CppExtension

        march = os.environ.get("VLLM_DFLASH_CPU_MARCH", "native")
        extensions.append(CppExtension(
            name="vllm_dflash._C_cpu",
            sources=["csrc/cpu/torch_bindings.cpp", "csrc/cpu/draft_attention.cpp",
                     "csrc/cpu/kv_injection.cpp", "csrc/cpu/norm_rope.cpp"],
            depends=["csrc/cpu/ops.h", "csrc/kv_injection_args.h", "csrc/kv_injection_params.h",
                     "csrc/python_module.h"],
            # -fopenmp: ATen's parallel_for runs its loop in OpenMP threads only when compiled so.
            extra_compile_args=["-O3", f"-march={march}", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ))
    if _wanted("CUDA", "VLLM_DFLASH_BUILD_CUDA", _cuda_skip_reason()):
        from torch.utils.cpp_extension import CUDAExtension

        extensions.append(CUDAExtension(
            name="vllm_dflash._C",
            sources=["csrc/torch_bindings.cpp", "csrc/kv_injection.cu"],
            depends=["csrc/kv_injection.h", "csrc/kv_injection_args.h",
                     "csrc/kv_injection_params.h", "csrc/python_module.h"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
        ))
    if not extensions:
        return {}
    from torch.utils.cpp_extension import BuildExtension

    return {"ext_modules": extensions, "cmdclass": {"build_ext": BuildExtension}}


setup(**_build_kwargs())
