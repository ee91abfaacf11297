"""The benchmarked methods: each is a speculative_config plus the engine's environment.

`vllm-dflash` drafts with the adaptive draft length (the default); `vllm-dflash-kN` always
drafts N tokens (VLLM_DFLASH_DRAFT_LENGTH=fixed, num_speculative_tokens=N); either with
`+lookup` also takes prompt-lookup drafts (VLLM_DFLASH_PROMPT_LOOKUP=on). Extra
--speculative-config keys (draft_sample_method, synthetic acceptance, ...) go to every DFlash
method, this package's and vLLM's in-tree one alike.
"""

import json
import re
from pathlib import Path

from vllm_dflash.vllm.config import DRAFT_LENGTH_ENV, IMPL_ENV, PROMPT_LOOKUP_ENV

METHODS = ("none", "vllm-dflash", "vllm-inproc-dflash", "ngram")
FIXED = re.compile(r"vllm-dflash-k([1-9][0-9]*)")
LOOKUP = "+lookup"
BASELINE = "none"
# vLLM's documented prompt-lookup window for ngram speculation.
NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}


def check_methods(methods: list[str]) -> None:
    unknown = [m for m in methods if not _known(m)]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(METHODS)}, vllm-dflash-kN (a fixed draft length N), "
                         f"vllm-dflash{LOOKUP} and vllm-dflash-kN{LOOKUP} (with prompt lookup)")


def _known(method: str) -> bool:
    if uses_lookup(method):
        method = method.removesuffix(LOOKUP)
        return method == "vllm-dflash" or FIXED.fullmatch(method) is not None
    return method in METHODS or FIXED.fullmatch(method) is not None


def uses_lookup(method: str) -> bool:
    return method.endswith(LOOKUP)


def fixed_draft_length(method: str) -> int | None:
    match = FIXED.fullmatch(method.removesuffix(LOOKUP))
    return int(match.group(1)) if match else None


def speculative_config(method: str, draft: str, num_speculative_tokens: int,
                       extra: dict | None = None) -> dict | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                **NGRAM_LOOKUP}
    k = fixed_draft_length(method) or num_speculative_tokens
    return {"method": "dflash", "model": draft, "num_speculative_tokens": k, **(extra or {})}


def method_env(method: str) -> dict[str, str]:
    """`vllm-inproc-dflash` is vLLM's in-tree DFlash: the plugin steps aside."""
    fixed = fixed_draft_length(method) is not None
    return {IMPL_ENV: "vllm" if method == "vllm-inproc-dflash" else "vllm-dflash",
            DRAFT_LENGTH_ENV: "fixed" if fixed else "adaptive",
            PROMPT_LOOKUP_ENV: "on" if uses_lookup(method) else "off"}


def color(method: str) -> str:
    """The same colour for a method in both plots."""
    k = fixed_draft_length(method)
    if uses_lookup(method):
        return "C8" if k is None else "C9"
    return f"C{METHODS.index(method) if k is None else len(METHODS) + k.bit_length() - 1}"


def default_num_speculative_tokens(draft: str) -> int:
    """block_size - 1 of the drafter: a local directory or a hub id."""
    config_file = Path(draft) / "config.json"
    if not config_file.is_file():
        from huggingface_hub import hf_hub_download

        config_file = Path(hf_hub_download(draft, "config.json"))
    config = json.loads(config_file.read_text())
    block_size = config.get("dflash_config", {}).get("block_size") or config.get("block_size", 16)
    return int(block_size) - 1
