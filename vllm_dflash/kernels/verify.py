"""Batched, ragged, lossless verification of draft tokens.

Layout (as in vLLM): the drafts of all B requests are flattened into T rows; request b owns rows
``cu_num_draft_tokens[b-1] .. cu_num_draft_tokens[b]-1`` (a request may own none). Row t has the
draft token d_t, the target distribution p_t (and the draft distribution q_t when drafts are
sampled). The result is ``[B, max_spec_len + 1]`` int32: the accepted drafts, then ONE more token
(the correction at the first rejected row, or the bonus when every draft is accepted), then -1.

Rules per request, walking its rows in order until the first rejection:

    greedy:                      accept  <=>  d == argmax p
                                 correction = argmax p
    sampled, one-hot drafts:     accept with probability p(d)
                                 correction ~ p with d removed, renormalised
    sampled, draft probs q:      accept with probability min(1, p(d) / q(d))
                                 correction ~ max(p - q, 0), renormalised
    (an all-zero residual falls back to p; a negative draft id, vLLM's padding, is rejected
    and its correction follows p: no draft was drawn there)
    block (Sun et al. 2024, rejection_sample_method="block"; sampled requests, draft probs q):
    the drafts are judged together, so a draft the rule above rejects can still be kept when
    the ones after it make up for it. With w_0 = 1 and, for i = 1..K,
        w_i = min(w_{i-1} * p_{i-1}(d_i) / q_{i-1}(d_i), 1)
        h_i = r_i / (r_i + 1 - w_i),  r_i = sum_x max(w_i p_i(x) - q_i(x), 0)   (i < K)
        h_K = w_K                     (also at the last draft before a padding id)
    the request keeps tau drafts, tau = the largest i with uniform_i < h_i (0 if none), then
    the bonus (tau = K) or a correction ~ max(w_tau p_tau - q_tau, 0), renormalised. The output
    follows the target's distribution, and its expected length is at least the token rule's.
    One-hot drafts keep the token rule: it already keeps each draft prefix with its target
    probability, the most any lossless rule can, so the block rule would change no
    distribution, and it would need the drafts to be the drafter's deterministic choice.
    synthetic (vLLM's benchmark mode, rejection_sample_method="synthetic"; not lossless):
                                 accept with probability rate[position], whatever d is
                                 correction as above (argmax p for greedy requests)

All randomness is drawn up front by ``draw_randoms`` and consumed identically by the torch
reference and the Triton kernel, so the two give the same tokens bit for bit:

    uniform[t] ~ U[0, 1), float64:   accept  <=>  uniform[t] * q(d) < p(d)      (q(d) = 1 one-hot)
        P(u * q < p) = min(1, p / q).  Block verification: position t counts <=> uniform[t] < h.
    inv_exp[b, v] = 1 / E,  E ~ Exp(1):   correction = argmax_v residual[v] * inv_exp[b, v]
        The exponential race: argmax_v r_v / E_v picks v with probability r_v / sum(r), so the
        residual needs no normalisation. One noise row per request suffices because only a
        request's first rejected row draws a correction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from vllm_dflash.kernels.argmax import argmax_rows
from vllm_dflash.layers import exponential_


class Randoms(NamedTuple):
    uniform: torch.Tensor  # [T] float64, one per draft row
    inv_exp: torch.Tensor  # [B, V] 1 / Exp(1) noise, one row per request


def draw_randoms(
    num_draft_tokens: list[int],
    vocab_size: int,
    generators: dict[int, torch.Generator],
    device: torch.device,
    fp64_noise: bool = False,
) -> Randoms:
    """Per-row uniforms and per-request inverse exponential noise.

    Requests listed in ``generators`` draw from their own generator (reproducible per-request
    seeds); a seeded request without drafts leaves its generator untouched. All others share the
    default RNG.
    """
    noise_dtype = torch.float64 if fp64_noise else torch.float32
    uniform = torch.rand(sum(num_draft_tokens), dtype=torch.float64, device=device)
    exp = exponential_(torch.empty(len(num_draft_tokens), vocab_size, dtype=noise_dtype,
                                   device=device))
    starts = [0]
    for n in num_draft_tokens:
        starts.append(starts[-1] + n)
    for b, generator in generators.items():
        if num_draft_tokens[b] > 0:
            uniform[starts[b] : starts[b + 1]].uniform_(generator=generator)
            exponential_(exp[b], generator)
    # E == 0 would turn a zero residual into 0 * inf = nan; a tiny floor keeps the scores finite.
    inv_exp = exp.clamp_min_(torch.finfo(noise_dtype).tiny).reciprocal_()
    return Randoms(uniform, inv_exp)


# --------------------------------------------------------------------------- torch reference


def rejection_walk_reference(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    target_argmax: torch.Tensor,
    randoms: Randoms | None,
    synthetic_rates: torch.Tensor | None = None,
    block: bool = False,
) -> torch.Tensor:
    """Accept/reject walk in vectorised torch, given pre-drawn randoms.

    ``randoms=None`` means every request is greedy: probabilities are then never read (logits
    may be passed as ``target_probs``), only ``target_argmax``. ``synthetic_rates``
    [max_spec_len] (with randoms) accepts row t with probability synthetic_rates[position].
    ``block`` verifies the sampled requests' drafts as a block when draft_probs are given
    (module docstring).
    """
    batch_size = cu_num_draft_tokens.shape[0]
    num_tokens = draft_token_ids.shape[0]
    device = draft_token_ids.device
    ends = cu_num_draft_tokens.long()
    num_drafts = torch.diff(ends, prepend=ends.new_zeros(1))
    starts = ends - num_drafts
    req = torch.repeat_interleave(torch.arange(batch_size, device=device), num_drafts,
                                  output_size=num_tokens)  # request of each row
    pos = torch.arange(num_tokens, device=device) - starts[req]  # position inside its request
    drafts = draft_token_ids.long()

    # Per-row accept decision.
    accept = drafts == target_argmax
    if synthetic_rates is not None:
        accept = (randoms.uniform < synthetic_rates[pos]) & (drafts >= 0)
    elif randoms is not None:
        safe = drafts.clamp_min(0)[:, None]
        p_d = target_probs.gather(1, safe)[:, 0].double()
        q_d = 1.0 if draft_probs is None else draft_probs.gather(1, safe)[:, 0].double()
        sampled_accept = (randoms.uniform * q_d < p_d) & (drafts >= 0)
        accept = torch.where(is_greedy[req], accept, sampled_accept)

    # Longest accepted prefix of every request.
    accepted = torch.zeros(batch_size, max_spec_len, dtype=torch.long, device=device)
    accepted[req, pos] = accept.long()
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    weight = torch.ones(batch_size, dtype=torch.float32, device=device)  # w_tau, block only
    if block and draft_probs is not None and randoms is not None and synthetic_rates is None:
        block_accepted, block_weight = _block_lengths_reference(
            drafts, req, pos, num_drafts, max_spec_len, draft_probs, target_probs, randoms.uniform)
        num_accepted = torch.where(is_greedy, num_accepted, block_accepted)
        weight = torch.where(is_greedy, weight, block_weight.float())

    out = torch.full((batch_size, max_spec_len + 1), -1, dtype=torch.int32, device=device)
    out[req, pos] = torch.where(pos < num_accepted[req], drafts, -1).int()

    # One more token: the bonus, or the correction at the first rejected row.
    next_token = bonus_token_ids.long().clone()
    rejected = (num_accepted < num_drafts).nonzero()[:, 0]
    rows = starts[rejected] + num_accepted[rejected]
    correction = target_argmax[rows].long()
    if randoms is not None:
        recovered = _recover_reference(
            target_probs[rows],
            None if draft_probs is None else draft_probs[rows],
            drafts[rows],
            randoms.inv_exp[rejected],
            weight[rejected],
        )
        correction = torch.where(is_greedy[rejected], correction, recovered)
    next_token[rejected] = correction
    out.scatter_(1, num_accepted[:, None], next_token[:, None].int())
    return out


def greedy_walk_torch(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
) -> torch.Tensor:
    """The walk of an all-greedy batch in a few batched torch ops: the CPU fallback.

    Accepted drafts equal the target's argmax, so a request's output is its argmax row up to
    and including the first mismatch (the correction), then the bonus if every draft matched.
    num_draft_tokens is on the host (vLLM has it there), so the padding costs no device sync.
    """
    batch_size, device = len(num_draft_tokens), target_argmax.device
    counts = torch.tensor(num_draft_tokens, device=device)
    if len(set(num_draft_tokens)) == 1:  # uniform lengths: a view, no padding
        argmax = target_argmax.view(batch_size, max_spec_len)
        drafts = draft_token_ids.view(batch_size, max_spec_len)
    else:
        rows = torch.arange(batch_size, device=device).repeat_interleave(counts)
        cols = torch.arange(len(rows), device=device) - (counts.cumsum(0) - counts)[rows]
        argmax = target_argmax.new_full((batch_size, max_spec_len), -1)
        drafts = draft_token_ids.new_full((batch_size, max_spec_len), -2)  # never matches
        argmax[rows, cols] = target_argmax
        drafts[rows, cols] = draft_token_ids
    num_accepted = (drafts == argmax).cumprod(dim=1).sum(dim=1, keepdim=True)
    out = torch.cat([argmax, argmax.new_full((batch_size, 1), -1)], dim=1)
    out.scatter_(1, counts[:, None], bonus_token_ids.view(-1, 1).to(out.dtype))
    columns = torch.arange(max_spec_len + 1, device=device)
    return out.masked_fill_(columns > num_accepted, -1).int()


def _block_lengths_reference(
    drafts: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    num_drafts: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification: per request, tau (drafts kept) and w_tau, in float64."""
    batch_size, num_tokens = num_drafts.shape[0], drafts.shape[0]
    valid = drafts >= 0
    safe = drafts.clamp_min(0)[:, None]
    p_d = target_probs.gather(1, safe)[:, 0].double()
    # A floor keeps p / q finite for a draft that q gave no mass.
    q_d = draft_probs.gather(1, safe)[:, 0].double().clamp_min(torch.finfo(torch.float64).tiny)
    ratio = torch.zeros(batch_size, max_spec_len, dtype=torch.float64, device=drafts.device)
    ratio[req, pos] = torch.where(valid, p_d / q_d, 0.0)
    weights = [torch.ones(batch_size, dtype=torch.float64, device=drafts.device)]  # w_0..w_K
    for i in range(max_spec_len):
        weights.append(torch.clamp_max(weights[-1] * ratio[:, i], 1.0))
    weights = torch.stack(weights, dim=1)
    w = weights[req, pos + 1]  # w_i after row t's draft (i = pos + 1)

    # r_i reads the next row (the same request's next draft) against row t's w_i: the mass of
    # row t + 1 with the weight of the row before it, shifted back by one row. In fp32 with one
    # [T, V] temporary (fp64 sums cost 4x as much on CPU); h_i = w_i at the block's end.
    nxt = torch.arange(1, num_tokens + 1, device=drafts.device).clamp_max(num_tokens - 1)
    has_next = (pos + 1 < num_drafts[req]) & valid[nxt]
    w_before = torch.cat([w.new_zeros(1), w[:-1]]).float()
    mass = torch.mul(target_probs, w_before[:, None]).sub_(draft_probs).clamp_min_(0.0)
    mass = mass.sum(dim=1)[nxt].double()
    denom = mass + 1.0 - w
    h = torch.where(has_next, torch.where(denom > 0, mass / denom, 1.0), w)
    counted = torch.where(uniform < h, pos + 1, 0)
    tau = torch.zeros(batch_size, dtype=torch.long, device=drafts.device)
    tau.scatter_reduce_(0, req, counted, reduce="amax")
    return tau, weights.gather(1, tau[:, None])[:, 0]


