"""Deferred KV injection. While no request drafts, the target's features of each step wait in
a fixed buffer and are injected in one batch before the drafter next reads its context cache,
or once the buffer is full. On a small target a step's injection is mostly fixed cost (its
kernels' launches and GEMM set-up), paid once per batch instead of once per step.

Order: while waiting, a slot may be written twice (a finished request's block reused by a new
request, a preempted one recomputed); the later write wins, as step by step. Nothing writes
the cache in between: every injection flushes the queue first.
"""

from collections.abc import Callable

import torch

# inject(features [T, F], positions [T], slots [T]): writes the drafter's context K/V.
Inject = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


class ContextQueue:
    """Up to `capacity` tokens' features [T, F] with their positions and cache slots."""

    def __init__(self, capacity: int, feature_size: int, dtype: torch.dtype,
                 device: torch.device, inject: Inject) -> None:
        # Allocated at load time, before vLLM sizes its KV cache: its memory is accounted.
        self.features = torch.empty(capacity, feature_size, dtype=dtype, device=device)
        self.positions = torch.empty(capacity, dtype=torch.int64, device=device)
        self.slots = torch.empty(capacity, dtype=torch.int64, device=device)
        self.num_tokens = 0
        self.inject = inject

    def put(self, feature_chunks: list[torch.Tensor], positions: torch.Tensor,
            slots: torch.Tensor) -> None:
        """Queues T tokens: their features as chunks [T, F_i] along the feature dim (the
        target layers' hidden states, concatenated here), positions [T], slots [T]. Flushes
        first when they do not fit; a step larger than the whole queue is injected at once."""
        capacity, num_tokens = self.features.shape[0], positions.shape[0]
        if self.num_tokens + num_tokens > capacity:
            self.flush()
        if num_tokens > capacity:
            self.inject(torch.cat(feature_chunks, dim=-1), positions, slots)
            return
        start, end = self.num_tokens, self.num_tokens + num_tokens
        torch.cat(feature_chunks, dim=-1, out=self.features[start:end])
        self.positions[start:end] = positions
        self.slots[start:end] = slots
        self.num_tokens = end

    def flush(self) -> None:
        """Injects the queued tokens, the last write of each slot only."""
        if not self.num_tokens:
            return
        keep = last_write_per_slot(self.slots[:self.num_tokens])
        self.num_tokens = 0
        self.inject(self.features[keep], self.positions[keep], self.slots[keep])


def last_write_per_slot(slots: torch.Tensor) -> torch.Tensor:
    """Indices of the last occurrence of each slot value in `slots`, sorted by slot."""
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    is_last = torch.ones_like(ordered, dtype=torch.bool)
    is_last[:-1] = ordered[1:] != ordered[:-1]
    return order[is_last]
