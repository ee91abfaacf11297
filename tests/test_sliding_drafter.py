"""A drafter with sliding-window attention through LLM(). vLLM 0.32 refuses such drafters on the
V1 runner (they would need a KV cache group per layer kind); vllm-dflash keeps all draft layers
in one group and masks the sliding layers by their window.

The drafter is the committed trained tiny drafter with its one layer made a sliding-window layer
(non-causal, as it was trained): it is still accepted, and what it proposes depends on which
context tokens the window lets it see, so acceptance through LLM() must equal the reference
package's own loop on the same config."""

import json
import shutil
from functools import partial

import pytest

from tests.engines import (
    TRAINED,
    Pair,
    acceptance_of,
    dflash_llm,
    generate_ids,
    greedy_baseline,
    heldout_ids,
    reference_acceptance,
)

# Shorter than every held-out prompt: the window decides what the layer sees.
WINDOW = 6
MAX_NEW_TOKENS = 48
MIN_ACCEPTANCE = 1.5


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    drafter = tmp_path_factory.mktemp("sliding") / "drafter"
    shutil.copytree(TRAINED.drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    config.update(layer_types=["sliding_attention"], use_sliding_window=True,
                  sliding_window=WINDOW, is_causal=False)
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    return Pair(target=TRAINED.target, drafter=drafter, block_size=TRAINED.block_size)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    ids = heldout_ids()[:8]
    assert min(map(len, ids)) > WINDOW
    return ids


def test_output_equals_no_speculation_and_acceptance_equals_reference(pair, prompt_ids,
                                                                      monkeypatch) -> None:
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    baseline = greedy_baseline(pair.target, prompts, MAX_NEW_TOKENS, max_num_seqs=4)
    monkeypatch.setenv("VLLM_DFLASH_DRAFT_LENGTH", "fixed")
    llm = dflash_llm(pair, num_speculative_tokens=pair.block_size - 1, max_num_seqs=4)
    got, acceptance = acceptance_of(
        llm, partial(generate_ids, llm, prompts, max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    assert got == baseline
    assert acceptance >= MIN_ACCEPTANCE
    reference = reference_acceptance(pair, prompt_ids, MAX_NEW_TOKENS)
    assert abs(acceptance - reference) <= 0.05, (acceptance, reference)