def _recover_reference(
    p: torch.Tensor,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    inv_exp: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """Correction tokens of rejected rows: argmax(residual / E), argmax(p / E) if residual = 0.

    residual = max(weight * p - q, 0) (weight = w_tau of block verification, else 1); one-hot
    drafts zero the draft's entry of p instead, where the weight cancels. A padding draft was
    not drawn from q, so its row's residual is p."""
    if q is None:
        vocab = torch.arange(p.shape[1], device=p.device)
        residual = torch.where(vocab == drafts[:, None], 0.0, p)
    else:
        q = torch.where(drafts[:, None] >= 0, q, 0.0)
        residual = torch.clamp_min(p * weight[:, None] - q, 0.0)
    from_residual = (residual.to(inv_exp.dtype) * inv_exp).argmax(dim=1)
    from_target = (p.to(inv_exp.dtype) * inv_exp).argmax(dim=1)
    return torch.where(residual.amax(dim=1) > 0, from_residual, from_target)


# --------------------------------------------------------------------------- Triton kernel


@triton.jit
def _running_argmax(score, offset, best, best_id):
    """Fold one block of scores into (best, best_id); the first maximum wins, as in torch."""
    block_best, block_id = tl.max(score, axis=0, return_indices=True)
    take = block_best > best
    return tl.where(take, block_best, best), tl.where(take, offset + block_id, best_id)


@triton.jit
def _recover_token(
    target_probs_ptr,
    draft_probs_ptr,
    inv_exp_ptr,
    row,
    req,
    draft,
    weight,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Correction token of one rejected row; same math as _recover_reference."""
    target_row = target_probs_ptr + row.to(tl.int64) * vocab_size
    noise_row = inv_exp_ptr + req.to(tl.int64) * vocab_size
    noise_dtype = inv_exp_ptr.dtype.element_ty
    residual_max = tl.zeros([], dtype=tl.float32)
    best_residual = tl.full([], -1.0, noise_dtype)
    best_residual_id = tl.zeros([], dtype=tl.int32)
    best_target = tl.full([], -1.0, noise_dtype)
    best_target_id = tl.zeros([], dtype=tl.int32)
    for offset in range(0, vocab_size, BLOCK_V):
        vocab = offset + tl.arange(0, BLOCK_V)
        in_vocab = vocab < vocab_size
        p = tl.load(target_row + vocab, mask=in_vocab, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + row.to(tl.int64) * vocab_size + vocab,
                        mask=in_vocab, other=0.0)
            q = tl.where(draft >= 0, q, 0.0)
            residual = tl.maximum(p * weight - q, 0.0)
        else:
            residual = tl.where(vocab == draft, 0.0, p)
        inv_exp = tl.load(noise_row + vocab, mask=in_vocab, other=0.0)
        residual_max = tl.maximum(residual_max, tl.max(residual, axis=0))
        best_residual, best_residual_id = _running_argmax(
            tl.where(in_vocab, residual.to(noise_dtype) * inv_exp, -1.0),
            offset, best_residual, best_residual_id)
        best_target, best_target_id = _running_argmax(
            tl.where(in_vocab, p.to(noise_dtype) * inv_exp, -1.0),
            offset, best_target, best_target_id)
    return tl.where(residual_max > 0, best_residual_id, best_target_id)


@triton.jit
def _residual_mass(target_probs_ptr, draft_probs_ptr, row, weight, vocab_size,
                   BLOCK_V: tl.constexpr):
    """sum_x max(weight * p(x) - q(x), 0) over one row, in fp32 as the reference (weight
    rounded to it)."""
    total = tl.zeros([], dtype=tl.float32)
    weight = weight.to(tl.float32)
    for offset in range(0, vocab_size, BLOCK_V):
        vocab = offset + tl.arange(0, BLOCK_V)
        in_vocab = vocab < vocab_size
        p = tl.load(target_probs_ptr + row.to(tl.int64) * vocab_size + vocab, mask=in_vocab,
                    other=0.0)
        q = tl.load(draft_probs_ptr + row.to(tl.int64) * vocab_size + vocab, mask=in_vocab,
                    other=0.0)
        total += tl.sum(tl.maximum(p * weight - q, 0.0), axis=0)
    return total.to(tl.float64)


@triton.jit
def _block_length(
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    uniform_ptr,
    start,
    num_drafts,
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    """Block verification of one request: (tau, w_tau); same math as _block_lengths_reference."""
    weight = tl.full([], 1.0, tl.float64)
    tau = tl.zeros([], dtype=tl.int32)
    tau_weight = tl.full([], 1.0, tl.float64)
    i = tl.zeros([], dtype=tl.int32)
    while i < num_drafts:
        row = start + i
        draft = tl.load(draft_token_ids_ptr + row)
        safe = tl.maximum(draft, 0)
        p_d = tl.load(target_probs_ptr + row.to(tl.int64) * vocab_size + safe).to(tl.float64)
        q_d = tl.load(draft_probs_ptr + row.to(tl.int64) * vocab_size + safe).to(tl.float64)
        q_d = tl.maximum(q_d, 2.2250738585072014e-308)  # float64's tiny, as the reference
        weight = tl.minimum(weight * tl.where(draft >= 0, p_d / q_d, 0.0), 1.0)
        h = weight
        next_draft = tl.load(draft_token_ids_ptr + row + 1, mask=i + 1 < num_drafts, other=-1)
        if next_draft >= 0:
            mass = _residual_mass(target_probs_ptr, draft_probs_ptr, row + 1, weight,
                                  vocab_size, BLOCK_V)
            denom = mass + 1.0 - weight
            h = tl.where(denom > 0, mass / denom, 1.0)
        counted = tl.load(uniform_ptr + row) < h
        tau = tl.where(counted, i + 1, tau)
        tau_weight = tl.where(counted, weight, tau_weight)
        i += 1
    return tau, tau_weight


@triton.jit
def _verify_kernel(
    out_ptr,  # [B, max_spec_len + 1] int32
    cu_num_draft_tokens_ptr,  # [B]
    draft_token_ids_ptr,  # [T]
    draft_probs_ptr,  # [T, V] or None
    target_probs_ptr,  # [T, V] (unread when ALL_GREEDY)
    target_argmax_ptr,  # [T]
    bonus_token_ids_ptr,  # [B]
    is_greedy_ptr,  # [B] bool
    uniform_ptr,  # [T] float64, or None when ALL_GREEDY
    inv_exp_ptr,  # [B, V], or None when ALL_GREEDY
    synthetic_rates_ptr,  # [max_spec_len] or None
    vocab_size,
    max_spec_len,
    HAS_DRAFT_PROBS: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    SYNTHETIC: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per request: walk its drafts, then write the correction or the bonus."""
    req = tl.program_id(0)
    end = tl.load(cu_num_draft_tokens_ptr + req)
    start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0)
    num_drafts = end - start
    greedy = tl.load(is_greedy_ptr + req)
    out_row = out_ptr + req * (max_spec_len + 1)

    num_accepted = tl.zeros([], dtype=tl.int32)
    weight = tl.full([], 1.0, tl.float32)  # w_tau of block verification
    walking = num_drafts > 0
    if BLOCK:
        walking = walking & greedy  # greedy requests keep the token rule
        if not greedy:
            num_accepted, tau_weight = _block_length(
                draft_token_ids_ptr, draft_probs_ptr, target_probs_ptr, uniform_ptr, start,
                num_drafts, vocab_size, BLOCK_V)
            weight = tau_weight.to(tl.float32)
            i = 0
            while i < num_accepted:
                tl.store(out_row + i, tl.load(draft_token_ids_ptr + start + i).to(tl.int32))
                i += 1
    while walking:
        row = start + num_accepted
        draft = tl.load(draft_token_ids_ptr + row)
        accept = draft == tl.load(target_argmax_ptr + row)
        if SYNTHETIC:
            rate = tl.load(synthetic_rates_ptr + num_accepted).to(tl.float64)
            accept = (tl.load(uniform_ptr + row) < rate) & (draft >= 0)
        elif not ALL_GREEDY:
            safe = tl.maximum(draft, 0)
            p_d = tl.load(target_probs_ptr + row.to(tl.int64) * vocab_size + safe)
            q_d = 1.0
            if HAS_DRAFT_PROBS:
                q_d = tl.load(draft_probs_ptr + row.to(tl.int64) * vocab_size + safe)
                q_d = q_d.to(tl.float64)
            u = tl.load(uniform_ptr + row)
            sampled_accept = (u * q_d < p_d.to(tl.float64)) & (draft >= 0)
            accept = tl.where(greedy, accept, sampled_accept)
        tl.store(out_row + num_accepted, draft.to(tl.int32), mask=accept)
        num_accepted += accept.to(tl.int32)
        walking = accept & (num_accepted < num_drafts)

    next_token = tl.load(bonus_token_ids_ptr + req).to(tl.int32)
    if num_accepted < num_drafts:
        row = start + num_accepted
        next_token = tl.load(target_argmax_ptr + row).to(tl.int32)
        if not ALL_GREEDY and not greedy:
            next_token = _recover_token(
                target_probs_ptr, draft_probs_ptr, inv_exp_ptr, row, req,
                tl.load(draft_token_ids_ptr + row), weight, vocab_size, HAS_DRAFT_PROBS,
                BLOCK_V)
    tl.store(out_row + num_accepted, next_token)


def rejection_walk_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    target_argmax: torch.Tensor,
    randoms: Randoms | None,
    synthetic_rates: torch.Tensor | None = None,
    block: bool = False,
) -> torch.Tensor:
    """Same as rejection_walk_reference, as one Triton program per request."""
    batch_size = cu_num_draft_tokens.shape[0]
    vocab_size = target_probs.shape[1]
    out = torch.full((batch_size, max_spec_len + 1), -1, dtype=torch.int32,
                     device=target_probs.device)
    _verify_kernel[(batch_size,)](
        out,
        cu_num_draft_tokens,
        draft_token_ids.contiguous(),
        None if draft_probs is None else draft_probs.contiguous(),
        target_probs.contiguous(),
        target_argmax.contiguous(),
        bonus_token_ids.contiguous(),
        is_greedy.contiguous(),
        None if randoms is None else randoms.uniform,
        None if randoms is None else randoms.inv_exp,
        synthetic_rates,
        vocab_size,
        max_spec_len,
        HAS_DRAFT_PROBS=draft_probs is not None,
        ALL_GREEDY=randoms is None,
        SYNTHETIC=synthetic_rates is not None,
        BLOCK=block and draft_probs is not None and randoms is not None
        and synthetic_rates is None,
        BLOCK_V=min(triton.next_power_of_2(vocab_size), 1024),
    )
    return out


