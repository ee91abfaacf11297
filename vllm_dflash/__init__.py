"""vllm-dflash: DFlash block-diffusion speculative decoding for vLLM."""

__version__ = "0.1.0"
