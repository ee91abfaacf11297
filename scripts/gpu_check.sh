#!/usr/bin/env bash
# One GPU check of vllm-dflash (a single H200 run of under 8 minutes): versions, CUDA extension
# build, kernel parity on the GPU, the step-cost benchmark with CUDA graphs, the kernel tests
# and, where vLLM is installed, greedy output with DFlash == without through vllm.LLM.
# Steps and options: scripts/gpu_check.py (it imports this checkout, installed or not).
# Exit status 1 when a check fails.
#   bash scripts/gpu_check.sh --out DIR [--budget-s 460] [--only parity,bench]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/gpu_check.py "$@"
