"""The draft-length controller (draft_length.py) without vLLM: what the scheduler does with the
policy each step, on stand-in requests and a policy whose plan is set by the test."""

from types import SimpleNamespace

from vllm_dflash.draft_length import DraftLengthController, is_seeded_sampling
from vllm_dflash.draft_policy import Plan

K = 7


class FixedPolicy:
    """Plans the lengths it is given, in request order; records what it is told."""

    def __init__(self, lengths: list[int], num_draft: int) -> None:
        self.lengths, self.num_draft = lengths, num_draft
        self.planned: list[list[str]] = []
        self.remaining: list[list[int] | None] = []
        self.lookup: list[list[bool] | None] = []
        self.observed: list[tuple] = []
        self.idled = 0
        self.sampled: set[str] = set()
        self.prompt_lookup = False

    def plan(self, req_ids: list[str], remaining: list[int] | None = None,
             lookup: list[bool] | None = None) -> Plan:
        self.planned.append(req_ids)
        self.remaining.append(remaining)
        self.lookup.append(lookup)
        return Plan(self.lengths[: len(req_ids)], self.num_draft)

    def observe(self, drafts, num_tokens, batch_size, drafted) -> None:
        self.observed.append((drafts, num_tokens, batch_size, drafted))

    def summary(self, flush: bool = False) -> str | None:
        return "flushed" if flush else None

    def idle(self) -> None:
        self.idled += 1

    def request_added(self, req_id: str, sampled: bool) -> None:
        if sampled:
            self.sampled.add(req_id)

    def request_freed(self, req_id: str) -> None:
        self.sampled.discard(req_id)


def request(req_id: str, drafts: int = K, prefill: bool = False, seed: int | None = None,
            temperature: float = 0.0, max_tokens: int = 64, num_output_tokens: int = 0,
            token_ids: tuple[int, ...] = (1, 2, 3)) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, spec_token_ids=list(range(drafts)), is_prefill_chunk=prefill,
        max_tokens=max_tokens, num_output_tokens=num_output_tokens, all_token_ids=token_ids,
        sampling_params=SimpleNamespace(seed=seed, temperature=temperature))


def test_a_batch_that_only_shrinks_is_planned_with_its_remaining_tokens():
    policy = FixedPolicy([7, 7], num_draft=7)
    controller = DraftLengthController(policy, K)
    running = [request("a", num_output_tokens=10), request("b", max_tokens=32)]
    controller.plan_step(running, waiting=[])
    controller.plan_step(running, waiting=[request("w")])  # a request waits to join
    controller.plan_step(running + [request("p", prefill=True)], waiting=[])  # one joins
    assert policy.remaining == [[54, 32], None, None]


def test_drafts_are_cut_to_the_planned_lengths():
    policy = FixedPolicy([0, 3, 7], num_draft=3)
    controller = DraftLengthController(policy, K)
    running = [request("a"), request("b"), request("c", drafts=2), request("p", prefill=True)]
    assert controller.plan_step(running, waiting=[]) == 3
    assert policy.planned == [["a", "b", "c"]]  # prefill chunks are not planned
    assert [len(r.spec_token_ids) for r in running] == [0, 3, 2, K]


def test_seeded_sampling_requests_keep_full_drafts():
    policy = FixedPolicy([0, 0], num_draft=0)
    controller = DraftLengthController(policy, K)
    seeded = request("s", seed=1, temperature=0.8)
    assert is_seeded_sampling(seeded)
    assert not is_seeded_sampling(request("g", seed=1, temperature=0.0))  # greedy: no draws
    controller.added(seeded)
    running = [request("a"), seeded]
    # The drafter proposes K for the seeded request, whatever the plan for the others.
    assert controller.plan_step(running, waiting=[]) == K
    assert policy.planned == [["a"]]
    assert len(running[0].spec_token_ids) == 0 and len(seeded.spec_token_ids) == K
    # A seeded request still waiting (prefilled this step) drafts K from its first step.
    assert controller.plan_step([request("a")], waiting=[seeded]) == K
    controller.freed(seeded)
    assert controller.seeded == set()
    # Without a seeded request held, the waiting queue is not searched.
    assert controller.plan_step([request("a")], waiting=[seeded]) == 0


def test_observations_and_idle_reach_the_policy():
    policy = FixedPolicy([], num_draft=0)
    controller = DraftLengthController(policy, K)
    assert controller.observe_step([("a", 7, 3)], num_tokens=9, batch_size=2,
                                   drafted=True) is None
    assert policy.observed == [([("a", 7, 3)], 9, 2, True)]
    assert controller.idle() == "flushed" and policy.idled == 1


def test_the_policy_knows_which_requests_sample():
    policy = FixedPolicy([], num_draft=0)
    controller = DraftLengthController(policy, K)
    for r in (request("g"), request("t", temperature=0.7), request("s", seed=3, temperature=1.0),
              request("e", temperature=1e-6)):  # below vLLM's sampling threshold: greedy
        controller.added(r)
    assert policy.sampled == {"t", "s"}
    controller.freed(request("t", temperature=0.7))
    assert policy.sampled == {"s"}


def test_with_prompt_lookup_the_policy_is_told_whose_drafts_lookup_finds():
    # "b" ends in 5 6, which occurred before: lookup drafts what followed (7); "a" and "c"
    # end in bigrams seen nowhere before. Seeded requests are not the policy's.
    running = [request("a"), request("b", token_ids=(5, 6, 7, 5, 6)),
               request("s", seed=1, temperature=1.0, token_ids=(5, 6, 5, 6)),
               request("c", token_ids=tuple(range(2000)))]
    for prompt_lookup, told in ((False, None), (True, [False, True, False])):
        policy = FixedPolicy([K] * 3, num_draft=K)
        policy.prompt_lookup = prompt_lookup
        DraftLengthController(policy, K).plan_step(running, [])
        assert policy.planned == [["a", "b", "c"]] and policy.lookup == [told]
