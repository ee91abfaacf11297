"""vllm-dflash inside real vLLM engines (CPU build, in-process, eager), on the committed
trained pair: lossless greedy output, acceptance equal to a reference wherever a feature could
change what the drafter sees (smaller K, stops inside a block, prefix-cache hits, preemption
and chunked prefill), the start-up log line, sampling and metrics.

Greedy output equals no speculation for any drafter; acceptance is what shows the drafter got
the right context. The reference is this package's pure-torch loop with blocks of K + 1
(tests/engines.own_loop_acceptance), or the same workload without the feature. The tolerance,
0.05 tokens per block, is test_pair_acceptance's: fp32 kernels and batch shapes move logits by
~1e-6, which flips a near-tied draft now and then; a drafter-side bug moves acceptance by far
more (scripts/mutation_check.py).

Engines are expensive (~5 s each after `import vllm`), so each configuration is built once per
module and shared by the tests that use it. The engine built last is the one whose metrics
vLLM's get_metrics() reads, and freeing an in-process engine tears down state the shared ones
use: tests that build their own engine come last and use the shared ones before they do.
"""

import itertools
import logging
from functools import partial

import pytest

from tests.engines import (
    TRAINED,
    LogLines,
    acceptance_of,
    dflash_llm,
    engine_counter,
    generate_ids,
    heldout_ids,
    heldout_prompts,
    own_loop_acceptance,
    plain_llm,
    spec_metrics,
)

MAX_NEW_TOKENS = 40
LONG_NEW_TOKENS = 120  # every request grows past one 128-token page
TOLERANCE = 0.05
K = TRAINED.block_size - 1
# KV pages of 32 tokens, not the CPU default 128: with 128-token pages vLLM 0.32 finds no
# prefix-cache hit for a speculative engine with a drafter KV cache (its own DFlash alike)
# on prompts of a few hundred tokens.
PAGE = 32


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    """The trained pair's held-out prompts (42-63 tokens), a 1-token one, and two long ones
    (several held-out prompts joined, 150-400 tokens) that a 64-token budget splits."""
    ids = heldout_ids()
    joined = itertools.chain.from_iterable
    return [ids[0][:1], *ids[:9], list(joined(ids[9:12])), list(joined(ids[12:]))]


@pytest.fixture(scope="module")
def prompts(prompt_ids) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in prompt_ids]


@pytest.fixture(scope="module")
def startup_log():
    import vllm.logger  # noqa: F401  (its logging set-up resets handlers of child loggers)

    handler = LogLines()
    logging.getLogger("vllm.vllm_dflash").addHandler(handler)
    yield handler.lines
    logging.getLogger("vllm.vllm_dflash").removeHandler(handler)


@pytest.fixture(scope="module")
def baseline():
    llm = plain_llm(TRAINED.target)
    yield llm
    del llm


@pytest.fixture(scope="module")
def full_block(baseline, startup_log):
    # Built after `baseline`: each in-process engine re-registers vLLM's Prometheus metrics, so
    # the engine built last is the one get_metrics() reads.
    llm = dflash_llm(TRAINED, K, block_size=PAGE)
    yield llm
    del llm


@pytest.fixture(scope="module")
def full_block_run(full_block, prompts) -> tuple[list[list[int]], float]:
    """Greedy output and acceptance of all prompts at once, K = block_size - 1."""
    return acceptance_of(full_block, lambda: generate_ids(full_block, prompts,
                                                          max_tokens=MAX_NEW_TOKENS))


def test_startup_log_names_vllm_dflash(full_block, startup_log):
    lines = [line for line in startup_log if line.startswith("vllm-dflash:")]
    assert lines, startup_log
    assert "implementation=vllm-dflash" in lines[0]
    assert "runner=CPUModelRunner (V1), drafter=DFlashDraftModel" in lines[0]
    assert "draft attention=c++" in lines[0]  # the compiled CPU kernel, not the torch fallback


@pytest.mark.parametrize("max_tokens", [1, 13, 40])
def test_greedy_alone_equals_no_speculation(baseline, full_block, prompts, max_tokens):
    for prompt in prompts[:4] + prompts[-1:]:
        want = generate_ids(baseline, [prompt], max_tokens=max_tokens)
        assert generate_ids(full_block, [prompt], max_tokens=max_tokens) == want


def test_greedy_batch_equals_no_speculation_and_acceptance_equals_reference(
        baseline, full_block_run, prompts, prompt_ids):
    got, acceptance = full_block_run
    assert got == generate_ids(baseline, prompts, max_tokens=MAX_NEW_TOKENS)
    reference = own_loop_acceptance(TRAINED, prompt_ids, MAX_NEW_TOKENS, K)
    assert reference >= 3.0  # the trained pair: the drafter really is accepted
    assert abs(acceptance - reference) <= TOLERANCE, (acceptance, reference)


