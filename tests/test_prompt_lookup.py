"""Prompt-lookup drafts (vllm_dflash/prompt_lookup.py) against a plain Python reference, and
in engines: lossless, and accepted where the drafter's drafts are not."""

import os
import random

import pytest
import torch

from vllm_dflash.prompt_lookup import TokenHistory, lookup_drafts, with_lookup_drafts


def reference_lookup(tokens: list[int], num_draft: int, min_ngram: int, max_ngram: int
                     ) -> list[int] | None:
    """The longest suffix n-gram's latest earlier occurrence; what followed it, continued with
    the period between the two occurrences."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                extended = list(tokens)
                period = len(tokens) - n - start
                for _ in range(num_draft):
                    extended.append(extended[len(extended) - period])
                return extended[len(tokens):]
    return None


def right_aligned(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([[-1] * (width - len(r)) + r[-width:] for r in rows])


def test_lookup_matches_the_reference_on_random_token_streams():
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        vocab = rng.choice([3, 5, 20])  # small vocabularies repeat n-grams often
        rows.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
    width, k = 48, 7
    drafts, found = lookup_drafts(right_aligned(rows, width), k, 2, 4)
    for row, got_drafts, got_found in zip(rows, drafts.tolist(), found.tolist()):
        expected = reference_lookup(row, k, 2, 4)
        assert got_found == (expected is not None), row
        if expected is not None:
            assert got_drafts == expected, row


def test_lookup_continues_a_loop_and_copies_from_the_prompt():
    loop = [7, 8, 9] * 3 + [7]  # ... 9 7: the loop continues 8 9 7 8 ...
    copy = [1, 2, 3, 4, 5, 6, 50, 51, 2, 3]  # "2 3" occurred before, followed by 4 5 6
    none = [10, 11, 12, 13]
    drafts, found = lookup_drafts(right_aligned([loop, copy, none], 16), 5)
    assert found.tolist() == [True, True, False]
    assert drafts[0].tolist() == [8, 9, 7, 8, 9]
    assert drafts[1].tolist() == [4, 5, 6, 50, 51]


def test_lookup_prefers_the_longest_ngram():
    # "3 4" last occurred before 99, but "2 3 4" occurred before 5: the longer match wins.
    tokens = [2, 3, 4, 5, 6, 3, 4, 99, 0, 2, 3, 4]
    drafts, found = lookup_drafts(right_aligned([tokens], 16), 2)
    assert found.item() and drafts[0].tolist() == [5, 6]


def test_token_history_reads_a_request_back_through_its_block_table():
    block_size = 4
    history = TokenHistory(num_slots=6 * block_size, block_size=block_size,
                           device=torch.device("cpu"))
    # A request of 10 tokens in blocks 5, 1, 3 (positions 0-3, 4-7, 8-9), written in two
    # steps with padding slots (-1) between them.
    block_table = torch.tensor([[5, 1, 3, 0]])
    tokens = torch.arange(100, 110)
    slots = torch.tensor([5 * 4 + p if p < 4 else 1 * 4 + p - 4 if p < 8 else 3 * 4 + p - 8
                          for p in range(10)])
    history.write(torch.cat([tokens[:6], torch.tensor([0, 0])]),
                  torch.cat([slots[:6], torch.tensor([-1, -1])]))
    history.write(tokens[6:], slots[6:])
    context = history.context(block_table, torch.tensor([10]), torch.tensor([777]), width=14)
    assert context[0].tolist() == [-1] * 3 + list(range(100, 110)) + [777]
    # Only the first 7 tokens are context (a step's rejected drafts sit past it).
    context = history.context(block_table, torch.tensor([7]), torch.tensor([5]), width=5)
    assert context[0].tolist() == [103, 104, 105, 106, 5]


def test_lookup_rows_take_one_hot_distributions():
    tokens = torch.tensor([[1, 2], [3, 4]])
    probs = torch.softmax(torch.randn(2, 2, 6), dim=-1)
    drafter_row = probs[1].clone()
    merged = with_lookup_drafts(tokens, probs, torch.tensor([[5, 0], [5, 5]]),
                                torch.tensor([True, False]))
    assert merged.tolist() == [[5, 0], [3, 4]]
    assert torch.equal(probs[0], torch.nn.functional.one_hot(torch.tensor([5, 0]), 6).float())
    assert torch.equal(probs[1], drafter_row)


# ---- in engines (V1 runner; Model Runner V2: tests/test_model_runner_v2.py) ------------------

NUM_PROMPTS, MAX_TOKENS = 8, 64
ALONE = 2  # prompts run one at a time


@pytest.fixture(scope="module")
def runs(useless_pair) -> dict:
    """The trained target's greedy outputs without speculation, and with a random drafter
    (drafts almost never accepted) without and with prompt lookup, at K = 7; drafts are
    sampled (draft_sample_method "probabilistic") for a second batch at T = 0.5. Then with
    lookup and the adaptive draft length."""
    from tests.engines import dflash_llm, generate_ids, heldout_prompts, plain_llm, spec_metrics
    from vllm_dflash.vllm.config import DRAFT_LENGTH_ENV, PROMPT_LOOKUP_ENV

    prompts = heldout_prompts(NUM_PROMPTS)
    out = {"plain": generate_ids(plain_llm(useless_pair.target), prompts, max_tokens=MAX_TOKENS)}
    for name, lookup in (("drafter", "off"), ("lookup", "on")):
        os.environ[PROMPT_LOOKUP_ENV] = lookup
        try:
            llm = dflash_llm(useless_pair, 7, {"draft_sample_method": "probabilistic"})
        finally:
            del os.environ[PROMPT_LOOKUP_ENV]
        llm.collective_rpc(_count_drafter_rows)
        out[name] = generate_ids(llm, prompts, max_tokens=MAX_TOKENS)
        out[name + " rows"] = llm.collective_rpc(_drafter_rows)[0]
        greedy = spec_metrics(llm)
        out[name + " sampled"] = generate_ids(llm, prompts, max_tokens=MAX_TOKENS,
                                              temperature=0.5)
        both = spec_metrics(llm)
        out[name + " spec"] = greedy
        out[name + " sampled spec"] = {k: both[k] - greedy[k] for k in ("drafts", "accepted")}
        if lookup == "on":
            llm.collective_rpc(_count_drafter_passes)
            out["alone"] = [generate_ids(llm, [p], max_tokens=MAX_TOKENS)[0]
                            for p in prompts[:ALONE]]
            out["alone drafts"] = spec_metrics(llm)["drafts"] - both["drafts"]
            out["alone drafter passes"] = llm.collective_rpc(_drafter_passes)[0]
        del llm
    draft_length = os.environ[DRAFT_LENGTH_ENV]  # tests/engines.py's default: fixed
    os.environ.update({PROMPT_LOOKUP_ENV: "on", DRAFT_LENGTH_ENV: "adaptive"})
    try:
        llm = dflash_llm(useless_pair, 7)
    finally:
        del os.environ[PROMPT_LOOKUP_ENV]
        os.environ[DRAFT_LENGTH_ENV] = draft_length
    out["adaptive"] = generate_ids(llm, prompts, max_tokens=MAX_TOKENS)
    out["adaptive policy"] = _policy_rates(llm)
    del llm
    return out


def _policy_rates(llm) -> dict:
    """What the adaptive policy learnt: the position-1 acceptance of the drafter's and of
    lookup's drafts, how many lookup drafts it counted there, and whether its start-up
    profile says the drafter's pass leaves lookup's requests out."""
    from vllm_dflash.draft_policy import DRAFTER, LOOKUP
    from vllm_dflash.vllm.scheduler import _controllers

    policy = _controllers[llm.llm_engine.engine_core.engine_core.scheduler].policy
    acceptance = policy.acceptance
    return {"drafter": float(acceptance.posterior(DRAFTER)[0][0]),
            "lookup": float(acceptance.posterior(LOOKUP)[0][0]),
            "lookup drafts": float(acceptance.reached[LOOKUP, 0]),
            "skips": policy.cost.profile.lookup_skips_drafter}


def _count_drafter_rows(worker) -> None:
    from tests.engines import count_calls

    draft_runner = worker.model_runner.drafter.draft_runner
    rows = lambda anchor_ids, *_: anchor_ids.shape[0]
    count_calls(draft_runner, "draft_tokens", draft_runner, "drafted_rows", rows)
    count_calls(draft_runner, "block_hidden", draft_runner, "drafter_rows", rows)


def _drafter_rows(worker) -> tuple[int, int]:
    """Requests drafted for, and of them those the drafter's pass ran for."""
    draft_runner = worker.model_runner.drafter.draft_runner
    return draft_runner.drafted_rows, draft_runner.drafter_rows


