"""Requests at the end of max_model_len.

- The default max_model_len is the target's max_position_embeddings, which is also the
  drafter's (as for Qwen3-8B and its z-lab drafter). The last blocks then draft past the
  drafter's trained positions; those drafts are never verified, and greedy output still equals
  no speculation up to the last position.
- vLLM skips the drafter for the whole batch once one request is within a block of
  max_model_len; vllm-dflash keeps drafting, so the other requests' drafter contexts get every
  token and they accept as many drafts beside such a request as without it.
"""

from pathlib import Path

import pytest

from tests.engines import (
    MAX_MODEL_LEN,
    TRAINED,
    Pair,
    dflash_llm,
    generate_ids,
    heldout_ids,
    plain_llm,
    prompts_of_lengths,
    spec_metrics,
)

MAX_POSITIONS = 256
PROMPT_LENGTHS = (1, 100, 200, 250)


def default_max_model_len_outputs(root: Path) -> dict:
    from vllm_dflash.tiny import write_random_drafter, write_random_target

    target = write_random_target(root / "target", max_position_embeddings=MAX_POSITIONS)
    write_random_drafter(root / "drafter", target, block_size=8)
    pair = Pair(target=target, drafter=root / "drafter", block_size=8)
    prompts = prompts_of_lengths(target, PROMPT_LENGTHS)
    greedy = {"max_tokens": 100, "ignore_eos": True}
    llm = plain_llm(target, max_model_len=None)
    result = {"plain": generate_ids(llm, prompts, **greedy)}
    del llm
    llm = dflash_llm(pair, pair.block_size - 1, max_model_len=None)
    result["max_model_len"] = llm.llm_engine.vllm_config.model_config.max_model_len
    result["dflash"] = generate_ids(llm, prompts, **greedy)
    del llm
    return result


def neighbour_outputs() -> dict:
    """Held-out prompts alone, a prompt a few tokens short of max_model_len alone, and both in
    one batch: outputs and accepted draft tokens of each run."""
    ids = heldout_ids()
    short = [{"prompt_token_ids": i} for i in ids[1:9]]
    near_end = [{"prompt_token_ids": (ids[0] * 20)[: MAX_MODEL_LEN - 17]}]
    llm = dflash_llm(TRAINED, TRAINED.block_size - 1)
    result = {}
    for name, prompts in (("short", short), ("near_end", near_end),
                          ("together", short + near_end)):
        before = spec_metrics(llm)["accepted"]
        result[name] = generate_ids(llm, prompts, max_tokens=150, ignore_eos=True)
        result[f"{name}_accepted"] = spec_metrics(llm)["accepted"] - before
    del llm
    return result


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    return {"default": default_max_model_len_outputs(tmp_path_factory.mktemp("positions")),
            "neighbour": neighbour_outputs()}


def test_default_max_model_len_is_the_drafters_positions(outputs):
    assert outputs["default"]["max_model_len"] == MAX_POSITIONS


def test_greedy_equals_no_speculation_up_to_the_last_position(outputs):
    default = outputs["default"]
    assert default["dflash"] == default["plain"]
    ran_into_the_end = [n + len(out) for n, out in zip(PROMPT_LENGTHS, default["dflash"])]
    assert ran_into_the_end[-2:] == [MAX_POSITIONS, MAX_POSITIONS]


def test_a_request_at_the_end_costs_its_neighbours_no_drafts(outputs):
    run = outputs["neighbour"]
    assert len(run["near_end"][0]) == 17  # it reaches max_model_len
    assert run["together"] == run["short"] + run["near_end"]
    alone = run["short_accepted"] + run["near_end_accepted"]
    # Skipping the drafter while the last request runs out cost the others ~10% (920 of 1,021).
    assert run["together_accepted"] == pytest.approx(alone, rel=0.01)
