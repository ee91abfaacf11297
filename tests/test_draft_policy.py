"""The adaptive draft-length policy on synthetic acceptance and cost curves (no vLLM)."""

import dataclasses
import itertools
import random

import numpy as np
import pytest

from vllm_dflash.draft_policy import (
    DRAFTER,
    EXPLORE_INTERVAL,
    EXPLORE_WIDTHS,
    LOOKUP,
    MAX_EXPLORE_INTERVAL,
    MAX_HOLD,
    MIN_REQUEST_PRIOR_WEIGHT,
    PROBE_INTERVAL,
    REQUEST_PRIOR_WEIGHT,
    AcceptanceModel,
    DraftPolicy,
    StepCostModel,
    StepProfile,
    draft_levels,
    request_prior_weight,
)

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
# The most draft tokens an exploring step verifies, on average over the widths in turn.
EXPLORED = 7 * sum(EXPLORE_WIDTHS) / len(EXPLORE_WIDTHS)
BATCHES = [1, 2, 4, 8, 16, 32, 64]


def profile(overhead_s: float, per_token_s: float, drafter_s: float = 0.001) -> StepProfile:
    """A target whose step costs overhead + per_token * T, and a drafter of fixed cost."""
    return StepProfile(TOKENS, [overhead_s + per_token_s * t for t in TOKENS],
                       BATCHES, [drafter_s] * len(BATCHES))


def run_steps(policy: DraftPolicy, acceptance: dict[str, float], steps: int,
              seed: int = 0) -> list[list[int]]:
    """Plan and feed back `steps` steps; each request accepts each draft position with its
    own probability. Returns the planned lengths of every step."""
    rng = random.Random(seed)
    req_ids = list(acceptance)
    history = []
    for _ in range(steps):
        plan = policy.plan(req_ids)
        drafts = []
        for req_id, length in zip(req_ids, plan.lengths):
            accepted = 0
            while accepted < length and rng.random() < acceptance[req_id]:
                accepted += 1
            if length:
                drafts.append((req_id, length, accepted))
        policy.acceptance.observe(drafts)
        history.append(plan.lengths)
    return history


def run_timed_steps(policy: DraftPolicy, acceptance: float, steps: int, step_s,
                    monkeypatch: pytest.MonkeyPatch,
                    req_ids: tuple[str, ...] = ("a", "b")) -> list[list[int]]:
    """Like run_steps, through DraftPolicy.observe on a fake clock: a step that verifies d
    drafts for n requests takes step_s(n, d, drafter_ran) seconds. Drafts planned for a step
    exist only if the drafter ran at the end of the step before."""
    from vllm_dflash import draft_policy

    clock = [0.0]
    monkeypatch.setattr(draft_policy.time, "perf_counter", lambda: clock[0])
    rng = random.Random(0)
    req_ids = list(req_ids)
    ready, history = 0, []
    for _ in range(steps):
        plan = policy.plan(req_ids)
        drafts = []
        for req_id, length in zip(req_ids, plan.lengths):
            verified = min(length, ready)
            accepted = 0
            while accepted < verified and rng.random() < acceptance:
                accepted += 1
            if verified:
                drafts.append((req_id, verified, accepted))
        draft_tokens = sum(d[1] for d in drafts)
        clock[0] += step_s(len(req_ids), draft_tokens, plan.num_draft > 0)
        policy.observe(drafts, len(req_ids) + draft_tokens, len(req_ids), plan.num_draft > 0)
        ready = plan.num_draft
        history.append(plan.lengths)
    return history


def test_a_draft_token_cost_the_profile_misses_shortens_drafts(monkeypatch):
    # The profile says drafts are nearly free. For 1500 steps they are (greedy traffic): the
    # policy drafts the full block for both requests, so d never varies. Then verifying costs
    # 0.4 ms per draft token (sampled traffic) against a 2 ms step; at acceptance 0.6 the best
    # is 1 draft a request (1050 tokens/s against 990 without drafts, 930 with 3, 620 with 7),
    # which only the probes' plain steps show clearly.
    policy = DraftPolicy(7, profile(0.002, 0.00001, drafter_s=0.0002))
    steps = iter(range(10**6))

    def step_s(n: int, d: int, drafter_ran: bool) -> float:
        per_draft_token = 0.00002 if next(steps) < 1500 else 0.0004
        return 0.002 + 0.00001 * (n + d) + 0.0002 * drafter_ran + per_draft_token * d

    history = run_timed_steps(policy, 0.6, 3000, step_s, monkeypatch)
    assert all(lengths in ([7, 7], [0, 0]) for lengths in history[1000:1500])
    assert policy.cost.per_draft_token == pytest.approx(0.0004, rel=0.1)
    assert sum(lengths == [1, 1] for lengths in history[2500:]) >= 0.8 * 500


