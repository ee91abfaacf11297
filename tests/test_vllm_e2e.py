"""vllm-dflash inside real vLLM engines (CPU build, in-process, eager): lossless greedy output,
the start-up log line, sampling, metrics and start-up validation.

Engines are expensive (~5 s each after `import vllm`), so each configuration is built once per
module and shared by the tests that use it.
"""

import itertools
import logging

import pytest

from tests.engines import (
    LogLines,
    dflash_llm,
    generate_ids,
    plain_llm,
    prompts_of_lengths,
    spec_metrics,
)

PROMPT_LENGTHS = (1, 5, 17, 40, 77, 150, 260, 400)


@pytest.fixture(scope="module")
def prompts(random_pair):
    return prompts_of_lengths(random_pair.target, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def startup_log():
    import vllm.logger  # noqa: F401  (its logging set-up resets handlers of child loggers)

    handler = LogLines()
    logging.getLogger("vllm.vllm_dflash").addHandler(handler)
    yield handler.lines
    logging.getLogger("vllm.vllm_dflash").removeHandler(handler)


@pytest.fixture(scope="module")
def baseline(random_pair):
    llm = plain_llm(random_pair.target)
    yield llm
    del llm


@pytest.fixture(scope="module")
def full_block(random_pair, baseline, startup_log):
    # Built after `baseline`: each in-process engine re-registers vLLM's Prometheus metrics, so
    # the engine built last is the one get_metrics() reads.
    llm = dflash_llm(random_pair, random_pair.block_size - 1)
    yield llm
    del llm


def test_startup_log_names_vllm_dflash(full_block, startup_log):
    lines = [line for line in startup_log if line.startswith("vllm-dflash:")]
    assert lines, startup_log
    assert "implementation=vllm-dflash" in lines[0]
    assert "runner=CPUModelRunner (V1), drafter=DFlashDraftModel" in lines[0]
    assert "draft attention=c++" in lines[0]  # the compiled CPU kernel, not the torch fallback


@pytest.mark.parametrize("max_tokens", [1, 13, 40])
def test_greedy_alone_equals_no_speculation(baseline, full_block, prompts, max_tokens):
    for prompt in prompts:
        want = generate_ids(baseline, [prompt], max_tokens=max_tokens)
        assert generate_ids(full_block, [prompt], max_tokens=max_tokens) == want


def test_greedy_batch_equals_no_speculation(baseline, full_block, prompts):
    want = generate_ids(baseline, prompts, max_tokens=37)
    assert generate_ids(full_block, prompts, max_tokens=37) == want


def test_stop_token_ids_and_strings(baseline, full_block, prompts):
    plain = generate_ids(baseline, prompts, max_tokens=30)
    # Stop on a token each output really produces, mid-way, so the stop falls inside a block.
    stop_ids = sorted({out[len(out) // 2] for out in plain if len(out) > 2})
    kwargs = {"max_tokens": 30, "stop_token_ids": stop_ids}
    assert generate_ids(full_block, prompts, **kwargs) == generate_ids(baseline, prompts, **kwargs)
    want = baseline.generate(prompts, _params(max_tokens=30, temperature=0.0, stop=["e", "\n"]))
    got = full_block.generate(prompts, _params(max_tokens=30, temperature=0.0, stop=["e", "\n"]))
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_shared_prefix_with_prefix_caching(baseline, full_block, prompts):
    prefix = prompts[-1]["prompt_token_ids"][:200]
    shared = [{"prompt_token_ids": prefix + p["prompt_token_ids"][:20]} for p in prompts]
    want = generate_ids(baseline, shared, max_tokens=24)
    # Twice: the second pass hits the prefix cache for the target and the drafter pages alike.
    assert generate_ids(full_block, shared, max_tokens=24) == want
    assert generate_ids(full_block, shared, max_tokens=24) == want


def test_metrics_are_vllm_spec_decode_counters(full_block, prompts):
    generate_ids(full_block, prompts, max_tokens=20)
    m = spec_metrics(full_block)
    k = full_block.llm_engine.vllm_config.speculative_config.num_speculative_tokens
    assert m["drafts"] > 0
    assert m["draft_tokens"] == k * m["drafts"]
    per_pos = m["accepted_per_pos"]
    assert len(per_pos) == k
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


@pytest.mark.parametrize("k", [1, 3])
def test_smaller_k_equals_no_speculation(random_pair, baseline, prompts, k):
    llm = dflash_llm(random_pair, k)
    try:
        want = generate_ids(baseline, prompts, max_tokens=21)
        assert generate_ids(llm, prompts, max_tokens=21) == want
        assert spec_metrics(llm)["draft_tokens"] == k * spec_metrics(llm)["drafts"]
    finally:
        del llm


def test_preemption_and_chunked_prefill_keep_greedy_output(random_pair, baseline, prompts):
    # Few KV blocks for 8 long requests: the scheduler must preempt and recompute; a 64-token
    # step budget splits every long prompt into chunks, mixed with other requests' drafts.
    llm = dflash_llm(random_pair, random_pair.block_size - 1, num_gpu_blocks_override=10,
                     max_num_batched_tokens=64)
    try:
        want = generate_ids(baseline, prompts, max_tokens=48)
        assert generate_ids(llm, prompts, max_tokens=48) == want
    finally:
        del llm


def _params(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(**kwargs)
