"""One run through vllm.LLM(): the engine runs in this process, capped at max_num_seqs = C."""

import os
import time

from vllm_dflash.bench.counters import from_llm_metrics, peak_rss_mib
from vllm_dflash.bench.runspec import RunSpec, measured


def run(spec: RunSpec) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec.target, dtype=spec.dtype, enforce_eager=spec.enforce_eager,
        max_model_len=spec.max_model_len, max_num_seqs=spec.concurrency, seed=0,
        disable_log_stats=False,
        speculative_config=spec.speculative_config(),
    )
    warmup = SamplingParams(temperature=0.0, max_tokens=spec.warmup_tokens())
    llm.generate(spec.warmup_prompts(), warmup, use_tqdm=False)
    before = from_llm_metrics(llm.get_metrics())
    params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(spec.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = from_llm_metrics(llm.get_metrics()).minus(before)
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return measured(token_ids, seconds, counters, peak_rss_mib(os.getpid())) | {
        "ttft_ms": None, "itl_ms": None,
    }
