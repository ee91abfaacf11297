"""Async scheduling, vLLM's default on GPUs for method "dflash": the scheduler plans step n+1
before step n's tokens and drafts reach the host, and the model runner keeps them on the device.

The CPU build turns async scheduling off in its platform set-up; these tests lift that one
override, so that the CPU runner runs the V1 runner's async code (inherited from the GPU
runner, with its streams and events as no-ops) with vllm-dflash's proposer: greedy output
equals no speculation with a fixed K and with adaptive lengths (a good drafter and a useless
one that the policy switches off), with structured outputs, preemption and chunked prefill,
and seeded sampling is reproducible. With a fixed K, acceptance equals the same engine's
without async scheduling (within 0.05 tokens per block, as tests/test_vllm_e2e.py argues):
the drafter must see the same context when its inputs stay on the device."""

import itertools
import os

import pytest

from tests.engines import (
    TRAINED,
    Pair,
    alone_batched_structured,
    dflash_llm,
    generate_ids,
    keep_cpu_async_scheduling,
    plain_run,
    seeded_and_greedy_twice,
    spec_metrics,
)

MAX_NEW_TOKENS = 48
LONG_NEW_TOKENS = 120
K = 7


@pytest.fixture(scope="module", autouse=True)
def cpu_async_scheduling():
    undo = keep_cpu_async_scheduling()
    yield
    undo()


@pytest.fixture
def draft_length(request):
    """Sets VLLM_DFLASH_DRAFT_LENGTH for the engines a test builds."""
    old = os.environ["VLLM_DFLASH_DRAFT_LENGTH"]
    os.environ["VLLM_DFLASH_DRAFT_LENGTH"] = request.param
    yield request.param
    os.environ["VLLM_DFLASH_DRAFT_LENGTH"] = old


def async_llm(pair: Pair, **kwargs):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    llm = dflash_llm(pair, K, max_num_seqs=16, async_scheduling=True, **kwargs)
    core = llm.llm_engine.engine_core.engine_core
    # vLLM's async path: its async scheduler, and a queue of two batches in flight.
    assert isinstance(core.scheduler, AsyncScheduler)
    assert core.batch_queue is not None and core.batch_queue.maxlen == 2
    return llm


def outputs(llm, prompts: list[dict]) -> dict[str, list[list[int]]]:
    return alone_batched_structured(llm, prompts, MAX_NEW_TOKENS, alone=4)


def long_outputs(llm, prompts: list[dict]) -> list[list[int]]:
    """Every request grows past one 128-token KV block."""
    return generate_ids(llm, prompts, max_tokens=LONG_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def sync_acceptance(prompts) -> float:
    """Acceptance of the same workload, K fixed, on an engine without async scheduling."""
    llm = dflash_llm(TRAINED, K, max_num_seqs=16)
    try:
        outputs(llm, prompts)
        m = spec_metrics(llm)
    finally:
        del llm
    return 1 + m["accepted"] / m["drafts"]


@pytest.fixture(scope="module")
def baseline(prompts):
    return plain_run(TRAINED.target, max_num_seqs=16,
                     run=lambda llm: outputs(llm, prompts) | {"long": long_outputs(llm, prompts)})


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"], indirect=True)
def test_greedy_equals_no_speculation(draft_length, baseline, sync_acceptance, prompts):
    llm = async_llm(TRAINED)
    try:
        got = outputs(llm, prompts)
        m = spec_metrics(llm)
    finally:
        del llm
    assert got == {k: baseline[k] for k in got}
    acceptance = 1 + m["accepted"] / m["drafts"]
    assert m["drafts"] > 0 and acceptance >= 2.5, m
    if draft_length == "fixed":
        assert m["draft_tokens"] == K * m["drafts"]
        assert abs(acceptance - sync_acceptance) <= 0.05, (acceptance, sync_acceptance)
    per_pos = m["accepted_per_pos"]
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos


@pytest.mark.parametrize("draft_length", ["adaptive"], indirect=True)
def test_useless_drafter_is_switched_off_losslessly(draft_length, baseline, prompts,
                                                   useless_pair):
    llm = async_llm(useless_pair)
    try:
        got = outputs(llm, prompts)
        m = spec_metrics(llm)
    finally:
        del llm
    assert got == {k: baseline[k] for k in got}
    output_tokens = (4 + 2 * len(prompts)) * MAX_NEW_TOKENS
    assert m["draft_tokens"] < 0.3 * K * output_tokens, m


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"], indirect=True)
def test_preemption_and_chunked_prefill(draft_length, baseline, prompts):
    # 8 KV blocks of 128 tokens for 16 requests that each need 2: the scheduler preempts and
    # recomputes; a 64-token budget chunks the prompts.
    llm = async_llm(TRAINED, num_gpu_blocks_override=8, max_num_batched_tokens=64)
    try:
        assert long_outputs(llm, prompts) == baseline["long"]
        preemptions = {m.name: m for m in llm.get_metrics()}["vllm:num_preemptions"].value
        assert preemptions > 0
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.kv_cache_manager.usage == 0.0
    finally:
        del llm


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"], indirect=True)
def test_seeded_sampling_is_reproducible(draft_length, prompts):
    llm = async_llm(TRAINED)
    try:
        first, second = seeded_and_greedy_twice(llm, prompts, max_tokens=32)
        assert first == second
    finally:
        del llm
