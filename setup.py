"""Build script: the optional CUDA kernels (csrc/) as the extension `vllm_dflash._C`.

Package metadata lives in pyproject.toml. The extension is built when nvcc is found and torch is
a CUDA build; otherwise the install is pure Python (Triton / torch paths). torch must be
importable at build time for the extension (`pip install --no-build-isolation .`).
VLLM_DFLASH_BUILD_CUDA=0 never builds it; =1 makes a missing requirement an error.
"""

import importlib.util
import os
import shutil
import sys

from setuptools import setup


def _cuda_skip_reason() -> str | None:
    """None when the CUDA extension can be built, else why not."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not importable at build time (use pip install --no-build-isolation)"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if nvcc is None or not os.path.exists(nvcc):
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def _build_kwargs() -> dict:
    flag = os.environ.get("VLLM_DFLASH_BUILD_CUDA", "").strip()
    reason = "VLLM_DFLASH_BUILD_CUDA=0" if flag == "0" else _cuda_skip_reason()
    if reason is not None:
        if flag == "1":
            sys.exit(f"vllm-dflash: VLLM_DFLASH_BUILD_CUDA=1 but cannot build CUDA kernels: "
                     f"{reason}")
        print(f"vllm-dflash: skipping CUDA kernels: {reason}; Triton/torch paths will be used")
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    extension = CUDAExtension(
        name="vllm_dflash._C",
        sources=["csrc/torch_bindings.cpp", "csrc/kv_injection.cu"],
        depends=["csrc/kv_injection.h"],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**_build_kwargs())
