"""The default max_model_len: the target's max_position_embeddings, which is also the drafter's
(as for Qwen3-8B and its z-lab drafter). The last blocks then draft past the drafter's trained
positions; those drafts are never verified, and greedy output still equals no speculation up to
the last position."""

import pytest

from tests.engines import Pair, dflash_llm, generate_ids, plain_llm, prompts_of_lengths

MAX_POSITIONS = 256
PROMPT_LENGTHS = (1, 100, 200, 250)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    from vllm_dflash.tiny import write_random_drafter, write_random_target

    root = tmp_path_factory.mktemp("positions")
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
    return result


def test_default_max_model_len_is_the_drafters_positions(outputs):
    assert outputs["max_model_len"] == MAX_POSITIONS


def test_greedy_equals_no_speculation_up_to_the_last_position(outputs):
    assert outputs["dflash"] == outputs["plain"]
    ran_into_the_end = [n + len(out) for n, out in zip(PROMPT_LENGTHS, outputs["dflash"])]
    assert ran_into_the_end[-2:] == [MAX_POSITIONS, MAX_POSITIONS]
