"""A drafter with sliding-window and full-attention layers through LLM(). vLLM 0.32 refuses such
drafters on the V1 runner (they would need a KV cache group per layer kind); vllm-dflash keeps
all draft layers in one group and masks the sliding layers by their window."""

import pytest

from tests.engines import Pair, dflash_llm, generate_ids, greedy_baseline, prompts_of_lengths

WINDOW = 16  # far shorter than the longer prompts: the window decides what those layers see


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    from vllm_dflash.tiny import write_random_drafter, write_random_target

    root = tmp_path_factory.mktemp("sliding")
    target = write_random_target(root / "target")
    write_random_drafter(root / "drafter", target, block_size=8,
                         sliding=(["sliding_attention", "full_attention"], WINDOW))
    return Pair(target=target, drafter=root / "drafter", block_size=8)


def test_greedy_output_equals_no_speculation(pair, monkeypatch) -> None:
    prompts = prompts_of_lengths(pair.target, (1, 9, 57, 200))
    baseline = greedy_baseline(pair.target, prompts, 40, max_num_seqs=4)
    # Fixed K: a random drafter would have the adaptive policy switch drafting off.
    monkeypatch.setenv("VLLM_DFLASH_DRAFT_LENGTH", "fixed")
    llm = dflash_llm(pair, num_speculative_tokens=7, max_num_seqs=4)
    assert [generate_ids(llm, [p], max_tokens=40, ignore_eos=True)[0]
            for p in prompts] == baseline
    assert generate_ids(llm, prompts, max_tokens=40, ignore_eos=True) == baseline
