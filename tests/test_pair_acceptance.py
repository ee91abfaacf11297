"""The committed trained pair (tests/fixtures/pair): real acceptance through vLLM on held-out
prompts the drafter never saw, equal to the reference package's, with lossless output; for its
DFlash drafter and for the DFlash2 drafter trained on the same data."""

import time

import pytest
import torch

from tests.engines import (
    TRAINED,
    TRAINED_DFLASH2,
    Pair,
    dflash_llm,
    generate_ids,
    heldout_ids,
    plain_llm,
    spec_metrics,
)
from vllm_dflash.config import DFlashConfig

MAX_NEW_TOKENS = 64
MIN_ACCEPTANCE = 2.5


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return heldout_ids()


@pytest.fixture(scope="module")
def prompts(prompt_ids) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in prompt_ids]


@pytest.fixture(scope="module")
def baseline(prompts) -> list[list[int]]:
    llm = plain_llm(TRAINED.target)
    want = generate_ids(llm, prompts, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    del llm
    return want


@pytest.fixture(scope="module")
def plugin_runs(prompts, baseline) -> dict[str, tuple[list[list[int]], float]]:
    """Greedy output and mean acceptance length of each drafter through LLM()."""
    runs = {}
    for name, pair in (("dflash", TRAINED), ("dflash2", TRAINED_DFLASH2)):
        llm = dflash_llm(pair, pair.block_size - 1)  # built last: its metrics are the live ones
        got = generate_ids(llm, prompts, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        metrics = spec_metrics(llm)
        del llm
        runs[name] = got, 1 + metrics["accepted"] / metrics["drafts"]
    return runs


def reference_acceptance(pair: Pair, prompt_ids: list[list[int]]) -> float:
    """Mean acceptance length of dflash==0.1.0's own generate loop, on the same prompts, counted
    as vLLM counts it: every verified block whole (vLLM truncates to max_tokens after counting),
    one block per step that starts before max_tokens output tokens."""
    import dflash.model as ref
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    drafter_class = getattr(ref, DFlashConfig.from_pretrained(pair.drafter).architecture)
    drafter = drafter_class.from_pretrained(pair.drafter, dtype=torch.float32).eval()
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


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_plugin_output_equals_no_speculation(name, plugin_runs, baseline):
    assert plugin_runs[name][0] == baseline


@pytest.mark.parametrize("name, pair", [("dflash", TRAINED), ("dflash2", TRAINED_DFLASH2)])
def test_acceptance_is_real_and_equals_reference(name, pair, prompt_ids, plugin_runs):
    plugin_acceptance = plugin_runs[name][1]
    assert plugin_acceptance >= MIN_ACCEPTANCE
    assert abs(plugin_acceptance - reference_acceptance(pair, prompt_ids)) <= 0.05


def test_dflash2_drafter_is_accepted_more(plugin_runs):
    """Trained on the same data for as long, the DFlash2 drafter's candidate selector lifts
    acceptance (7.46 against 6.65 in the training loop's own measure, pair.json)."""
    assert plugin_runs["dflash2"][1] >= plugin_runs["dflash"][1] + 0.3