def test_stop_token_ids_and_strings(baseline, full_block, prompts, prompt_ids):
    plain = generate_ids(baseline, prompts, max_tokens=30)
    # Stop on a token each output really produces, mid-way, so the stop falls inside a block.
    stop_ids = sorted({out[len(out) // 2] for out in plain if len(out) > 2})
    kwargs = {"max_tokens": 30, "stop_token_ids": stop_ids}
    want = generate_ids(baseline, prompts, **kwargs)
    got, acceptance = acceptance_of(full_block,
                                    lambda: generate_ids(full_block, prompts, **kwargs))
    assert got == want
    # The steps up to each stop are the unstopped run's, so the loop run to each output's
    # length is the reference.
    reference = own_loop_acceptance(TRAINED, prompt_ids, [len(out) for out in want], K)
    assert abs(acceptance - reference) <= TOLERANCE, (acceptance, reference)
    want = baseline.generate(prompts, _params(max_tokens=30, temperature=0.0, stop=["e", "\n"]))
    got = full_block.generate(prompts, _params(max_tokens=30, temperature=0.0, stop=["e", "\n"]))
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_shared_prefix_with_prefix_caching(baseline, full_block, prompt_ids):
    prefix = prompt_ids[-1][:150]
    shared = [{"prompt_token_ids": prefix + ids[:20]} for ids in prompt_ids[1:9]]
    want = generate_ids(baseline, shared, max_tokens=24)

    def run() -> list[list[int]]:
        return generate_ids(full_block, shared, max_tokens=24)

    full_block.reset_prefix_cache()
    hits = engine_counter(full_block, "vllm:prefix_cache_hits")
    first, first_acceptance = acceptance_of(full_block, run)
    # Again: the second pass hits the prefix cache for the target and the drafter pages alike,
    # and the drafter must see the same context from the cached pages.
    second, second_acceptance = acceptance_of(full_block, run)
    assert first == second == want
    # The second pass hits at least the prefix's 4 full pages for each of its 8 requests.
    assert engine_counter(full_block, "vllm:prefix_cache_hits") - hits >= 8 * 4 * PAGE
    assert second_acceptance >= 2.0
    assert abs(second_acceptance - first_acceptance) <= TOLERANCE


def test_metrics_are_vllm_spec_decode_counters(full_block, full_block_run):
    m = spec_metrics(full_block)
    assert m["drafts"] > 0
    assert m["draft_tokens"] == K * m["drafts"]  # fixed K in this module
    per_pos = m["accepted_per_pos"]
    assert len(per_pos) == K
    assert per_pos[-1] > 0  # the trained drafter reaches the last position
    assert all(a >= b for a, b in itertools.pairwise(per_pos))
    assert m["accepted"] == sum(per_pos)


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_p": 0.9}, {"top_k": 5, "top_p": 0.8}])
def test_seeded_sampling_is_reproducible(full_block, prompts, filters):
    params = _params(max_tokens=16, temperature=1.0, seed=7, **filters)
    first = [o.outputs[0].token_ids for o in full_block.generate(prompts, params)]
    second = [o.outputs[0].token_ids for o in full_block.generate(prompts, params)]
    assert first == second
    other = _params(max_tokens=16, temperature=1.0, seed=8, **filters)
    assert [o.outputs[0].token_ids for o in full_block.generate(prompts, other)] != first


def test_top_k_1_sampling_equals_greedy(full_block, prompts):
    greedy = generate_ids(full_block, prompts, max_tokens=16)
    top1 = full_block.generate(prompts, _params(max_tokens=16, temperature=1.0, seed=3, top_k=1))
    assert [list(o.outputs[0].token_ids) for o in top1] == greedy


def test_preemption_and_chunked_prefill_keep_output_and_acceptance(baseline, full_block):
    # 8 KV pages of 128 tokens for 16 requests that each grow past one: the scheduler preempts
    # and recomputes; a 64-token step budget chunks the prompts, mixed with other requests'
    # drafts. The drafter's context pages are rewritten on recompute: acceptance stays that of
    # the same requests run with room to spare.
    prompts = heldout_prompts()
    plain = generate_ids(baseline, prompts, max_tokens=LONG_NEW_TOKENS)
    want, want_acceptance = acceptance_of(
        full_block, partial(generate_ids, full_block, prompts, max_tokens=LONG_NEW_TOKENS))
    llm = dflash_llm(TRAINED, K, num_gpu_blocks_override=8, max_num_batched_tokens=64)
    try:
        got, acceptance = acceptance_of(
            llm, partial(generate_ids, llm, prompts, max_tokens=LONG_NEW_TOKENS))
        assert engine_counter(llm, "vllm:num_preemptions") > 0
    finally:
        del llm
    assert got == want == plain
    assert abs(acceptance - want_acceptance) <= TOLERANCE, (acceptance, want_acceptance)


@pytest.mark.parametrize("k", [1, 3])
def test_smaller_k_equals_no_speculation_and_acceptance_equals_reference(
        baseline, full_block_run, prompts, prompt_ids, k):
    want = full_block_run[0]
    llm = dflash_llm(TRAINED, k, block_size=PAGE)
    try:
        got, acceptance = acceptance_of(
            llm, partial(generate_ids, llm, prompts, max_tokens=MAX_NEW_TOKENS))
        assert got == want
        assert spec_metrics(llm)["draft_tokens"] == k * spec_metrics(llm)["drafts"]
    finally:
        del llm
    reference = own_loop_acceptance(TRAINED, prompt_ids, MAX_NEW_TOKENS, k)
    assert reference >= 1.5
    assert abs(acceptance - reference) <= TOLERANCE, (acceptance, reference)


def _params(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(**kwargs)
