"""What one benchmark run is (one method, one concurrency, one engine) and what it measures."""

from dataclasses import asdict, dataclass

from vllm_dflash.bench.counters import SpecCounters, acceptance
from vllm_dflash.bench.methods import speculative_config

# Warm-up prompts get this prefix so that their prefix-cache entries do not serve the timed run.
WARMUP_PREFIX = "Warm-up. "
WARMUP_TOKENS = 16


@dataclass
class RunSpec:
    mode: str  # "offline" (vllm.LLM) or "server" (OpenAI server + streaming clients)
    method: str
    concurrency: int
    target: str
    draft: str
    num_speculative_tokens: int
    prompts: list[str]  # the timed requests, in order
    max_tokens: int
    temperature: float  # 0: greedy
    speculative_extra: dict  # more --speculative-config keys for the DFlash methods
    dtype: str
    enforce_eager: bool
    max_model_len: int | None

    def speculative_config(self) -> dict | None:
        return speculative_config(self.method, self.draft, self.num_speculative_tokens,
                                  self.speculative_extra)

    def warmup_prompts(self) -> list[str]:
        return [WARMUP_PREFIX + p for p in self.prompts[: self.concurrency]]

    def warmup_tokens(self) -> int:
        return min(WARMUP_TOKENS, self.max_tokens)


def measured(token_ids: list[list[int]], seconds: float, counters: SpecCounters,
             peak_rss_mib: float) -> dict:
    """The numbers every run reports; server runs add their latencies."""
    tokens = sum(len(ids) for ids in token_ids)
    return {
        "requests": len(token_ids),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        **acceptance(counters),
        "spec_counters": asdict(counters),
        "peak_rss_mib": peak_rss_mib,
        "token_ids": token_ids,
    }
