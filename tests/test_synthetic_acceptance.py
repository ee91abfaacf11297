"""vLLM's benchmark mode, rejection_sample_method="synthetic", through vllm-dflash's
verification: drafts are accepted at set per-position rates whatever they are, so that speed can
be measured at a chosen acceptance with a drafter of random weights."""

import pytest

from tests.engines import dflash_llm, prompts_of_lengths, spec_metrics

K = 7


@pytest.fixture(scope="module")
def synthetic_run(random_pair):
    from vllm import SamplingParams

    # vLLM turns length 4.0 into unconditional rates [1, 1, 1, 0, 0, 0, 0]: 3 drafts accepted
    # at every verification, which a random drafter never reaches on its own.
    llm = dflash_llm(random_pair, K, {"rejection_sample_method": "synthetic",
                                      "synthetic_acceptance_length": 4.0})
    prompts = prompts_of_lengths(random_pair.target, (1, 5, 37, 100, 200, 17))
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=i)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    metrics = spec_metrics(llm)
    del llm
    return outputs, metrics


def test_synthetic_acceptance_length_is_met(synthetic_run):
    outputs, m = synthetic_run
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)
    assert m["drafts"] > 0 and m["draft_tokens"] == K * m["drafts"]
    assert m["accepted_per_pos"] == [m["drafts"]] * 3 + [0] * (K - 3)
    assert m["accepted"] == 3 * m["drafts"]
