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
The target's top-k / top-p are not applied to q: any q keeps the output exact. A DFlash2 or
LiLiCorr drafter's drafts come from its candidate selector's walk instead (`select_drafts`), by
the same rules per request: q is then spread over each position's candidates.
"""

from typing import Any, NamedTuple

import torch

from vllm_dflash.kernels.argmax import argmax_rows
from vllm_dflash.layers import exponential_
from vllm_dflash.model import CandidateSelector, LiLiCorrHead, SelectorInputs, walk

Selector = CandidateSelector | LiLiCorrHead


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


def select_drafts(selector: Selector, hidden: torch.Tensor, logits: torch.Tensor,
                  inputs: SelectorInputs, sampling: DraftSampling | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A DFlash2 or LiLiCorr drafter's drafts: the candidate selector's walk from the anchors,
    greedy, or for the requests `sampling` marks drawn at each position from q = softmax(edge
    scores / T) over that position's candidates. -> tokens [B, K] and, when sampling, q
    [B, K, V] (zero outside the candidates; one-hot for the other requests)."""
    candidates, scores = selector.edge_scores(hidden, logits, inputs)
    greedy = scores.argmax(dim=-1)
    if sampling is None:
        return walk(candidates, greedy)[0], None
    sampled = sampling.sampled[:, None, None]
    temperature = torch.where(sampling.sampled, sampling.temperature, 1.0).float()
    # One draw for every edge row, though the walk reads only the rows it takes: those are
    # independent draws from their q.
    q = (scores / temperature[:, None, None, None]).softmax(dim=-1)
    race = exponential_(torch.empty_like(q)).reciprocal_().mul_(q)  # argmax ~ q
    tokens, rows = walk(candidates, torch.where(sampled, race.argmax(dim=-1), greedy))
    k = candidates.shape[-1]
    q_taken = q.gather(2, rows[..., None, None].expand(-1, -1, 1, k))[:, :, 0]
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    probs.scatter_(-1, candidates, q_taken.masked_fill_(~sampled, 0.0))
    q_of_token = probs.gather(-1, tokens[..., None])
    probs.scatter_(-1, tokens[..., None], torch.where(sampled, q_of_token, 1.0))
    return tokens, probs


def choose_drafts(selector: Selector | None, hidden: torch.Tensor, logits: torch.Tensor,
                  inputs: SelectorInputs, sampling: DraftSampling | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [B, K] from the drafter's hidden states [B, K, H] and logits [B, K, V]:
    a DFlash2 or LiLiCorr drafter's selector walk from the anchors, else the argmax
    (output_multiplier and softcapping are monotonic, so the target's logits give the
    drafter's argmax) or the draws for the requests `sampling` marks; then their
    distributions q [B, K, V] when sampling."""
    if selector is not None:
        return select_drafts(selector, hidden, logits, inputs, sampling)
    if sampling is None:
        return argmax_rows(logits), None
    return sample_drafts(logits, sampling)
