"""The committed trained pair (tests/fixtures/pair): real acceptance through vLLM on held-out
prompts the drafter never saw, equal to the reference package's, with lossless output."""

import time

import pytest
import torch

from tests.engines import (
    TRAINED,
    Pair,
    dflash_llm,
    generate_ids,
    heldout_ids,
    plain_llm,
    spec_metrics,
)

MAX_NEW_TOKENS = 64
MIN_ACCEPTANCE = 2.5


@pytest.fixture(scope="module")
def pair() -> Pair:
    return TRAINED


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return heldout_ids()


@pytest.fixture(scope="module")
def plugin_run(pair, prompt_ids):
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    baseline = plain_llm(pair.target)
    want = generate_ids(baseline, prompts, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    del baseline
    llm = dflash_llm(pair, pair.block_size - 1)  # built last: its metrics are the live ones
    got = generate_ids(llm, prompts, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    metrics = spec_metrics(llm)
    return want, got, 1 + metrics["accepted"] / metrics["drafts"]


def reference_acceptance(pair: Pair, prompt_ids: list[list[int]]) -> float:
    """Mean acceptance length of dflash==0.1.0's own generate loop, on the same prompts, counted
    as vLLM counts it: every verified block whole (vLLM truncates to max_tokens after counting),
    one block per step that starts before max_tokens output tokens."""
    import dflash.model as ref
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    drafter = ref.DFlashDraftModel.from_pretrained(pair.drafter, dtype=torch.float32).eval()
    # return_stats=True times with torch.cuda.synchronize(); on CPU a plain clock does.
    ref._cuda_time = time.perf_counter
    counted = []
    for ids in prompt_ids:
        # A budget one block longer, so that no block vLLM verifies is cut short here.
        stats = ref.dflash_generate(
            drafter, target, torch.tensor([ids]), MAX_NEW_TOKENS + pair.block_size, None,
            block_size=pair.block_size, return_stats=True,
        )
        num_output = 1  # the token sampled at prefill
        for produced in stats.acceptance_lengths:
            if num_output >= MAX_NEW_TOKENS:
                break
            counted.append(produced)
            num_output += produced
    return sum(counted) / len(counted)


def test_plugin_output_equals_no_speculation(plugin_run):
    want, got, _ = plugin_run
    assert got == want


def test_acceptance_is_real_and_equals_reference(pair, prompt_ids, plugin_run):
    _, _, plugin_acceptance = plugin_run
    assert plugin_acceptance >= MIN_ACCEPTANCE
    assert abs(plugin_acceptance - reference_acceptance(pair, prompt_ids)) <= 0.05
