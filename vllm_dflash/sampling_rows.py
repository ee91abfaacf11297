"""Per-request sampling parameters applied to the verified draft rows of a step, in torch.

Rows are grouped by request: `cu_num_draft_tokens` (or `num_draft_tokens`) says how many of the
[T, V] rows each request owns. vLLM applies these to its plain sampler's rows; with DFlash
they apply to the draft rows as well (vllm/sampler.py).
"""

import numpy as np
import torch


def add_logit_bias(logits: torch.Tensor, biases: dict[int, dict[int, float]],
                   num_draft_tokens: list[int]) -> None:
    """Adds each request's {token: bias} to its draft rows of logits [T, V] (rows grouped by
    request, num_draft_tokens[i] rows for request i), in place."""
    starts = np.cumsum([0, *num_draft_tokens])
    rows, tokens, values = [], [], []
    for request, bias in biases.items():
        request_rows = range(starts[request], starts[request + 1])
        for token, value in bias.items():
            rows += request_rows
            tokens += [token] * len(request_rows)
            values += [value] * len(request_rows)
    index = torch.tensor([rows, tokens], dtype=torch.long).to(logits.device, non_blocking=True)
    logits[index[0], index[1]] += torch.tensor(values, dtype=logits.dtype).to(logits.device)


def mask_below_min_p(logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                     temperature: torch.Tensor, min_p: torch.Tensor) -> None:
    """Sets to -inf, in place, the tokens of each sampled draft row [T, V] whose probability at
    the request's temperature is below min_p x the row's highest, as vLLM's MinP does (the same
    float operations, so the same tokens). Greedy rows (temperature 0) are left alone."""
    rows = logits.shape[0]
    temperature = expand_batch_to_tokens(temperature, cu_num_draft_tokens, rows)
    min_p = expand_batch_to_tokens(min_p, cu_num_draft_tokens, rows)
    min_p = torch.where(temperature > 0, min_p, 0.0)
    probs = torch.softmax(logits / torch.where(temperature > 0, temperature, 1.0)[:, None], -1)
    threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p[:, None])
    logits.masked_fill_(probs < threshold, float("-inf"))


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """vLLM's `expand_batch_to_tokens` in torch: x [B] -> [num_tokens], one row per draft token
    of each request; values equal to replace_from become replace_to."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    out = x.repeat_interleave(counts.long(), output_size=num_tokens)
    if replace_from != replace_to:
        out = out.masked_fill(out == replace_from, replace_to)
    return out
