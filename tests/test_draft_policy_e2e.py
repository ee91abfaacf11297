"""The adaptive draft length inside real vLLM engines (CPU build, in-process, eager): greedy
output identical to no speculation at concurrency 1 and 16; a good drafter keeps drafting and a
useless one is all but switched off; steps with drafting off keep the drafter's context whole."""

import logging
import os
import types

import pytest

from tests.engines import (
    TRAINED,
    LogLines,
    Pair,
    alone_batched_structured,
    count_calls,
    dflash_llm,
    generate_ids,
    plain_run,
    seeded_and_greedy_twice,
    spec_metrics,
)

MAX_NEW_TOKENS = 48
LONG_NEW_TOKENS = 120
K = 7


@pytest.fixture(scope="module")
def adaptive():
    """Engines built inside this fixture's scope use the adaptive policy (tests/engines.py
    makes every other test module's engines draft a fixed K)."""
    import vllm.logger  # noqa: F401  (its logging set-up resets handlers of child loggers)

    old = os.environ.get("VLLM_DFLASH_DRAFT_LENGTH")
    os.environ["VLLM_DFLASH_DRAFT_LENGTH"] = "adaptive"
    handler = LogLines()
    logging.getLogger("vllm.vllm_dflash").addHandler(handler)
    yield handler.lines
    logging.getLogger("vllm.vllm_dflash").removeHandler(handler)
    if old is None:
        del os.environ["VLLM_DFLASH_DRAFT_LENGTH"]
    else:
        os.environ["VLLM_DFLASH_DRAFT_LENGTH"] = old


def outputs(llm, prompts: list[dict]) -> dict[str, list[list[int]]]:
    return alone_batched_structured(llm, prompts, MAX_NEW_TOKENS)


