"""Deferred KV injection. While no request drafts, the target's features of each step wait in
a fixed buffer and are injected in one batch before the drafter next reads its context cache,
or once the buffer is full. On a small target a step's injection is mostly fixed cost (its
kernels' launches and GEMM set-up), paid once per batch instead of once per step. A batch is
padded to a power of two tokens (padding rows have slot -1 and write nothing): a few shapes,
each warmed up once, since on the CPU build the first GEMM of each new token count costs 1-5 ms.

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
        # Zeros: padding rows run through the injection's GEMM and RoPE before being skipped.
        self.features = torch.zeros(capacity, feature_size, dtype=dtype, device=device)
        self.positions = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.slots = torch.full((capacity,), -1, dtype=torch.int64, device=device)
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
        n = self.num_tokens
        if not n:
            return
        size = self._padded(n)
        slots = self.slots[:size]
        slots[n:] = -1
        slots[:n].masked_fill_(superseded_writes(slots[:n]), -1)  # no host sync on CUDA
        self.num_tokens = 0
        self.inject(self.features[:size], self.positions[:size], slots)

    def _padded(self, num_tokens: int) -> int:
        """The token count a flush of num_tokens injects: the next power of two, at most the
        capacity."""
        return min(1 << (num_tokens - 1).bit_length(), self.features.shape[0])

    def batch_sizes(self) -> list[int]:
        """Every token count a flush injects."""
        return sorted({self._padded(n) for n in range(1, self.features.shape[0] + 1)})

    def warm_up(self) -> None:
        """Injects padding at every flush size: the GEMMs' one-time costs, paid at start-up."""
        for size in self.batch_sizes():
            self.inject(self.features[:size], self.positions[:size],
                        torch.full_like(self.slots[:size], -1))


def superseded_writes(slots: torch.Tensor) -> torch.Tensor:
    """[T] bool: the writes to a slot that a later write in `slots` overwrites."""
    order = torch.argsort(slots, stable=True)  # equal slots stay in write order
    ordered = slots[order]
    superseded = torch.zeros_like(slots, dtype=torch.bool)
    superseded[order[:-1]] = ordered[:-1] == ordered[1:]
    return superseded
