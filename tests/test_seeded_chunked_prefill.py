"""Seeded sampling with chunked prefill on vLLM's CPU build.

vLLM samples and discards a token on every step that prefills only part of a prompt, and
rewinds a seeded request's generator with Generator.set_offset, so that the output does not
depend on how the prompt was chunked. CPU generators lack set_offset (vLLM 0.32 stops the
engine); in its own engines vllm-dflash restores those generators instead, and leaves other
engines as vLLM runs them. A seeded request's output with speculation is then the output of the
same request prefilled in one step, as on GPU.
Speculation draws from the request's generator too, so each engine is compared with the same
engine unchunked, not with the other.
"""

import pytest

from tests.engines import dflash_llm, heldout_ids, plain_llm, spec_metrics

# 64 tokens a step: the 300- and 130-token prompts take several steps, the short ones share the
# budget with them. 1024: the whole batch (about 650 prompt tokens) is prefilled in one step.
CHUNKED = {"max_num_batched_tokens": 64}
UNCHUNKED = {"max_num_batched_tokens": 1024}


@pytest.fixture(scope="module")
def batch() -> list[dict]:
    """Prompts of 300 and 130 tokens, then four held-out prompts (42 to 60 tokens)."""
    prompts = heldout_ids(8)
    text = [t for p in prompts for t in p]
    return [{"prompt_token_ids": ids} for ids in (text[:300], text[:130], *prompts[:4])]


@pytest.fixture(scope="module")
def plain_unchunked(trained_pair):
    llm = plain_llm(trained_pair.target, **UNCHUNKED)
    yield llm
    del llm


@pytest.fixture(scope="module")
def plain_chunked(trained_pair, plain_unchunked):
    llm = plain_llm(trained_pair.target, **CHUNKED)
    yield llm
    del llm


@pytest.fixture(scope="module")
def dflash_unchunked(trained_pair, plain_chunked):
    # The trained pair's drafts are really accepted, so seeded requests go through rejection
    # sampling.
    llm = dflash_llm(trained_pair, trained_pair.block_size - 1, **UNCHUNKED)
    yield llm
    del llm


@pytest.fixture(scope="module")
def dflash_chunked(trained_pair, dflash_unchunked):
    # Built last: each in-process engine re-registers vLLM's Prometheus metrics, so this is the
    # engine whose spec-decode counters get_metrics() reads.
    llm = dflash_llm(trained_pair, trained_pair.block_size - 1, **CHUNKED)
    yield llm
    del llm


def seeded_outputs(llm, prompts: list[dict]) -> list[list[int]]:
    """Token ids of seeded sampled completions, top-k on every other request."""
    from vllm import SamplingParams

    sampling = [SamplingParams(temperature=0.8, seed=21 + i, top_k=40 if i % 2 else 0,
                               max_tokens=16) for i in range(len(prompts))]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_seeded_chunked_prefill_without_speculation_is_vllms_own(plain_unchunked, plain_chunked,
                                                                 batch):
    # vLLM 0.32's CPU build rewinds the generator of a seeded request whose prompt is chunked
    # with Generator.set_offset, which CPU generators lack. vllm-dflash fixes that in its own
    # engines only (below): an engine that does not ask for it meets vLLM's error, as without
    # vllm-dflash installed.
    seeded_outputs(plain_unchunked, batch)
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        seeded_outputs(plain_chunked, batch)


def test_seeded_chunked_prefill_with_speculation(dflash_unchunked, dflash_chunked, batch):
    want = seeded_outputs(dflash_unchunked, batch)
    assert seeded_outputs(dflash_chunked, batch) == want
    assert seeded_outputs(dflash_chunked, batch) == want  # reproducible
    assert spec_metrics(dflash_chunked)["accepted"] > 0
