"""Prompt-lookup drafts beside the drafter's (`VLLM_DFLASH_PROMPT_LOOKUP=on`).

A chat model's answer often copies from its prompt (names, code, the question restated) or
repeats itself (lists, loops of a small model). Where the last n tokens of a request (n from
MAX_NGRAM down to MIN_NGRAM, the anchor included) occurred before in its recent context, the
tokens that followed that occurrence are the request's drafts instead of the drafter's:

    context  ... a b c X Y Z ... a b c | ?        drafts: X Y Z ...

The latest earlier occurrence is taken. Its continuation repeats with period P (the distance
between the two occurrences), so a draft longer than what followed it continues the loop:
draft j is token (end + j - P) of the context extended by the drafts before it.

The tokens live in a slot-indexed store beside the drafter's KV cache (TokenHistory): each
step writes its tokens at their KV slots, as KV injection writes their context, and a
request's context is read back through its block table. No host copy and no device sync;
rejected drafts sit past the valid context and are overwritten, as in the KV cache. A slot
that holds a stale token (a KV connector loaded the block) costs acceptance, never
correctness: the target verifies every draft.

Pure torch: no vLLM.
"""

from collections.abc import Sequence

import numpy as np
import torch

MIN_NGRAM = 2
MAX_NGRAM = 4
# How far back a request's context is searched: the cost of a lookup grows with it.
LOOKUP_WINDOW = 1024


def lookup_drafts(context: torch.Tensor, num_draft: int, min_ngram: int = MIN_NGRAM,
                  max_ngram: int = MAX_NGRAM) -> tuple[torch.Tensor, torch.Tensor]:
    """context [B, W] int: each request's last W tokens, right-aligned (the anchor last),
    negative where a request has fewer. -> drafts [B, num_draft] int64 (zero where none) and
    found [B] bool."""
    num_reqs, width = context.shape
    context = context.long()
    found = torch.zeros(num_reqs, dtype=torch.bool, device=context.device)
    period = torch.ones(num_reqs, dtype=torch.int64, device=context.device)
    starts = torch.arange(width, device=context.device)
    for n in range(max_ngram, min_ngram - 1, -1):
        if width <= n:
            continue
        suffix = context[:, width - n:]
        windows = context.unfold(1, n, 1)[:, : width - n]  # a match must end before the suffix
        match = (windows == suffix[:, None]).all(dim=-1) & (suffix >= 0).all(dim=-1, keepdim=True)
        # The latest match: its start, or -1.
        latest = torch.where(match, starts[: width - n], -1).amax(dim=-1)
        take = ~found & (latest >= 0)
        period = torch.where(take, width - n - latest, period)
        found |= take
    extended = torch.cat([context, context.new_zeros(num_reqs, num_draft)], dim=1)
    rows = torch.arange(num_reqs, device=context.device)
    for j in range(num_draft):
        extended[:, width + j] = extended[rows, width + j - period]
    drafts = torch.where(found[:, None], extended[:, width:], 0)
    return drafts, found


def lookup_found(token_ids: Sequence[Sequence[int]], width: int = LOOKUP_WINDOW) -> list[bool]:
    """Whether lookup_drafts finds drafts for each request, from its token ids as a host list
    (the anchor last): the scheduler's view, for the draft-length policy."""
    rows = [row[-width:] for row in token_ids]
    context = np.full((len(rows), max(map(len, rows), default=0)), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        context[i, context.shape[1] - len(row):] = row
    # Found by the longest n-gram or not at all: the shortest one's match decides.
    return lookup_drafts(torch.from_numpy(context), 1, max_ngram=MIN_NGRAM)[1].tolist()


def with_lookup_drafts(tokens: torch.Tensor, probs: torch.Tensor | None,
                       lookup_tokens: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """The drafter's tokens [B, k] with the rows `found` [B] replaced by the lookup's; their
    distributions probs [B, k, V] (when drafts are sampled) made one-hot there, in place:
    a deterministic draft is verified exactly by the standard rule with q one-hot."""
    tokens = torch.where(found[:, None], lookup_tokens, tokens)
    if probs is not None:
        q_of_token = probs.gather(-1, tokens[..., None])
        found = found[:, None, None]
        probs.masked_fill_(found, 0.0)
        probs.scatter_(-1, tokens[..., None], torch.where(found, 1.0, q_of_token))
    return tokens


class TokenHistory:
    """Every scheduled token's id at its KV cache slot, for num_slots slots."""

    def __init__(self, num_slots: int, block_size: int, device: torch.device) -> None:
        # One slot past the cache's: padding tokens are written there, so that no host sync
        # filters them out.
        self.tokens = torch.full((num_slots + 1,), -1, dtype=torch.int32, device=device)
        self.num_slots, self.block_size = num_slots, block_size

    def write(self, token_ids: torch.Tensor, slots: torch.Tensor) -> None:
        """token_ids [>= T] at slots [T]; slot < 0 is padding and writes nothing."""
        slots = torch.where(slots >= 0, slots, self.num_slots).long()
        self.tokens[slots] = token_ids[: slots.shape[0]].to(torch.int32)

    def context(self, block_table: torch.Tensor, context_lens: torch.Tensor,
                anchors: torch.Tensor, width: int = LOOKUP_WINDOW) -> torch.Tensor:
        """[B, width] each request's last width - 1 context tokens then its anchor,
        right-aligned, -1 before its first token. context_lens [B]: tokens in the cache."""
        positions = context_lens[:, None].long() - (width - 1) + torch.arange(
            width - 1, device=block_table.device)
        valid = positions >= 0
        positions = positions.clamp(min=0)
        blocks = block_table.long().gather(1, (positions // self.block_size).clamp(
            max=block_table.shape[1] - 1))
        tokens = self.tokens[blocks * self.block_size + positions % self.block_size]
        tokens = torch.where(valid, tokens, -1)
        return torch.cat([tokens, anchors[:, None].to(tokens.dtype)], dim=1)
