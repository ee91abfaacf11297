"""Draft tokens sampled from the drafter's distribution (`draft_sample_method: "probabilistic"`).

A greedy draft d is accepted with probability p(d); a draft sampled from q is accepted with
probability min(1, p(d) / q(d)), in all sum_v min(p(v), q(v)), which is larger wherever the
drafter's distribution q is close to the target's p and spread over several tokens (sampling at
T > 0). Verification stays exact given q (kernels/verify.py), so q only changes acceptance.

Per request of the batch:
    greedy request (T = 0):        d = argmax, q = one-hot (unread: greedy rows verify by argmax)
    seeded request (T > 0, seed):  d = argmax, q = one-hot: its output must depend only on its
                                   own generator, which the drafts would otherwise consume
    other request (T > 0):         q = softmax(logits / T), d ~ q (exponential race)
The target's top-k / top-p are not applied to q: any q keeps the output exact.
"""

from typing import Any, NamedTuple

import torch

from vllm_dflash.kernels.argmax import argmax_rows
from vllm_dflash.layers import exponential_


class DraftSampling(NamedTuple):
    temperature: torch.Tensor  # [B]
    sampled: torch.Tensor  # [B] bool: the requests that draw their drafts from q


def draft_sampling(sampling_metadata: Any, num_reqs: int) -> DraftSampling | None:
    """The batch's DraftSampling from vLLM's SamplingMetadata (duck-typed: .all_greedy,
    .temperature, .generators keyed by request row); None when no request draws."""
    if sampling_metadata.all_greedy:
        return None
    temperature = sampling_metadata.temperature[:num_reqs]
    sampled = temperature > 0
    sampled[list(sampling_metadata.generators)] = False
    return DraftSampling(temperature, sampled)


def sample_drafts(logits: torch.Tensor,
                  sampling: DraftSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, K, V] -> draft tokens [B, K] int64 and their distributions q [B, K, V] fp32.
    Two [B, K, V] fp32 tensors at most are alive at once."""
    sampled = sampling.sampled[:, None, None]
    temperature = torch.where(sampling.sampled, sampling.temperature, 1.0).float()
    probs = (logits.float() / temperature[:, None, None]).softmax(dim=-1)
    race = exponential_(torch.empty_like(probs)).reciprocal_().mul_(probs)  # argmax ~ probs
    tokens = torch.where(sampling.sampled[:, None], argmax_rows(race), argmax_rows(logits))
    del race
    q_of_token = probs.gather(-1, tokens[..., None])
    probs.masked_fill_(~sampled, 0.0)  # greedy and seeded requests: one-hot q
    probs.scatter_(-1, tokens[..., None], torch.where(sampled, q_of_token, 1.0))
    return tokens, probs
