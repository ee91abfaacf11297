"""An fp8 KV cache for the target (`kv_cache_dtype="fp8"`): the drafter's context cache keeps
the model dtype; greedy output equals the fp8 engine's without speculation."""

import torch

from tests.engines import (
    TRAINED,
    dflash_llm,
    generate_ids,
    greedy_baseline,
    heldout_prompts,
    spec_metrics,
)


def cache_dtypes(worker) -> tuple[set, set]:
    """In the worker: the dtypes of the target's KV caches (fp8 is stored as uint8 bytes) and
    of the drafter's."""
    runner = worker.model_runner
    draft = [layer.kv_cache for layer in runner.drafter.draft_runner.kv_layers]
    target = [c for c in runner.kv_caches if not any(c.data_ptr() == d.data_ptr() for d in draft)]
    return {c.dtype for c in target}, {c.dtype for c in draft}


def test_fp8_kv_cache_equals_no_speculation():
    prompts = heldout_prompts(8)
    want = greedy_baseline(TRAINED.target, prompts, 48, kv_cache_dtype="fp8")
    llm = dflash_llm(TRAINED, TRAINED.block_size - 1, kv_cache_dtype="fp8")
    target_dtypes, draft_dtypes = llm.collective_rpc(cache_dtypes)[0]
    assert target_dtypes == {torch.uint8} and draft_dtypes == {torch.float32}
    assert generate_ids(llm, prompts, max_tokens=48, ignore_eos=True) == want
    assert spec_metrics(llm)["accepted"] > 0
