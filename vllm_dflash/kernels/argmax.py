"""Greedy tokens: the index of each row's first maximum over the vocabulary.

torch's CPU argmax (and max(dim).indices) does not vectorise a reduction over the last dim of
[rows, vocab] logits; numpy's does, ~20x faster (28 rows of a 151,936-token vocabulary: 0.65 ms
against 11.8 ms on one core). Drafting and verification each take an argmax of every draft
position per step, so on CPU this is a large share of a step. Both return the first maximum
(a NaN counts as the maximum), so the tokens are equal; `torch.argmax` is the reference.
"""

import torch


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] int64 index of each row's first maximum."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # numpy has no bf16, and its fp16 argmax is not vectorised
    return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
