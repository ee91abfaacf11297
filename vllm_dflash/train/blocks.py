"""Training blocks: random anchors, the packed attention mask and the loss weights.

A block anchored at position p is [token p, MASK x (B-1)] at positions p .. p+B-1; its mask
positions k = 1..B-1 predict tokens p+k. Blocks lie inside the trained spans of a sequence (its
response, or each assistant turn of a chat). Many blocks of one sequence share one forward pass:
each block sees the context features at positions < p and its own B positions
(bidirectionally), never another block.
"""

import torch
import torch.nn.functional as F

from vllm_dflash.model import CandidateSelector, LiLiCorrHead, SelectorInputs

PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's loss decay for its block sizes, about B/2 - 1 for the others."""
    return PAPER_GAMMA.get(block_size, max(1.0, block_size / 2 - 1))


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B-1] weights exp(-(k-1)/gamma) of mask positions k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(
    response_start: int, seq_len: int, block_size: int, num_anchors: int, gen: torch.Generator
) -> torch.Tensor:
    """Sorted distinct anchors p with response_start <= p and p + B - 1 < seq_len.

    Blocks may overlap (they never see each other). Returns fewer than num_anchors when the
    response has fewer valid positions, none when it is shorter than a block.
    """
    return span_anchors([(response_start, seq_len)], block_size, num_anchors, gen)


def span_anchors(
    spans: list[tuple[int, int]], block_size: int, num_anchors: int, gen: torch.Generator
) -> torch.Tensor:
    """Sorted distinct anchors p whose block p .. p+B-1 lies inside one of the [start, end)
    spans (p >= 1: an anchor needs some context), so that every label is in a span too."""
    valid = [torch.arange(max(start, 1), end - block_size + 1) for start, end in spans
             if end - block_size + 1 > max(start, 1)]
    if not valid:
        return torch.empty(0, dtype=torch.long)
    valid = torch.cat(valid)
    picked = torch.randperm(len(valid), generator=gen)[:num_anchors]
    return valid[picked].sort().values


def block_inputs(
    token_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flattened [A*B] block token ids, positions, and labels (-100 at the anchors)."""
    positions = (anchors[:, None] + torch.arange(block_size)).flatten()
    labels = token_ids[positions].view(-1, block_size).clone()
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, 0] = labels[:, 0]
    labels[:, 0] = -100
    return block_ids.flatten(), positions, labels.flatten()


def block_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """Boolean [A*B, context_len + A*B]: True where a block query may attend."""
    block_of_query = torch.arange(len(anchors)).repeat_interleave(block_size)
    sees_context = torch.arange(context_len)[None, :] < anchors[block_of_query][:, None]
    sees_block = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([sees_context, sees_block], dim=1)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the mask positions, weighted by position in block, normalised by weight."""
    block_size = len(weights) + 1
    per_token = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")
    w = (
        torch.cat([weights.new_zeros(1), weights])
        .to(logits.device)
        .repeat(len(labels) // block_size)
    )
    return (per_token * w).sum() / w.sum()


def position_hits(logits: torch.Tensor, labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B-1] counts, over the blocks, of mask positions k = 1..B-1 whose greedy token (argmax of
    the logits) is the label."""
    greedy = logits.detach().view(-1, block_size, logits.shape[-1])[:, 1:].argmax(dim=-1)
    truth = labels.view(-1, block_size)[:, 1:].to(greedy.device)
    return (greedy == truth).sum(dim=0).float()


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor,
                  block_ids: torch.Tensor, labels: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """A DFlash2 candidate selector's loss, teacher-forced: at each mask position the edges
    from the true previous token (the anchor at the first) must pick the true token among the
    position's top_k candidates by logit (the true token replacing the last one when missing).
    Cross-entropy over those edges, weighted like block_loss. Inputs are flat over blocks."""
    block_size = len(weights) + 1
    hidden = hidden.view(-1, block_size, hidden.shape[-1])[:, 1:]
    logits = logits.view(-1, block_size, logits.shape[-1])[:, 1:]
    truth = labels.view(-1, block_size)[:, 1:].to(logits.device)
    previous = torch.cat([block_ids.view(-1, block_size)[:, :1].to(logits.device),
                          truth[:, :-1]], dim=1)
    candidates = logits.detach().topk(selector.top_k, dim=-1).indices
    missing = ~(candidates == truth[..., None]).any(dim=-1)
    candidates[..., -1] = torch.where(missing, truth, candidates[..., -1])
    scores = selector.scores(hidden, previous[..., None], candidates,
                             logits.gather(-1, candidates))[..., 0, :]
    target = (candidates == truth[..., None]).int().argmax(dim=-1)
    per_token = F.cross_entropy(scores.flatten(0, 1), target.flatten(), reduction="none")
    w = weights.to(logits.device).repeat(len(truth))
    return (per_token * w).sum() / w.sum()


def lattice_loss(head: LiLiCorrHead, hidden: torch.Tensor, logits: torch.Tensor,
                 labels: torch.Tensor, weights: torch.Tensor, inputs: SelectorInputs
                 ) -> torch.Tensor:
    """A LiLiCorr head's loss, teacher-forced like selector_loss: the lattice holds each mask
    position's top_k candidates by log-prob (the true token replacing the last one when
    missing, which keeps the rank order), and at each position the edges from the true
    previous token's candidate (the anchor's vector at the first) must pick the true token.
    The candidates' log-prob features are detached: the head learns to read them, the
    drafter's logits learn from block_loss. inputs.anchor_states [A]: the context state
    before each block. Inputs are flat over blocks."""
    block_size = len(weights) + 1
    hidden = hidden.view(-1, block_size, hidden.shape[-1])[:, 1:]
    log_probs = logits.detach().float().view(-1, block_size, logits.shape[-1])[:, 1:]
    log_probs = log_probs.log_softmax(dim=-1)
    truth = labels.view(-1, block_size)[:, 1:].to(logits.device)
    candidates = log_probs.topk(head.top_k, dim=-1).indices
    missing = ~(candidates == truth[..., None]).any(dim=-1)
    candidates[..., -1] = torch.where(missing, truth, candidates[..., -1])
    scores = head.scores(hidden, candidates, log_probs.gather(-1, candidates), inputs)
    index = (candidates == truth[..., None]).int().argmax(dim=-1)  # the truth's candidate
    previous = torch.cat([index.new_zeros(len(index), 1), index[:, :-1]], dim=1)
    rows = scores.gather(2, previous[..., None, None].expand(-1, -1, 1, head.top_k))[:, :, 0]
    per_token = F.cross_entropy(rows.flatten(0, 1), index.flatten(), reduction="none")
    w = weights.to(logits.device).repeat(len(truth))
    return (per_token * w).sum() / w.sum()