def long_outputs(llm, prompts: list[dict]) -> list[list[int]]:
    """Every request grows past one 128-token KV block."""
    return generate_ids(llm, prompts, max_tokens=LONG_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(prompts):
    return plain_run(TRAINED.target, max_num_seqs=16,
                     run=lambda llm: outputs(llm, prompts) | {"long": long_outputs(llm, prompts)})


@pytest.fixture(scope="module")
def trained_run(adaptive, baseline, prompts):
    llm = dflash_llm(TRAINED, K, max_num_seqs=16)
    result = outputs(llm, prompts)
    metrics = spec_metrics(llm)  # read before the next engine re-registers vLLM's metrics
    del llm
    return result, metrics


@pytest.fixture(scope="module")
def useless_run(adaptive, baseline, prompts, useless_pair):
    llm = dflash_llm(useless_pair, K, max_num_seqs=16)
    llm.collective_rpc(_count_sampler_paths)
    result = outputs(llm, prompts)
    metrics = spec_metrics(llm) | llm.collective_rpc(_sampler_path_counts)[0]
    del llm
    return result, metrics


def _count_sampler_paths(worker) -> None:
    """Counts the runner's steps by sampler: vLLM's plain sampler or its rejection sampler."""
    runner = worker.model_runner
    sample = runner._sample
    runner.sampler_path_counts = counts = {"plain_steps": 0, "speculative_steps": 0}

    def counting_sample(logits, spec_decode_metadata):
        counts["plain_steps" if spec_decode_metadata is None else "speculative_steps"] += 1
        return sample(logits, spec_decode_metadata)

    runner._sample = counting_sample


def _sampler_path_counts(worker) -> dict[str, int]:
    return worker.model_runner.sampler_path_counts


def test_adaptive_greedy_equals_no_speculation_at_concurrency_1_and_16(baseline, trained_run):
    got, _ = trained_run
    assert got["alone"] == baseline["alone"]
    assert got["batch"] == baseline["batch"]
    assert got["structured"] == baseline["structured"]


def assert_seeded_sampling_reproducible(pair: Pair, max_num_seqs: int, prompts) -> None:
    llm = dflash_llm(pair, K, max_num_seqs=max_num_seqs)
    try:
        first, second = seeded_and_greedy_twice(llm, prompts, max_tokens=32)
        assert first == second
        from vllm_dflash.vllm.scheduler import _controllers

        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert _controllers[scheduler].seeded == set()
    finally:
        del llm


def test_seeded_sampling_is_reproducible_with_adaptive_lengths(trained_run, prompts):
    # Seeded and greedy requests in one batch: greedy ones keep adaptive lengths.
    assert_seeded_sampling_reproducible(TRAINED, 16, prompts)


def test_seeded_requests_waiting_behind_a_switched_off_policy_are_reproducible(
        adaptive, prompts, useless_pair):
    # 4 at a time: seeded requests are prefilled while the policy has drafting off for the
    # others, and must still draft K from their first step.
    assert_seeded_sampling_reproducible(useless_pair, 4, prompts)


def test_adaptive_policy_is_on_and_logged(adaptive, trained_run):
    assert any(line.startswith("vllm-dflash: adaptive draft length, 0..7") for line in adaptive)


def test_good_drafter_keeps_drafting(trained_run):
    _, m = trained_run
    assert m["drafts"] > 0
    assert m["draft_tokens"] <= K * m["drafts"]
    assert 1 + m["accepted"] / m["drafts"] >= 2.5


def test_useless_drafter_is_switched_off_losslessly(baseline, useless_run):
    got, m = useless_run
    assert got["alone"] == baseline["alone"]
    assert got["batch"] == baseline["batch"]
    assert got["structured"] == baseline["structured"]
    # A fixed K verifies K draft tokens per step, K per output token when nothing is accepted.
    # The policy stops once its measured acceptance makes drafts not worth their cost (on a
    # CPU at concurrency 1 drafts are nearly free, so that takes some 100 drafts), then only
    # explores: a small fraction of fixed K's draft tokens.
    output_tokens = 2 * 16 * MAX_NEW_TOKENS  # alone and batch; not counting structured: stricter
    assert m["draft_tokens"] < 0.2 * K * output_tokens, m
    # Steps without drafts run as plain steps: vLLM's sampler, no spec-decode metadata.
    assert m["plain_steps"] > 2 * m["speculative_steps"] > 0, m


def test_preemption_and_chunked_prefill_with_adaptive_lengths(adaptive, baseline, prompts):
    # 8 KV blocks of 128 tokens for 16 requests that each need 2: the scheduler preempts and
    # recomputes while draft lengths vary per request; a 64-token budget chunks the prompts.
    llm = dflash_llm(TRAINED, K, max_num_seqs=16, num_gpu_blocks_override=8,
                     max_num_batched_tokens=64)
    try:
        assert long_outputs(llm, prompts) == baseline["long"]
        preemptions = {m.name: m for m in llm.get_metrics()}["vllm:num_preemptions"].value
        assert preemptions > 0
        # Every block comes back: reserved draft slots neither leak nor outlive a request.
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.kv_cache_manager.usage == 0.0
    finally:
        del llm


class DraftEveryFourthStep:
    """A scripted policy: two steps with drafting off (each runs the runner's inject-only
    path), a third whose end drafts K, a fourth that verifies those drafts."""

    def __init__(self) -> None:
        self.steps = 0
        self.prompt_lookup = False

    def plan(self, req_ids: list[str], remaining: list[int] | None = None,
             lookup: list[bool] | None = None):
        from vllm_dflash.draft_policy import Plan

        self.steps += 1
        phase = self.steps % 4
        return Plan([K if phase == 0 else 0] * len(req_ids), K if phase == 3 else 0)

    def observe(self, *args, **kwargs) -> None:
        pass

    def summary(self, flush: bool = False) -> None:
        return None

    def idle(self) -> None:
        pass

    def request_added(self, req_id: str, sampled: bool) -> None:
        pass

    def request_freed(self, req_id: str) -> None:
        pass


def _script_policy(llm) -> None:
    from vllm_dflash.vllm import scheduler as scheduler_module

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    scheduler_module._controllers[scheduler].policy = DraftEveryFourthStep()


def _count_inject_only_steps(worker) -> None:
    runner = worker.model_runner
    count_calls(runner.drafter, "queue_context", runner, "inject_only_steps")
    count_calls(runner.drafter.draft_runner.context_queue, "inject", runner, "queue_injections")


def _queue_counts(worker) -> tuple[int, int]:
    return worker.model_runner.inject_only_steps, worker.model_runner.queue_injections


def _vllm_propose_path_injecting_every_step(worker) -> None:
    """Every step through vLLM's own propose path (prepare_next_token_ids_padded, then
    propose with no drafts) and every step's context injected at once: as before the
    inject-only path and the context queue."""
    runner = worker.model_runner
    vllm_propose = type(runner).propose_draft_token_ids.__wrapped__
    runner.propose_draft_token_ids = types.MethodType(vllm_propose, runner)
    runner.drafter.draft_runner.context_queue = None


def scripted_run(prompts: list[dict], inject_only: bool):
    llm = dflash_llm(TRAINED, K, max_num_seqs=16)
    try:
        _script_policy(llm)
        llm.collective_rpc(_count_inject_only_steps if inject_only
                           else _vllm_propose_path_injecting_every_step)
        result = generate_ids(llm, prompts, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        metrics = spec_metrics(llm)
        if inject_only:
            metrics["inject_only_steps"], metrics["queue_injections"] = llm.collective_rpc(
                _queue_counts)[0]
        return result, metrics
    finally:
        del llm


def test_steps_with_drafting_off_keep_the_drafters_context_whole(adaptive, baseline, prompts):
    # Half the steps skip vLLM's propose path and only queue the target's features, injected
    # before the next draft. Drafts made after them are accepted exactly as when every step
    # runs vLLM's path and injects at once: the context the drafter reads is the same; had
    # those steps' tokens been left out, the trained drafter's acceptance would fall.
    got, m = scripted_run(prompts, inject_only=True)
    reference, m_ref = scripted_run(prompts, inject_only=False)
    assert got == reference == baseline["batch"]
    assert m["inject_only_steps"] >= 8, m  # 14 on 2026-12-07: half the steps of the run
    # Two queued steps, then one injection before the draft that reads them.
    assert 0 < m["queue_injections"] <= m["inject_only_steps"] / 2, m
    assert (m["drafts"], m["accepted"], m["accepted_per_pos"]) == (
        m_ref["drafts"], m_ref["accepted"], m_ref["accepted_per_pos"])
    assert 1 + m["accepted"] / m["drafts"] >= 4.0, m


def _attention_in_profiled_steps(worker, num_tokens: int, context_len: int) -> list:
    """The seq_lens that the target's first attention layer sees in the start-up profile's
    step of num_tokens query tokens (None: the step skipped attention)."""
    from vllm.forward_context import get_forward_context

    from vllm_dflash.vllm.drafting import target_step

    runner = worker.model_runner
    attention = runner.model.model.layers[0].self_attn.attn
    seen = []

    def record(module, args) -> None:
        metadata = get_forward_context().attn_metadata
        seen.append(None if metadata is None else
                    metadata[module.layer_name].seq_lens[:num_tokens].tolist())

    handle = attention.register_forward_pre_hook(record)
    try:
        target_step(runner, num_tokens, context_len)
    finally:
        handle.remove()
    return seen


def test_the_start_up_profile_attends_over_a_context(adaptive):
    # The policy's cost of a verified draft token includes the attention over each request's
    # context: the profiled steps run attention over context_len tokens before their queries.
    llm = dflash_llm(TRAINED, K, max_num_seqs=16)
    try:
        decode = llm.collective_rpc(_attention_in_profiled_steps, args=(16, 100))[0]
        verify = llm.collective_rpc(_attention_in_profiled_steps, args=(64, 100))[0]
    finally:
        del llm
    assert decode == [[101] * 16]  # 16 requests, one query token each
    assert verify == [[104] * 16]  # 16 requests verifying 3 drafts each
