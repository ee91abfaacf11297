"""The benchmarked methods: each is a speculative_config plus the engine's environment."""

import json
from pathlib import Path

from vllm_dflash.plugin import IMPL_ENV

METHODS = ("none", "vllm-dflash", "vllm-inproc-dflash", "ngram")
BASELINE = "none"
# vLLM's documented prompt-lookup window for ngram speculation.
NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}


def check_methods(methods: list[str]) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")


def speculative_config(method: str, draft: str, num_speculative_tokens: int) -> dict | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                **NGRAM_LOOKUP}
    return {"method": "dflash", "model": draft, "num_speculative_tokens": num_speculative_tokens}


def method_env(method: str) -> dict[str, str]:
    """`vllm-inproc-dflash` is vLLM's in-tree DFlash: the plugin steps aside."""
    return {IMPL_ENV: "vllm" if method == "vllm-inproc-dflash" else "vllm-dflash"}


def default_num_speculative_tokens(draft: str) -> int:
    """block_size - 1 of the drafter: a local directory or a hub id."""
    config_file = Path(draft) / "config.json"
    if not config_file.is_file():
        from huggingface_hub import hf_hub_download

        config_file = Path(hf_hub_download(draft, "config.json"))
    config = json.loads(config_file.read_text())
    block_size = config.get("dflash_config", {}).get("block_size") or config.get("block_size", 16)
    return int(block_size) - 1
