"""Sampled drafts (vllm_dflash/draft_sampling.py), no vLLM: tokens follow the drafter's
distribution at the request's temperature; greedy and seeded requests draft the argmax with a
one-hot distribution."""

from types import SimpleNamespace

import pytest
import torch

from tests.chi_square import assert_distribution
from vllm_dflash.draft_sampling import DraftSampling, draft_sampling, sample_drafts

VOCAB = 12


def test_sampled_tokens_follow_the_tempered_distribution():
    torch.manual_seed(0)
    batch, k = 4000, 3
    logits = torch.randn(k, VOCAB).expand(batch, k, VOCAB)
    temperature = torch.full((batch,), 0.7)
    everyone = torch.ones(batch, dtype=torch.bool)
    tokens, q = sample_drafts(logits, DraftSampling(temperature, everyone))
    expected = (logits[0] / 0.7).softmax(dim=-1)
    torch.testing.assert_close(q, expected.expand(batch, k, VOCAB))
    for pos in range(k):
        assert_distribution(tokens[:, pos], expected[pos])


def test_unsampled_requests_draft_the_argmax_with_a_one_hot_distribution():
    torch.manual_seed(1)
    logits = torch.randn(4, 5, VOCAB)
    sampled = torch.tensor([True, False, True, False])
    tokens, q = sample_drafts(logits, DraftSampling(torch.tensor([1.0, 0.0, 2.0, 0.5]), sampled))
    argmax = logits.argmax(dim=-1)
    for b in (1, 3):
        assert torch.equal(tokens[b], argmax[b])
        assert torch.equal(q[b], torch.nn.functional.one_hot(argmax[b], VOCAB).float())
    for b in (0, 2):
        t = 1.0 if b == 0 else 2.0
        torch.testing.assert_close(q[b], (logits[b] / t).softmax(dim=-1))
        assert (q[b].gather(-1, tokens[b][:, None]) > 0).all()


@pytest.mark.parametrize("all_greedy", [True, False])
def test_draft_sampling_from_vllm_metadata(all_greedy: bool):
    temperature = None if all_greedy else torch.tensor([0.0, 0.8, 1.0, 0.5])
    metadata = SimpleNamespace(all_greedy=all_greedy, temperature=temperature,
                               generators={2: torch.Generator()})
    sampling = draft_sampling(metadata, 4)
    if all_greedy:
        assert sampling is None
    else:  # greedy row 0 and seeded row 2 draft the argmax
        assert sampling.sampled.tolist() == [False, True, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exponential_draws_exp_1_and_follows_its_generator(dtype):
    from scipy import stats

    from vllm_dflash.layers import exponential_

    draws = exponential_(torch.empty(200_000, dtype=dtype), torch.Generator().manual_seed(0))
    assert draws.dtype == dtype and bool((draws > 0).all())
    assert stats.kstest(draws.numpy(), "expon").pvalue > 1e-3
    again = exponential_(torch.empty(200_000, dtype=dtype), torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