# --------------------------------------------------------------------------- public entry points

Walk = Callable[..., torch.Tensor]


def _walk_for(device: torch.device) -> Walk:
    """Triton on CUDA; the torch reference is the fallback everywhere else (CPU, ...)."""
    return rejection_walk_triton if device.type == "cuda" else rejection_walk_reference


def _verify(
    walk: Walk,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: dict[int, torch.Generator],
    target_argmax: torch.Tensor | None,
    block: bool,
) -> torch.Tensor:
    if target_argmax is None:
        target_argmax = argmax_rows(target_probs)
    ends = cu_num_draft_tokens.long()
    # Host copy of the draft counts (a device sync on CUDA; the vLLM adapter has them already).
    num_draft_tokens = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    randoms = draw_randoms(num_draft_tokens, target_probs.shape[1], generators,
                           target_probs.device)
    return walk(draft_token_ids, cu_num_draft_tokens, max_spec_len, draft_probs, target_probs,
                bonus_token_ids, is_greedy, target_argmax, randoms, block=block)


def verify_reference(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: dict[int, torch.Generator],
    target_argmax: torch.Tensor | None = None,
    block: bool = False,
) -> torch.Tensor:
    """Verify drafts with the torch reference. Returns [B, max_spec_len + 1] int32, -1 padded.

    draft_token_ids [T]; cu_num_draft_tokens [B] int32, inclusive cumsum of per-request draft
    counts; draft_probs [T, V] fp32 or None (one-hot drafts); target_probs [T, V] fp32, processed
    (temperature/top-k/top-p); bonus_token_ids [B]; is_greedy [B] bool; generators: request
    index -> torch.Generator (others use the default RNG); target_argmax [T] (default: argmax of
    target_probs); block: verify the sampled requests' drafts as a block (module docstring).
    """
    return _verify(rejection_walk_reference, draft_token_ids, cu_num_draft_tokens, max_spec_len,
                   draft_probs, target_probs, bonus_token_ids, is_greedy, generators,
                   target_argmax, block)