def test_a_costly_drafter_run_at_poor_acceptance_stops_drafting(monkeypatch):
    # Measured on the CPU test pair at T = 1 with sampled drafts: a step costs 3.4 ms without
    # drafts, 4.9 ms when the drafter runs (0.6 ms of it profiled), 0.1 ms more per verified
    # draft token; a draft position is accepted 3 times in 10. No length pays.
    policy = DraftPolicy(7, profile(0.00185, 0.0, drafter_s=0.00059))

    def step_s(n: int, d: int, drafter_ran: bool) -> float:
        return 0.0034 + 0.0015 * drafter_ran + 0.0001 * d

    history = run_timed_steps(policy, 0.3, 2000, step_s, monkeypatch)
    assert policy.cost.drafter_extra == pytest.approx(0.0015 - 0.00059, rel=0.2)
    assert not policy.drafting
    late = history[1000:]
    assert sum(map(sum, late)) <= EXPLORED * (len(late) // EXPLORE_INTERVAL + 1)


def test_a_small_draft_token_cost_keeps_drafting(monkeypatch):
    policy = DraftPolicy(7, profile(0.002, 0.00001, drafter_s=0.0002))

    def step_s(n: int, d: int, drafter_ran: bool) -> float:
        return 0.002 + 0.00001 * (n + d) + 0.0002 * drafter_ran + 0.00005 * d

    history = run_timed_steps(policy, 0.9, 2000, step_s, monkeypatch)
    assert policy.drafting
    assert sum(lengths == [7, 7] for lengths in history[1000:]) >= 0.95 * 1000


def test_prompt_steps_and_the_first_step_of_each_shape_do_not_feed_the_cost_fit():
    # A prompt's step costs more than the profile says, and so does the first step of each
    # shape (one-time costs: on CPU, a GEMM primitive for each new token count).
    policy = DraftPolicy(7, profile(0.002, 0.0001))
    policy.observe([], num_tokens=64, batch_size=1, drafted=True)  # a prompt of 64 tokens
    for _ in range(2):  # the same decode shape twice
        policy.observe([("a", 7, 2)], num_tokens=8, batch_size=1, drafted=True)
    policy.observe([("a", 3, 2)], num_tokens=4, batch_size=1, drafted=True)  # a new shape
    policy.choose(["a"])
    assert policy.cost.weight == pytest.approx(1.0, rel=0.01)
    assert policy.acceptance.reached[DRAFTER, 0] == pytest.approx(3.0, rel=0.02)


def test_draft_levels():
    assert draft_levels(1) == [0, 1]
    assert draft_levels(5) == [0, 1, 3, 5]
    assert draft_levels(7) == [0, 1, 3, 7]
    assert draft_levels(15) == [0, 1, 3, 7, 15]


def test_acceptance_model_measures_conditional_rates():
    model = AcceptanceModel(max_draft=3)
    # Position 1 accepted 3 of 4 times; position 2 (reached 3 times) accepted once.
    model.observe([("a", 3, 0), ("b", 3, 1), ("c", 3, 1), ("d", 1, 1)] * 100)
    rates, _ = model.posterior()
    assert rates[0] == pytest.approx(0.75, abs=0.02)
    assert rates[1] == pytest.approx(0.0, abs=0.05)
    decided = model.expected_accepted(["a", "b"])  # at the rates decisions read
    assert decided.shape == (2, 4)
    assert np.all(np.diff(decided, axis=1) >= 0)  # more drafts never expect fewer tokens
    expected, variance, error = model.accepted_moments(["a", "b"])  # at the posterior means
    assert expected.shape == variance.shape == error.shape == (2, 4)
    assert np.all(np.diff(expected, axis=1) >= 0)
    assert np.all(decided >= expected)
    # A draft of one token accepts a Bernoulli(a_1) count, known to a_1's posterior error.
    assert variance[:, 1] == pytest.approx(expected[:, 1] * (1 - expected[:, 1]))
    assert error[:, 1] == pytest.approx(model.posterior()[1][0])


def test_cost_model_fits_host_overhead_per_step_and_request():
    model = StepCostModel(profile(0.002, 0.0001))
    rng = np.random.default_rng(0)
    for n in rng.integers(1, 64, size=500):
        tokens = int(n) * int(rng.integers(1, 9))
        profiled = float(model.profiled(np.array(tokens), np.array(n)))
        model.observe(tokens, tokens - int(n), int(n), int(n), profiled + 0.003 + 0.0005 * n)
    for n in (2, 16, 60):
        profiled = float(model.profiled(np.array(4 * n), np.array(n)))
        predicted = float(model.predict(np.array(4 * n), 3 * n, n, np.array(n)))
        assert predicted == pytest.approx(profiled + 0.003 + 0.0005 * n, rel=0.1)


def test_cost_model_reads_what_steps_that_always_draft_add_as_drafting_cost():
    # Every step drafts the same: nothing tells a per-step overhead from what drafting adds,
    # and the residual goes to drafting (a plain step is predicted at its profile), the
    # reading that keeps a drafter that does not pay from looking as if it did. Plain steps
    # then show the overhead they pay too, and the rest stays drafting's.
    model = StepCostModel(profile(0.002, 0.0001))

    def observe(steps: int, d: int, residual: float) -> None:
        for _ in range(steps):
            profiled = float(model.profiled(np.array(4 + d), np.array(4 * (d > 0))))
            model.observe(4 + d, d, 4, 4 * (d > 0), profiled + residual)

    def unprofiled(d: int) -> float:
        tokens, rows = np.array(4 + d), np.array(4 * (d > 0))
        return float(model.predict(tokens, d, 4, rows) - model.profiled(tokens, rows))

    observe(300, 28, 0.006)
    assert unprofiled(28) == pytest.approx(0.006, rel=0.02)
    assert unprofiled(0) == pytest.approx(0.0, abs=0.0002)
    for _ in range(3):  # three probes, 2 ms above their profile
        observe(1, 0, 0.002)
        observe(PROBE_INTERVAL - 1, 28, 0.006)
    assert unprofiled(0) == pytest.approx(0.002, rel=0.15)
    assert unprofiled(28) == pytest.approx(0.006, rel=0.05)


def test_cost_model_separates_the_cost_of_draft_tokens():
    # Drafted steps verify 7 drafts per request, one step in PROBE_INTERVAL none: the probes
    # alone tell the cost per draft token from the cost per request.
    model = StepCostModel(profile(0.002, 0.0001))
    rng = np.random.default_rng(1)
    for step in range(1000):
        n = int(rng.integers(1, 17))
        d = 0 if step % PROBE_INTERVAL == 0 else 7 * n
        profiled = float(model.profiled(np.array(n + d), np.array(n * (d > 0))))
        model.observe(n + d, d, n, n * (d > 0), profiled + 0.001 + 0.0002 * n + 0.0003 * d)
    assert model.per_draft_token == pytest.approx(0.0003, rel=0.1)

    def unprofiled(n: int, d: int) -> float:
        tokens, rows = np.array(n + d), np.array(n * (d > 0))
        return float(model.predict(tokens, d, n, rows) - model.profiled(tokens, rows))

    for n in (1, 4, 16):  # what the policy weighs: a step with 7 drafts a request and without
        plain, drafted = 0.001 + 0.0002 * n, 0.001 + 0.0002 * n + 0.0021 * n
        assert unprofiled(n, 7 * n) - unprofiled(n, 0) == pytest.approx(drafted - plain, rel=0.1)
        assert unprofiled(n, 0) == pytest.approx(plain, rel=0.25)


# Start-up profiles the engine logged on the 2-core CPU VM (fp32, eager, max_num_seqs 32,
# K = 7; ms): the tiny test pair and the SmolLM2-135M chat pair (tests/test_smollm2_pair.py).
TINY_PAIR = StepProfile([1, 2, 4, 8, 16, 32, 64, 128, 256],
                        [0.00515, 0.00524, 0.00621, 0.00621, 0.00713, 0.00876, 0.01189, 0.01796,
                         0.02731],
                        [1, 2, 4, 8, 16, 32], [0.00096, 0.00117, 0.00163, 0.00236, 0.00428, 0.00683])
SMOLLM2_PAIR = StepProfile([1, 2, 4, 8, 16, 32, 64, 128, 256],
                           [0.03308, 0.03688, 0.03688, 0.03688, 0.04556, 0.0684, 0.12804, 0.22979,
                            0.46663],
                           [1, 2, 4, 8, 16, 32],
                           [0.00656, 0.01065, 0.01377, 0.02397, 0.04628, 0.14929])


@pytest.mark.parametrize("profile_", [TINY_PAIR, SMOLLM2_PAIR], ids=["tiny", "smollm2"])
def test_first_step_at_concurrency_1_drafts_the_full_block(profile_):
    # One request: the full block costs the target little more than one token, so even an
    # unproven drafter is worth it.
    first = DraftPolicy(7, profile_).plan(["a"])
    assert first.lengths == [7] and first.num_draft == 7


def test_first_steps_of_a_full_batch_on_the_real_pair_draft_little():
    # 32 requests on the SmolLM2 profile: 7 drafts a request cost the target 7x a plain step;
    # before any draft is verified the policy does not bet on them.
    requests = [f"r{i}" for i in range(32)]
    first = DraftPolicy(7, SMOLLM2_PAIR).plan(requests)
    assert max(first.lengths) <= 1


def test_a_weak_drafter_at_high_concurrency_stays_short_or_off():
    # Mean acceptance length 1.5 at K = 7 (each position accepted 1 time in 3) on the real
    # pair's profile at 16 requests: no length pays, and after the first measurements only
    # explorations draft.
    acceptance = {f"r{i}": 0.33 for i in range(16)}
    policy = DraftPolicy(7, SMOLLM2_PAIR)
    history = run_steps(policy, acceptance, steps=200)
    # At most the exploring requests draft the full block in the first steps.
    assert all(sorted(lengths)[-1 - max(EXPLORE_WIDTHS)] <= 1 for lengths in history[:8])
    late = history[50:]
    assert sum(map(sum, late)) <= EXPLORED * (len(late) // EXPLORE_INTERVAL + 1)


def test_a_strong_drafter_at_high_concurrency_reaches_the_full_block_within_a_few_steps():
    # The tiny pair's profile at 16 requests, each position accepted 19 times in 20: the
    # policy starts short and drafts the full block once the first drafts are verified.
    acceptance = {f"r{i}": 0.95 for i in range(16)}
    history = run_steps(DraftPolicy(7, TINY_PAIR), acceptance, steps=40)
    assert max(history[0]) < 7
    full = next(i for i, lengths in enumerate(history) if min(lengths) == 7)
    assert full <= 12
    assert all(min(lengths) == 7 for lengths in history[full:] if max(lengths) > 0)


def test_no_drafting_when_verifying_costs_more_than_it_saves():
    # Every query token costs the same and nothing is accepted: drafts only add cost.
    policy = DraftPolicy(7, profile(0.0, 0.001))
    history = run_steps(policy, {f"r{i}": 0.0 for i in range(16)}, steps=200)
    assert policy.choose([f"r{i}" for i in range(16)]).tolist() == [0] * 16
    # Past the first measurements only the exploring requests draft, once per interval.
    late = history[100:]
    assert sum(map(sum, late)) <= EXPLORED * (len(late) // EXPLORE_INTERVAL + 1)


def test_full_block_when_acceptance_is_high_and_steps_are_cheap():
    # Steps cost the same whatever their size (small batch on a big accelerator).
    policy = DraftPolicy(7, profile(0.01, 0.0))
    history = run_steps(policy, {f"r{i}": 0.95 for i in range(4)}, steps=100)
    assert history[-1] == [7] * 4
    assert all(lengths == [7] * 4 for lengths in history)  # on from the prior, never off


def test_prior_starts_drafting_and_measurements_stop_it():
    # A cheap step favours drafting under the prior; measuring acceptance 0 turns it off.
    policy = DraftPolicy(7, profile(0.005, 0.0001))
    first = policy.plan(["a"])
    assert first.lengths == [7] and first.num_draft == 7
    run_steps(policy, {"a": 0.0}, steps=50)
    assert policy.choose(["a"]).tolist() == [0]


def test_drafting_comes_back_through_exploration():
    # Acceptance looks useless at first, then the drafter becomes excellent: exploration
    # measures it and drafting switches back on.
    policy = DraftPolicy(7, profile(0.005, 0.0001))
    run_steps(policy, {"a": 0.0, "b": 0.0}, steps=100)
    assert not policy.drafting
    history = run_steps(policy, {"a": 0.98, "b": 0.98}, steps=40 * EXPLORE_INTERVAL)
    assert policy.drafting and history[-1] == [7, 7]


def test_explorations_grow_rarer_while_drafting_stays_off():
    policy = DraftPolicy(7, profile(0.005, 0.0001))
    history = run_steps(policy, {"a": 0.0, "b": 0.0}, steps=600)
    assert not policy.drafting and policy.explore_interval == MAX_EXPLORE_INTERVAL
    exploring = [i for i, lengths in enumerate(history) if max(lengths) > 0]
    gaps = np.diff(exploring).tolist()
    assert gaps[-2:] == [MAX_EXPLORE_INTERVAL] * 2 and gaps == sorted(gaps)
    # Drafting that pays again is found, and exploration is back to every EXPLORE_INTERVAL.
    run_steps(policy, {"a": 0.98, "b": 0.98}, steps=4 * MAX_EXPLORE_INTERVAL)
    assert policy.drafting and policy.explore_interval == EXPLORE_INTERVAL


def test_exploration_prepares_full_drafts_the_step_before():
    policy = DraftPolicy(7, profile(0.005, 0.0001))
    run_steps(policy, {"a": 0.0, "b": 0.0}, steps=3 * EXPLORE_INTERVAL)
    plans = [policy.plan(["a", "b"]) for _ in range(policy.explore_interval)]
    exploring = [i for i, plan in enumerate(plans) if max(plan.lengths) > 0]
    assert len(exploring) == 1
    i = exploring[0]
    assert max(plans[i].lengths) == 7 and set(plans[i].lengths) <= {0, 7}
    assert plans[i - 1].num_draft == 7  # the drafter ran with the full block the step before


def test_no_exploration_where_even_perfect_drafts_would_not_pay():
    # Every query token costs the same and nothing else does: verifying a draft token costs
    # what the token it may save does, so no acceptance makes drafting pay.
    policy = DraftPolicy(7, profile(0.0, 0.001))
    history = run_steps(policy, {"a": 0.0, "b": 0.0}, steps=300)
    assert not policy.drafting and not policy.exploring
    assert all(lengths == [0, 0] for lengths in history[50:])


def test_requests_with_poor_acceptance_draft_less():
    # Per-token cost large enough that only confident drafts pay.
    policy = DraftPolicy(7, profile(0.002, 0.0002))
    acceptance = {f"good{i}": 0.97 for i in range(4)} | {f"poor{i}": 0.3 for i in range(4)}
    run_steps(policy, acceptance, steps=300)
    lengths = dict(zip(acceptance, policy.choose(list(acceptance)).tolist()))
    assert min(lengths[f"good{i}"] for i in range(4)) > max(lengths[f"poor{i}"] for i in range(4))


def test_request_prior_weighs_less_the_more_finished_requests_differ():
    rng = np.random.default_rng(0)
    alike = np.array([(60.0, rng.binomial(60, 0.6)) for _ in range(32)])
    apart = np.array([(60.0, rng.binomial(60, rate)) for rate in [0.1, 0.9] * 16])
    somewhat = np.array([(60.0, rng.binomial(60, rate)) for rate in [0.4, 0.8] * 16])
    assert request_prior_weight(alike) > REQUEST_PRIOR_WEIGHT  # chance explains nearly all
    assert request_prior_weight(apart) == MIN_REQUEST_PRIOR_WEIGHT
    assert MIN_REQUEST_PRIOR_WEIGHT < request_prior_weight(somewhat) < REQUEST_PRIOR_WEIGHT
    assert request_prior_weight(apart[:4]) == REQUEST_PRIOR_WEIGHT  # too few to tell


def test_requests_that_differ_widely_are_told_apart_from_their_first_drafts():
    # As the tiny pair's: some requests accept nearly every draft, others almost none. Once
    # a burst of them has finished, the next burst's requests get their own lengths after
    # two steps of drafts.
    def burst(tag: str) -> dict[str, float]:
        return {f"{tag}easy{i}": 0.97 for i in range(4)} | {f"{tag}hard{i}": 0.05
                                                              for i in range(4)}

    def first_lengths(policy: DraftPolicy) -> dict[str, int]:
        run_steps(policy, first := burst("a"), steps=200)
        for req_id in first:
            policy.request_freed(req_id)
        run_steps(policy, second := burst("b"), steps=2)
        return dict(zip(second, policy.choose(list(second)).tolist()))

    lengths = first_lengths(DraftPolicy(7, profile(0.002, 0.0002)))
    assert min(lengths[f"beasy{i}"] for i in range(4)) > max(lengths[f"bhard{i}"]
                                                             for i in range(4)), lengths


def _easy_and_hard(policy: DraftPolicy) -> dict[str, float]:
    """Four requests that accept nearly every draft and four that accept almost none, their
    rates learned over 300 steps."""
    acceptance = {f"easy{i}": 0.97 for i in range(4)} | {f"hard{i}": 0.05 for i in range(4)}
    run_steps(policy, acceptance, steps=300)
    return acceptance


def test_a_batch_no_request_waits_to_join_drafts_nothing_its_slowest_cannot_use():
    # A compute-bound target: drafts for the easy requests pay per step, but the hard ones
    # set the batch's finish, and drafts cannot bring it closer.
    policy = DraftPolicy(7, profile(0.002, 0.0002))
    requests = list(_easy_and_hard(policy))
    assert min(policy.choose(requests).tolist()[:4]) == 7  # requests wait: tokens per second
    assert policy.choose(requests, remaining=[64] * 8).tolist() == [0] * 8


def test_a_batch_no_request_waits_to_join_keeps_drafts_that_cost_little():
    # Steps cost the same whatever their size: the easy requests' drafts barely move the
    # batch's finish, and they keep them.
    policy = DraftPolicy(7, profile(0.010, 0.000001))
    requests = list(_easy_and_hard(policy))
    assert min(policy.choose(requests, remaining=[64] * 8).tolist()[:4]) == 7


def test_stable_near_the_break_even_point():
    # Drafting and plain decoding nearly tie: noisy measurements must not flip the decision
    # step to step.
    policy = DraftPolicy(3, profile(0.0, 0.001, drafter_s=0.0))
    history = run_steps(policy, {f"r{i}": 0.5 for i in range(8)}, steps=400, seed=1)
    switches = sum((sum(a) > 0) != (sum(b) > 0) for a, b in itertools.pairwise(history))
    on_off = [sum(lengths) > 0 for lengths in history]
    assert switches <= 2 * (len(history) // EXPLORE_INTERVAL) + 4, on_off


def choice_steps(policy: DraftPolicy, acceptance: dict[str, float], steps: int,
                 monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps at which the policy chooses anew, over `steps` steps."""
    return choice_steps_of(policy, lambda: run_steps(policy, acceptance, steps), monkeypatch)


def choice_steps_of(policy: DraftPolicy, run, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps at which the policy chooses anew while run() runs."""
    made, choose = [], policy.choose

    def counting_choose(req_ids: list[str], remaining: list[int] | None = None) -> np.ndarray:
        made.append(policy.steps)
        return choose(req_ids, remaining)

    monkeypatch.setattr(policy, "choose", counting_choose)
    run()
    return made


def test_a_repeated_choice_holds_twice_as_long_up_to_max_hold(monkeypatch):
    policy = DraftPolicy(7, profile(0.010, 0.0001))  # drafting pays
    made = choice_steps(policy, {"a": 0.9, "b": 0.9}, 4 + 2 + 4 + 8 + 16 + 3 * MAX_HOLD,
                        monkeypatch)
    assert policy.drafting
    # Each step chooses until the first drafts outweigh the prior (3 steps of 2 drafts).
    assert np.diff(made).tolist() == [1, 1, 1, 2, 4, 8, 16, MAX_HOLD, MAX_HOLD, MAX_HOLD]


def test_while_drafting_is_off_the_choice_is_made_once_per_exploration(monkeypatch):
    policy = DraftPolicy(7, profile(0.005, 0.0001))
    made = choice_steps(policy, {"a": 0.0, "b": 0.0}, 600, monkeypatch)
    assert not policy.drafting
    # Once off, the policy chooses right after each exploring step, and explorations grow
    # rarer up to MAX_EXPLORE_INTERVAL steps apart.
    gaps = np.diff(made).tolist()
    first_off = next(i for i, gap in enumerate(gaps) if gap >= EXPLORE_INTERVAL)
    assert gaps[first_off + 1:] == sorted(gaps[first_off + 1:])
    assert gaps[-2:] == [MAX_EXPLORE_INTERVAL] * 2
    explored = [step for step in range(policy.steps) if
                (step - 2) % MAX_EXPLORE_INTERVAL == 0 and step > made[-3]]
    assert [step + 1 for step in explored] == made[-len(explored):]


def test_drafter_skipped_when_no_request_drafts():
    policy = DraftPolicy(7, profile(0.005, 0.0001))
    run_steps(policy, {"a": 0.0}, steps=40)
    interval = policy.explore_interval
    plans = [policy.plan(["a"]) for _ in range(interval)]
    assert sum(plan.num_draft == 0 for plan in plans) == interval - 1


def test_a_uniform_choice_ends_when_most_of_its_requests_have_left():
    # In a burst the requests that draft well finish first; the ones left get a fresh choice
    # instead of the full block for the rest of the hold (up to MAX_HOLD steps).
    policy = DraftPolicy(7, profile(0.010, 0.0001))
    requests = [f"r{i}" for i in range(8)]
    run_steps(policy, dict.fromkeys(requests, 0.9), 40)
    while policy.chosen.step != policy.steps:  # up to a fresh choice
        policy.plan(requests)
    assert policy.chosen.uniform and policy.chosen.lengths[0] == 7
    made = policy.chosen.step
    policy.plan(requests[:6])  # 6 of 8 remain: the choice holds
    assert policy.chosen.step == made
    policy.plan(requests[:5])  # 5 of 8: chosen anew
    assert policy.chosen.step == policy.steps


def test_a_held_choice_ends_when_its_drafts_stop_being_accepted(monkeypatch):
    # Greedy requests, then sampled ones that accept far less (a server's traffic changing, or
    # a greedy warm-up before a run at temperature 1): the full block, held for MAX_HOLD steps
    # on ~200 drafts of the old traffic, ends as soon as one step's drafts show the change.
    policy = DraftPolicy(7, profile(0.010, 0.0001))
    requests = tuple(f"r{i}" for i in range(16))
    run_steps(policy, dict.fromkeys(requests, 0.95), 200)
    assert policy.chosen.hold == MAX_HOLD and policy.chosen.lengths.tolist() == [7] * 16
    step_s = lambda n, d, drafted: 0.010 + 0.0001 * (n + d)
    history = run_timed_steps(policy, 0.05, 40, step_s, monkeypatch, requests)
    full = [lengths.count(7) for lengths in history]
    # The first step verifies nothing (no drafts were ready), the second verifies the held
    # full block; from the third on, drafting is off but for explorations.
    assert full[:2] == [16, 16]
    assert max(full[2:]) <= max(EXPLORE_WIDTHS), full
    assert not policy.drafting


def test_sampled_requests_after_greedy_traffic_start_from_what_sampling_accepts():
    # A greedy warm-up, then requests at T = 1, as the bench runs them. The sampled requests
    # have no record of their own: they start from their class's prior, not from the greedy
    # requests' 95%, and no request drafts the full block (with one class for all, all 16
    # drafted 7). New greedy requests keep the full block; in a mixed batch each kind gets its
    # own length.
    greedy = [f"g{i}" for i in range(16)]
    policy = DraftPolicy(7, TINY_PAIR)
    run_steps(policy, dict.fromkeys(greedy, 0.95), steps=100)
    sampled = [f"s{i}" for i in range(16)]
    for req_id in sampled:
        policy.request_added(req_id, sampled=True)
    assert max(policy.plan(sampled).lengths) < 7
    mixed = [f"h{i}" for i in range(8)] + sampled[:8]
    lengths = policy.plan(mixed).lengths
    assert lengths[:8] == [7] * 8 and max(lengths[8:]) < 7, lengths
    assert policy.plan([f"n{i}" for i in range(16)]).lengths == [7] * 16
    for req_id in sampled:
        policy.request_freed(req_id)
    assert policy.acceptance.sampled == set()


def test_lookup_drafts_are_counted_apart_from_the_drafters():
    model = AcceptanceModel(max_draft=3)
    model.lookup = {"a"}
    model.observe([("a", 3, 3)] * 50, LOOKUP)
    model.observe([("a", 3, 0), ("b", 3, 0)] * 50, DRAFTER)
    assert model.posterior(LOOKUP)[0][0] > 0.9 and model.posterior(DRAFTER)[0][0] < 0.1
    # The same request reads at the rate of the source its drafts come from.
    from_lookup = model.expected_accepted(["a", "b"])
    model.lookup = set()
    from_drafter = model.expected_accepted(["a", "b"])
    assert from_lookup[0, 3] > 2.5 and from_drafter[0, 3] < 0.3
    assert from_lookup[1, 3] == pytest.approx(from_drafter[1, 3])
    model.finish("a")
    assert "a" not in model.lookup and all(key[0] != "a" for key in model.requests)
    assert len(model.finished[LOOKUP * 2]) == len(model.finished[DRAFTER * 2]) == 1


def run_mixed_sources(policy: DraftPolicy | None, n: int, told: bool, fixed: int | None = None,
                      steps: int = 300, seed: int = 0) -> tuple[float, float, float]:
    """n requests on the SmolLM2 profile whose drafts come from prompt lookup (accepted 0.9
    per position) at a random half of their steps and from the drafter (0.33) at the others;
    the policy is told which or not, or a fixed length drafts. Drafts planned for a step
    exist only if the drafter ran at the end of the step before; the step takes what the
    profile says, the drafter's pass over every request, or, where the policy's profile says
    so (lookup_skips_drafter), over those lookup has no drafts for. -> tokens per profiled
    second, and the mean draft length of lookup's and of the drafter's request-steps."""
    skips = policy is not None and policy.cost.profile.lookup_skips_drafter
    rng = random.Random(seed)
    req_ids = [f"r{i}" for i in range(n)]
    found = {r: rng.random() < 0.5 for r in req_ids}
    tokens = seconds = 0.0
    ready, lengths_by_source = 0, ([], [])
    for _ in range(steps):
        if fixed is None:
            plan = policy.plan(req_ids, lookup=[found[r] for r in req_ids] if told else None)
            lengths, num_draft = plan.lengths, plan.num_draft
        else:
            lengths, num_draft = [fixed] * n, fixed
        drafts = ([], [])
        for req_id, length in zip(req_ids, lengths):
            lengths_by_source[found[req_id]].append(length)
            verified, accepted = min(length, ready), 0
            while accepted < verified and rng.random() < (0.9 if found[req_id] else 0.33):
                accepted += 1
            if verified:
                drafts[found[req_id] and told].append((req_id, verified, accepted))
            tokens += 1 + accepted
        draft_tokens = sum(d[1] for d in drafts[0] + drafts[1])
        found = {r: rng.random() < 0.5 for r in req_ids}  # for the drafts made at the end
        rows = n - sum(found.values()) if skips else n
        seconds += float(StepCostModel(SMOLLM2_PAIR).profiled(
            np.array(n + draft_tokens), np.array(rows * (num_draft > 0))))
        if fixed is None:
            for source in (DRAFTER, LOOKUP):
                policy.acceptance.observe(drafts[source], source)
        ready = num_draft
    return (tokens / seconds, float(np.mean(lengths_by_source[True])),
            float(np.mean(lengths_by_source[False])))


@pytest.mark.parametrize("n", [4, 8])
def test_requests_draft_long_where_lookup_finds_their_drafts(n):
    # Told which drafts are lookup's, the policy drafts long for them and little for the
    # drafter's; not told, it reads every draft at the mix of the two (the full block for all
    # at 4 requests, nothing at 8). On the SmolLM2 profile that is worth 17-25% more tokens
    # per second, and it beats every fixed length (the profiled time; no engine).
    told, lookup_length, drafter_length = run_mixed_sources(
        DraftPolicy(7, SMOLLM2_PAIR, prompt_lookup=True), n, True)
    assert lookup_length > 3 and drafter_length < 1.5
    not_told = run_mixed_sources(DraftPolicy(7, SMOLLM2_PAIR), n, False)[0]
    assert told > 1.1 * not_told
    assert told > max(run_mixed_sources(None, n, False, fixed=k)[0] for k in (0, 1, 3, 7))


def test_a_drafting_step_pays_for_the_drafters_rows_only():
    # Where the drafter's pass leaves out the requests lookup drafts for (the profile says
    # so: on the CPU), a drafting step is charged the pass over the others; elsewhere over all.
    skips = dataclasses.replace(SMOLLM2_PAIR, lookup_skips_drafter=True)
    for profile_, drafter_rows in ((SMOLLM2_PAIR, 8), (skips, 3)):
        policy = DraftPolicy(7, profile_, prompt_lookup=True)
        policy.plan([f"r{i}" for i in range(8)], lookup=[i >= 3 for i in range(8)])
        expected = policy.cost.profiled(np.array(8 + 56), np.array(drafter_rows))
        assert policy._step_s(np.full(8, 7)) == pytest.approx(float(expected))
    policy.plan([f"r{i}" for i in range(8)], lookup=[True] * 8)
    assert policy._step_s(np.full(8, 7)) == pytest.approx(
        float(policy.cost.profiled(np.array(64), np.array(0))))  # no pass at all
    with pytest.raises(ValueError, match="prompt_lookup=False"):
        DraftPolicy(7, skips).plan(["r0"], lookup=[True])


@pytest.mark.parametrize("n", [4, 8])
def test_lookup_drafts_pay_where_the_drafter_leaves_their_requests_out(n):
    # Lookup's requests cost the drafter no rows: at 4 and 8 requests on the SmolLM2 profile,
    # their drafts beat plain decoding by 15% or more (profiled time; no engine).
    skips = dataclasses.replace(SMOLLM2_PAIR, lookup_skips_drafter=True)
    plain = run_mixed_sources(None, n, False, fixed=0)[0]
    tokens_per_s, lookup_length, _ = run_mixed_sources(DraftPolicy(7, skips, prompt_lookup=True), n, True)
    assert tokens_per_s > 1.15 * plain and lookup_length > 3


def test_one_class_of_traffic_reads_as_the_engine():
    # All requests sampled: the class's rate is the engine's, as without classes.
    requests = {f"r{i}": 0.6 for i in range(8)}
    plain, classed = DraftPolicy(7, TINY_PAIR), DraftPolicy(7, TINY_PAIR)
    for req_id in requests:
        classed.request_added(req_id, sampled=True)
    assert run_steps(plain, requests, steps=300) == run_steps(classed, requests, steps=300)


@pytest.mark.parametrize("acceptance", [0.3, 0.6, 0.9])
def test_steady_traffic_keeps_its_acceptance_counts(monkeypatch, acceptance):
    # Drafts that accept as predicted, give or take their spread, never pass for changed
    # traffic (after the first few, which move the estimates off their prior).
    policy = DraftPolicy(7, profile(0.010, 0.0001))
    forgotten = []
    monkeypatch.setattr(policy.acceptance, "forget", lambda: forgotten.append(policy.steps))
    step_s = lambda n, d, drafted: 0.010 + 0.0001 * (n + d)
    run_timed_steps(policy, acceptance, 1500, step_s, monkeypatch,
                    tuple(f"r{i}" for i in range(8)))
    assert [step for step in forgotten if step > 20] == []


def test_a_modest_drafter_whose_steps_cost_more_than_profiled_stops_drafting(monkeypatch):
    # The modest tiny-pair drafter at 8 requests on the CPU VM: every step pays ~1 ms of host
    # work the profile leaves out, a drafting step ~1.9 ms more (verification's bookkeeping),
    # and a draft of 7 accepts ~0.6 tokens. Drafting from the first steps, the policy sees
    # only drafting steps; their extra cost must count against drafting, not as an overhead
    # that plain steps would pay as well (that reading kept it drafting at 0.6x).
    def target_s(tokens: int) -> float:
        return 0.0018 + 0.00004 * max(0, tokens - 8)

    policy = DraftPolicy(7, StepProfile(TOKENS, [target_s(t) for t in TOKENS], BATCHES,
                                        [0.0003 + 0.00006 * b for b in BATCHES]))

    def step_s(n: int, d: int, drafter_ran: bool) -> float:
        return target_s(n + d) + 0.001 + drafter_ran * (0.0003 + 0.00006 * n + 0.00185)

    history = run_timed_steps(policy, 0.4, 200, step_s, monkeypatch,
                              tuple(f"r{i}" for i in range(8)))
    assert not policy.drafting
    assert sum(map(sum, history[50:])) <= EXPLORED * (150 // EXPLORE_INTERVAL + 1)
