"""The engine's output distribution with speculation, per request, in one mixed batch.

A target whose next-token distribution is the same at every position (its layers are zero and
all its token embeddings equal, so its logits are the lm_head's fixed row sums) makes every
output token an independent draw: with speculation each must still follow the request's own
temperature, top-k and top-p exactly. Requests of three sampling settings run in one batch with
sampled drafts from a random drafter (accepted often enough on 260 tokens to exercise both
acceptance and the residual draw), and each setting's tokens pass a chi-square test against the
exactly filtered distribution. Seeded requests keep the test deterministic.
"""

import pytest
import torch

from tests.chi_square import chi_square, critical
from tests.engines import Pair, dflash_llm, spec_metrics

VOCAB = 260
K = 3
TOKENS_PER_REQUEST = 48
REQUESTS_PER_SETTING = 24
SETTINGS = [
    {"temperature": 0.8, "top_k": 6},
    {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 1.3, "top_k": 40, "top_p": 0.9},
]


def write_constant_target(out) -> torch.Tensor:
    """A Qwen3 target (random tokenizer) whose logits are the same at every position; returns
    them."""
    from transformers import AutoModelForCausalLM

    from vllm_dflash.tiny import write_random_target

    write_random_target(out, vocab_size=VOCAB, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.model.layers.named_parameters():
            if not name.endswith("norm.weight"):
                param.zero_()
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.randn(embed.shape[1], generator=generator).expand_as(embed))
        # Logits of spread ~2: a few tokens dominate, as in a real model's distribution.
        head = model.lm_head.weight
        head.copy_(torch.randn(head.shape, generator=generator) * 2 / head.shape[1] ** 0.5)
        logits = model(torch.tensor([[5, 6, 7]])).logits[0]
    assert torch.allclose(logits[0], logits[-1], atol=1e-5)
    model.save_pretrained(out)
    return logits[-1]


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """vLLM's sampling distribution: temperature, then top-k, then top-p (a token stays while
    the tokens ranked above it hold less than top_p of the mass)."""
    scaled = logits.double() / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    probs = scaled.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        above = sorted_probs.cumsum(0) - sorted_probs
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = above < top_p
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


@pytest.fixture(scope="module")
def pair_and_logits(tmp_path_factory) -> tuple[Pair, torch.Tensor]:
    from vllm_dflash.tiny import write_random_drafter

    root = tmp_path_factory.mktemp("constant")
    logits = write_constant_target(root / "target")
    write_random_drafter(root / "drafter", root / "target", block_size=K + 1, num_layers=1)
    return Pair(target=root / "target", drafter=root / "drafter", block_size=K + 1), logits


@pytest.fixture(scope="module")
def run(pair_and_logits) -> tuple[list[list[list[int]]], dict]:
    """Token ids per setting per request, and the spec-decode counters."""
    from vllm import SamplingParams

    pair, _ = pair_and_logits
    llm = dflash_llm(pair, K, speculative={"draft_sample_method": "probabilistic"},
                     max_num_seqs=len(SETTINGS) * REQUESTS_PER_SETTING)
    try:
        # Interleaved: every batch mixes the three settings.
        params = [SamplingParams(max_tokens=TOKENS_PER_REQUEST, ignore_eos=True, seed=i,
                                 **SETTINGS[i % len(SETTINGS)])
                  for i in range(len(SETTINGS) * REQUESTS_PER_SETTING)]
        prompts = [{"prompt_token_ids": [2 + i % 50, 3, 4]} for i in range(len(params))]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = spec_metrics(llm)
    finally:
        del llm
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    return [ids[s::len(SETTINGS)] for s in range(len(SETTINGS))], metrics


def test_sampled_drafts_were_verified_accepted_and_rejected(run):
    _, metrics = run
    assert metrics["drafts"] > 0 and metrics["draft_tokens"] == K * metrics["drafts"]
    accepted = metrics["accepted"] / metrics["draft_tokens"]
    assert 0.05 < accepted < 0.95, metrics  # both the acceptance and the residual draw ran


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_each_request_follows_its_own_sampling_distribution(run, pair_and_logits, setting):
    per_request, _ = run
    _, logits = pair_and_logits
    tokens = torch.tensor([t for ids in per_request[setting] for t in ids])
    assert len(tokens) == REQUESTS_PER_SETTING * TOKENS_PER_REQUEST
    assert len({tuple(ids) for ids in per_request[setting]}) == REQUESTS_PER_SETTING  # varied
    probs = filtered_probs(logits, **SETTINGS[setting])
    # Categories expected fewer than 5 times are pooled into one, as the test requires.
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs * len(tokens)
    small = (expected < 5) & (probs > 0)
    assert counts[probs == 0].sum() == 0, "a token outside the filtered support was emitted"
    pooled_counts = torch.cat([counts[~small & (probs > 0)], counts[small].sum()[None]])
    pooled_probs = torch.cat([probs[~small & (probs > 0)], probs[small].sum()[None]])
    stat, df = chi_square(pooled_counts, pooled_probs)
    assert stat < critical(df), f"chi-square {stat:.1f} >= {critical(df):.1f} (df {df})"