def verify_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: dict[int, torch.Generator],
    target_argmax: torch.Tensor | None = None,
    block: bool = False,
) -> torch.Tensor:
    """verify_reference with the Triton kernel; same random numbers, so the same tokens."""
    return _verify(rejection_walk_triton, draft_token_ids, cu_num_draft_tokens, max_spec_len,
                   draft_probs, target_probs, bonus_token_ids, is_greedy, generators,
                   target_argmax, block)


def verify(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: dict[int, torch.Generator],
    target_argmax: torch.Tensor | None = None,
    block: bool = False,
) -> torch.Tensor:
    """verify_triton on CUDA, the torch reference (verify_reference) as fallback elsewhere."""
    return _verify(_walk_for(target_probs.device), draft_token_ids, cu_num_draft_tokens,
                   max_spec_len, draft_probs, target_probs, bonus_token_ids, is_greedy,
                   generators, target_argmax, block)


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Per-row sampling distribution [T, V] fp32: softmax(logits / temperature) restricted to
    the top_k largest entries (0 = off), then to the smallest set of largest entries whose mass
    reaches top_p (1 = off), renormalised. Temperature 0 (greedy rows) divides by 1: greedy rows
    only use the argmax, which none of these steps changes."""
    vocab_size = logits.shape[-1]
    temperature = torch.where(temperature > 0, temperature, 1.0).float()
    scaled = logits.float() / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab_size)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside_top_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(outside_top_p, float("-inf"))
    kept_logits = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    return kept_logits.softmax(dim=-1)


def vllm_rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata: Any,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
    block_verification: bool = False,
) -> torch.Tensor:
    """Drop-in for ``vllm.v1.sample.rejection_sampler.rejection_sample``.

    target_logits [T, V] already carry vLLM's temperature/top-k/top-p processing; greedy requests
    have temperature 0. sampling_metadata is duck-typed: .all_greedy, .temperature ([B], None
    when all greedy), .generators. bonus_token_ids is [B, 1]. All-greedy batches take a cheap
    path: argmax only, no softmax, no random numbers. synthetic_mode (vLLM's benchmark mode)
    accepts the draft at position i with probability synthetic_conditional_rates[i].
    block_verification (rejection_sample_method="block") verifies each sampled request's drafts
    as a block; greedy requests are unchanged by it.
    """
    bonus = bonus_token_ids.view(-1)
    if not any(num_draft_tokens):
        # A step without drafts runs plain (vllm/runner.py) unless it keeps vLLM's speculative
        # path (hybrid targets): then each request takes its bonus token, with no softmax or
        # noise over the vocabulary.
        out = bonus.new_full((len(num_draft_tokens), max_spec_len + 1), -1, dtype=torch.int32)
        out[:, 0] = bonus
        return out
    walk = _walk_for(target_logits.device)
    target_argmax = argmax_rows(target_logits)
    all_greedy = sampling_metadata.all_greedy
    if all_greedy and not synthetic_mode:
        if walk is rejection_walk_reference:  # the torch fallback has a cheaper greedy walk
            return greedy_walk_torch(draft_token_ids, num_draft_tokens, max_spec_len,
                                     target_argmax, bonus)
        is_greedy = torch.ones(len(num_draft_tokens), dtype=torch.bool,
                               device=target_logits.device)
        return walk(draft_token_ids, cu_num_draft_tokens, max_spec_len, None, target_logits,
                    bonus, is_greedy, target_argmax, None)
    if all_greedy:  # synthetic: greedy corrections read only the argmax
        is_greedy = torch.ones(len(num_draft_tokens), dtype=torch.bool,
                               device=target_logits.device)
        target_probs = target_logits
    else:
        is_greedy = sampling_metadata.temperature == 0
        target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    randoms = draw_randoms(num_draft_tokens, target_logits.shape[1],
                           sampling_metadata.generators, target_logits.device,
                           fp64_noise=use_fp64_gumbel)
    return walk(draft_token_ids, cu_num_draft_tokens, max_spec_len, draft_probs, target_probs,
                bonus, is_greedy, target_argmax, randoms,
                synthetic_conditional_rates if synthetic_mode else None, block=block_verification)
