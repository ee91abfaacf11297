"""Prompts given as embeddings (`enable_prompt_embeds`): the drafter reads only the target's
hidden states and the tokens sampled since, so it drafts for them as for token-id prompts.
Greedy output equals no speculation for embedding prompts, token-id prompts and both in one
batch, with prompts prefilled in chunks; the drafts accepted are those of the same prompts
given as token ids."""


import pytest
import torch
from safetensors.torch import load_file

from tests.engines import TRAINED, dflash_llm, generate_ids, heldout_ids, plain_llm, spec_metrics

# Below the longest prompt (200 tokens): its prefill runs in chunks.
MAX_BATCHED_TOKENS = 64
GREEDY = {"max_tokens": 48, "ignore_eos": True}


def prompt_ids() -> list[list[int]]:
    ids = heldout_ids(8)
    return [*ids, (ids[0] + ids[1] + ids[2] + ids[3])[:200]]


def as_embeds(ids: list[list[int]]) -> list[dict]:
    weights = load_file(str(TRAINED.target / "model.safetensors"))
    table = weights["model.embed_tokens.weight"]
    return [{"prompt_embeds": table[torch.tensor(i)].clone()} for i in ids]


def run(llm, ids: list[list[int]]) -> dict:
    """Outputs for embedding, token-id and mixed prompts; accepted drafts of the first two."""
    embeds, tokens = as_embeds(ids), [{"prompt_token_ids": i} for i in ids]
    mixed = [embeds[i] if i % 2 else tokens[i] for i in range(len(ids))]
    out, accepted = {}, {}
    for name, prompts in (("embeds", embeds), ("tokens", tokens), ("mixed", mixed)):
        before = spec_metrics(llm)["accepted"]
        out[name] = generate_ids(llm, prompts, **GREEDY)
        accepted[name] = spec_metrics(llm)["accepted"] - before
    return {**out, "accepted": accepted}


@pytest.fixture(scope="module")
def results() -> dict:
    ids = prompt_ids()
    assert max(map(len, ids)) > MAX_BATCHED_TOKENS
    engine = {"enable_prompt_embeds": True, "max_num_batched_tokens": MAX_BATCHED_TOKENS}
    llm = plain_llm(TRAINED.target, **engine)
    plain = run(llm, ids)
    del llm
    llm = dflash_llm(TRAINED, TRAINED.block_size - 1, **engine)
    return {"plain": plain, "dflash": run(llm, ids)}


@pytest.mark.parametrize("prompts", ["embeds", "tokens", "mixed"])
def test_greedy_equals_no_speculation(results, prompts):
    assert results["dflash"][prompts] == results["plain"][prompts]
    assert results["dflash"][prompts] == results["plain"]["tokens"]


def test_embedding_prompts_draft_as_token_prompts(results):
    accepted = results["dflash"]["accepted"]
    assert accepted["embeds"] == accepted["tokens"] > 0, accepted
