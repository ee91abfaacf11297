"""The chat prompts of the SmolLM2 pair (vllm_dflash/pairs/prompts.py): the committed held-out
set is well formed and on the held-out side of the split; the training set is seeded, spread
over the categories, and shares no source or content with the held-out set."""

from collections import Counter

import pytest

from vllm_dflash.pairs import prompts

TRAIN_COUNT = 500


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    return prompts.load_heldout()


@pytest.fixture(scope="module")
def training() -> list[dict]:
    return prompts.training_prompts(TRAIN_COUNT, seed=0)


def test_heldout_is_a_fixed_chat_set_of_every_category(heldout):
    assert len(heldout) >= 64
    counts = Counter(r["category"] for r in heldout)
    assert set(counts) == set(prompts.CATEGORIES) and min(counts.values()) >= 8
    for record in heldout:
        assert [m["role"] for m in record["messages"]] == ["user"]
        assert record["messages"][0]["content"].strip()
        assert prompts.is_heldout(record["source"])
    assert len({prompts.content(r) for r in heldout}) == len(heldout)


def test_training_prompts_are_disjoint_from_heldout(heldout, training):
    assert len(training) == TRAIN_COUNT
    assert {prompts.content(r) for r in heldout}.isdisjoint(prompts.content(r) for r in training)
    assert {r["source"] for r in heldout}.isdisjoint(r["source"] for r in training)
    assert not any(prompts.is_heldout(r["source"]) for r in training)
    counts = Counter(r["category"] for r in training)
    assert counts == {c: TRAIN_COUNT // len(prompts.CATEGORIES) for c in prompts.CATEGORIES}
    assert len({prompts.content(r) for r in training}) == TRAIN_COUNT


def test_training_prompts_repeat_for_a_seed(training):
    assert prompts.training_prompts(TRAIN_COUNT, seed=0) == training
    assert prompts.training_prompts(TRAIN_COUNT, seed=1) != training


def test_training_prompts_leave_out_what_a_heldout_file_holds(training, tmp_path):
    leaked = prompts.write_jsonl([dict(training[0], source="writing:elsewhere")],
                                 tmp_path / "heldout.jsonl")
    again = prompts.training_prompts(TRAIN_COUNT, seed=0, heldout_file=leaked)
    assert prompts.content(training[0]) not in {prompts.content(r) for r in again}
    assert len(again) == TRAIN_COUNT


def test_training_records_are_what_train_reads(training):
    from vllm_dflash.train.data import record_example

    class Tokenizer:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    example = record_example(Tokenizer(), training[0])
    assert example.response_ids == [] and len(example.prompt_ids) > 0