def _count_drafter_passes(worker) -> None:
    from tests.engines import count_calls

    draft_runner = worker.model_runner.drafter.draft_runner
    count_calls(draft_runner, "block_hidden", draft_runner, "passes")


def _drafter_passes(worker) -> int:
    return worker.model_runner.drafter.draft_runner.passes


def acceptance_length(spec: dict) -> float:
    return 1 + spec["accepted"] / spec["drafts"]


def test_lookup_is_lossless(runs):
    assert runs["lookup"] == runs["plain"]
    assert runs["drafter"] == runs["plain"]


def test_lookup_drafts_are_accepted_where_the_drafters_are_not(runs):
    # The trained target writes Python source, which repeats its names and lines.
    assert acceptance_length(runs["drafter spec"]) < 1.2
    assert acceptance_length(runs["lookup spec"]) > 2.0


def test_the_adaptive_policy_judges_lookup_drafts_apart(runs):
    # The scheduler tells the adaptive policy which requests' drafts lookup finds: it counts
    # lookup's acceptance apart from the random drafter's, and the output stays exact.
    assert runs["adaptive"] == runs["plain"]
    policy = runs["adaptive policy"]
    # (40-50 lookup drafts on an idle machine; fewer where a loaded one makes drafting look
    # costly and the policy drafts less.)
    assert policy["lookup drafts"] >= 4 and policy["lookup"] > policy["drafter"] + 0.25, policy
    assert policy["skips"]  # on the CPU: the drafter's pass leaves lookup's requests out


def test_sampled_requests_verify_lookup_drafts(runs):
    # At T = 0.5 the tiny target's text repeats less, and less of it is looked up.
    assert all(len(ids) == MAX_TOKENS for ids in runs["lookup sampled"])
    assert runs["lookup sampled"] != runs["plain"]
    assert acceptance_length(runs["drafter sampled spec"]) < 1.05
    assert acceptance_length(runs["lookup sampled spec"]) > 1.1


def test_the_drafter_runs_for_the_requests_lookup_finds_no_drafts_for(runs):
    # On the CPU, a greedy batch's drafter pass runs for the requests lookup has no drafts
    # for, and no others (the output is exact: test_lookup_is_lossless).
    drafted, drafter = runs["lookup rows"]
    assert 0 < drafter < 0.8 * drafted, runs["lookup rows"]
    assert runs["drafter rows"][1] == runs["drafter rows"][0] > 0  # lookup off: every row


def test_a_request_alone_skips_the_drafter_where_lookup_drafts(runs):
    # On the CPU a greedy batch that lookup finds drafts for throughout runs no drafter pass.
    assert runs["alone"] == runs["plain"][:ALONE]
    assert 0 < runs["alone drafter passes"] < runs["alone drafts"], runs
