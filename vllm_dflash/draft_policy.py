"""Adaptive draft length: how many draft tokens each request verifies, chosen every step.

A step that verifies k_r draft tokens for each of n decoding requests runs T = n + sum(k_r)
query tokens through the target and emits n + sum(E_r(k_r)) tokens in expectation, where

    E_r(k) = sum_{j=1..k} prod_{i=1..j} a_{r,i}

and a_{r,i} is the probability that request r's draft position i is accepted given that
positions 1..i-1 were (DFlash's per-position acceptance, measured online). The step costs

    time(T, n) = target(T) + [drafter runs] * (drafter(n) + drafter_extra)
                 + overhead + per_request * n + per_draft_token * sum(k_r)

with target(T) and drafter(n) profiled on the running engine at start-up, and what those
forward passes do not include fitted online to the measured step times: the host's work
(scheduling, bookkeeping) per step and per request, the work per verified draft token
(logits, softmax and rejection sampling when requests sample) and per drafter run (drawing
sampled drafts), which depend on the traffic. Every PROBE_INTERVAL steps one step runs without
drafts, so that the fit can tell the cost of drafting from the rest of a step. The policy
maximises tokens per second of the batch, choosing each k_r from a small fixed set
(0, 1, 3, 7, ..., K) so that the shapes the target and drafter see stay few. k_r = 0 is plain
decoding; when every k_r is 0 the drafter is skipped (and the step runs as a plain step).

When no request waits to join the batch, tokens per step is the wrong goal: the batch ends
with its slowest request, and the tokens a fast request's drafts win early shorten nothing
while the steps that verify them cost. Then the policy plans the rest of the batch: for each
finish within N steps, every request drafts the shortest length that covers its remaining
tokens in N steps, and it picks the N whose plan finishes soonest, reading each request's rate
as low as the slowest of n requests may turn out (DraftPolicy._finish_together). How far a
request's first drafts move its own rate depends on how much finished requests differed
(request_prior_weight).

With prompt lookup on, a request's drafts come from lookup or from the drafter, step by step;
a_{r,i} is read from the source its drafts come from (AcceptanceModel), and where the drafter's
pass leaves lookup's requests out (StepProfile.lookup_skips_drafter) drafter(n) counts the
others only.

Pure Python + numpy: no vLLM, no device work, no synchronisation. vLLM's scheduler calls it
(vllm/scheduler.py), where acceptance counts and step times are already on the host.
"""

import math
import time
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

# Where a request's drafts come from (AcceptanceModel): the drafter, or prompt lookup.
DRAFTER, LOOKUP = 0, 1
NUM_SOURCES = 2
# Acceptance before anything is measured: position 1 of a modest drafter, held as a Beta prior
# worth PRIOR_WEIGHT drafts; position i > 1 takes position i-1's estimate as its prior, since
# conditional acceptance changes slowly along a block. A strong drafter proves itself within a
# few steps; a weak one costs little while it does.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0
# Decisions read each position's rate OPTIMISM posterior standard deviations above its mean:
# where a longer draft costs little (a memory-bound step) the optimism buys measurements, where
# it costs much (a compute-bound batch) it cannot outweigh the cost and the mean decides.
OPTIMISM = 0.5
# Per-draft decay of the engine's counts (memory of ~200 drafts) and of a request's own counts
# (memory of ~30 drafts): traffic changes, and requests change character within a response.
GLOBAL_DECAY = 0.995
REQUEST_DECAY = 0.97
# A request's own rate is shrunk towards its class's with a Beta prior of this many
# pseudo-positions, as wide as the rates of the requests that finished before it are spread
# (empirical Bayes, request_prior_weight): where requests differ widely (the tiny pair's
# first-position rates run from 0.05 to 0.97) a request's first drafts tell it apart; where
# they differ little, one rejected block says little about the next. Until
# MIN_FINISHED_REQUESTS of a class have finished, the prior weighs REQUEST_PRIOR_WEIGHT;
# then between MIN_ and MAX_REQUEST_PRIOR_WEIGHT.
REQUEST_PRIOR_WEIGHT = 32.0
MIN_REQUEST_PRIOR_WEIGHT = 2.0
MAX_REQUEST_PRIOR_WEIGHT = 256.0
MIN_FINISHED_REQUESTS = 8
FINISHED_REQUESTS = 64  # the finished requests per class the spread is measured over
# Per-step decay of the step-time statistics (memory of ~200 steps).
COST_DECAY = 0.995
# Drafting switches on or off only when the other choice is predicted this much faster:
# no flapping between settings step to step when the two are close.
SWITCH_MARGIN = 0.03
# While no request drafts the full block, requests in turn draft it every EXPLORE_INTERVAL
# steps, the first time at step EXPLORE_FIRST_STEP: acceptance at every position stays
# measured, so a policy that starts without drafting, stopped or drafts short sees when drafting
# deeper would pay. Costs one drafter run and K extra tokens per exploring request per
# interval, and is skipped where even a drafter accepted at every position would not pay
# (DraftPolicy.could_pay).
EXPLORE_INTERVAL = 16
EXPLORE_FIRST_STEP = 2
# Requests an exploring step gives the full block, in turn: steps that verify different
# numbers of drafts let the cost fit tell a draft token's cost from a drafter run's, which
# steps that always verify one request's block cannot.
EXPLORE_WIDTHS = (1, 2, 4)
# While drafting stays off, each choice that keeps it off doubles that interval, up to this:
# an exploration needs a drafter run for the whole batch, a cost that buys nothing while the
# drafts do not pay. Drafting again (even short) brings the interval back to EXPLORE_INTERVAL.
MAX_EXPLORE_INTERVAL = 128
# While drafting, every PROBE_INTERVAL steps one step verifies no drafts (and the drafter
# skips its pass): without it, steps that always verify K drafts per request cannot tell the
# cost of the drafts from the rest of the step. Costs 2 of PROBE_INTERVAL steps their drafts.
PROBE_INTERVAL = 128
# How much more a step without drafts weighs in the cost fit (StepCostModel.observe).
PLAIN_STEP_WEIGHT = 16.0
# A choice holds for this many steps, for the same requests, or for any batch when it gave
# every request one length: the statistics behind it move by ~1% in that time, while choosing
# costs ~0.1-0.3 ms of host time, a few percent of a small step. Requests joining and leaving
# (every few steps at C=4) would otherwise force a choice nearly every step.
REPLAN_INTERVAL = 4
# A uniform choice that repeats the last one holds twice as long as that one did, up to this
# many steps: a steady batch (every request at K, or all off) is re-chosen rarely.
MAX_HOLD = 32
# ... but not once fewer than this share of the requests it was made for remain: in a burst
# the requests that draft well finish first, and the ones left may be worth no drafts at all.
HOLD_MIN_REMAINING = 0.75
# ... nor once the drafts verified since it accepted a total more than DISPROVE_Z standard
# deviations from what it predicted (over at least DISPROVE_MIN_DRAFTS drafts). Then the traffic
# has changed (sampled requests after greedy ones, code after prose): the acceptance counts,
# a memory of ~200 drafts, describe the old traffic, and are dropped, so that the next choice
# reads the new drafts instead of holding or relearning the old lengths for dozens of steps.
DISPROVE_Z = 4.0
DISPROVE_MIN_DRAFTS = 8
# Finish times a batch with no request waiting is planned for (DraftPolicy._finish_together).
FINISH_CANDIDATES = 16
# Step shapes (query tokens, requests, drafter ran) remembered as run before; past this many,
# every shape counts as run before (their one-time costs are long paid).
MAX_SHAPES_SEEN = 65536
REPORT_INTERVAL_S = 5.0


def draft_levels(max_draft: int) -> list[int]:
    """The draft lengths a request may get: 0, 1, 3, 7, ... below max_draft, and max_draft."""
    levels, k = {0, max_draft}, 1
    while k < max_draft:
        levels.add(k)
        k = 2 * k + 1
    return sorted(levels)


@dataclass
class StepProfile:
    """Start-up measurements (seconds): the target at several query-token counts, the drafter
    at several batch sizes. Increasing x; linearly interpolated and extrapolated."""

    tokens: list[int]
    target_s: list[float]
    batch_sizes: list[int]
    drafter_s: list[float]
    # The drafter's pass leaves out the requests prompt lookup drafts for (DraftRunner on the
    # CPU): a step pays for the others' rows only.
    lookup_skips_drafter: bool = False


def _interp(x: np.ndarray, xs: list[int], ys: list[float]) -> np.ndarray:
    """Piecewise-linear through (xs, ys), continued with the last segment's slope."""
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    return np.interp(x, xs, ys) + slope * np.maximum(np.subtract(x, xs[-1]), 0)


class StepCostModel:
    """time = profiled(T, m) + overhead + per_request * n + per_draft_token * d
              + drafter_extra * g,
    for a step of T query tokens, n requests and d verified draft tokens, whose end ran the
    drafter for m requests (g = 1 when m > 0, then profiled adds drafter(m)).

    The profile is trusted for how a step's cost grows with its query tokens: that is what
    the start-up runs measure well. What they leave out is fitted by exponentially weighted
    least squares of (measured - profiled) on 1, n, d and g, every term kept non-negative,
    with a ridge on each. The per-draft-token and drafter terms are what a drafting step
    adds (rejection sampling, sampled drafts and their distributions, the host's work for the
    drafts): large when requests sample, small for greedy ones, so they are measured, not
    profiled. The overhead is what plain steps pay too; only plain steps (or steps that
    vary in n) can show it, so until they do, its ridge sends what a run that always drafts
    pays beyond the profile to the drafting terms: the reading that keeps a drafter that
    does not pay from looking as if it did.
    """

    # Ridge per slope, relative to the feature's mean: strong on n (batch sizes hardly vary
    # in a steady run), light on d and g, which the probes carry.
    RIDGE = np.array([0.1, 0.01, 0.01])
    # Ridge on the overhead: the share of the fit's weight that plain steps must carry to pin
    # it. Above the drafting terms' ridge (1e-4 for a residual they fully explain), well
    # below the ~10% of the weight that the probes carry in a steady run.
    OVERHEAD_RIDGE = 0.01

    def __init__(self, profile: StepProfile) -> None:
        self.profile = profile
        # Weighted sums of the pairwise products of 1, n, d, g and r (r: the residual); the
        # [0, 0] entry is the total weight.
        self.products = np.zeros((5, 5))
        self.overhead = 0.0
        self.slopes = np.zeros(3)  # per request, per draft token, drafter_extra

    @property
    def weight(self) -> float:
        """The fit's total weight: steps observed, decayed, plain steps counted heavier."""
        return float(self.products[0, 0])

    @property
    def per_request(self) -> float:
        return float(self.slopes[0])

    @property
    def per_draft_token(self) -> float:
        return float(self.slopes[1])

    @property
    def drafter_extra(self) -> float:
        return float(self.slopes[2])

    def profiled(self, tokens: np.ndarray, drafter_rows: np.ndarray) -> np.ndarray:
        """The target's pass over `tokens` query tokens, and the drafter's over drafter_rows
        requests (0: it did not run)."""
        p = self.profile
        target = _interp(tokens, p.tokens, p.target_s)
        drafter = _interp(np.asarray(drafter_rows), p.batch_sizes, p.drafter_s)
        return target + np.where(np.asarray(drafter_rows) > 0, drafter, 0.0)

    def unprofiled(self, draft_tokens: np.ndarray, batch_size: int | np.ndarray,
                   drafter_rows: np.ndarray) -> np.ndarray:
        return (self.overhead + self.per_request * np.asarray(batch_size)
                + self.per_draft_token * np.asarray(draft_tokens)
                + self.drafter_extra * (np.asarray(drafter_rows) > 0))

    def predict(self, tokens: np.ndarray, draft_tokens: np.ndarray, batch_size: int,
                drafter_rows: np.ndarray) -> np.ndarray:
        return (self.profiled(tokens, drafter_rows)
                + self.unprofiled(draft_tokens, batch_size, drafter_rows))

    def observe(self, tokens: np.ndarray, draft_tokens: np.ndarray, batch_sizes: np.ndarray,
                drafter_rows: np.ndarray, seconds: np.ndarray) -> None:
        """Steps measured since the last update, oldest first: one value per step in each
        array (scalars for one step)."""
        tokens, draft_tokens, batch_sizes, drafter_rows, seconds = map(
            np.atleast_1d, (tokens, draft_tokens, batch_sizes, drafter_rows, seconds))
        n, d = batch_sizes.astype(float), draft_tokens.astype(float)
        g = (drafter_rows > 0).astype(float)
        x = self.profiled(tokens, drafter_rows)
        # A pause (GC, another process) must not swing the fit: clip to 4x the prediction.
        r = np.minimum(seconds, 4.0 * (x + self.unprofiled(d, n, g))) - x
        # The newest step weighs 1, each older one COST_DECAY times less; a step without
        # drafts or without the drafter (rare while drafting: the probes) weighs
        # PLAIN_STEP_WEIGHT times more, so that the few of them pin what drafting costs.
        weights = COST_DECAY ** np.arange(len(n) - 1, -1, -1) * np.where(
            (d > 0) & (g > 0), 1.0, PLAIN_STEP_WEIGHT)
        values = np.stack([np.ones_like(n), n, d, g, r])
        self.products = (COST_DECAY ** len(n) * self.products
                         + (values * weights) @ values.T)
        moments = self.products / self.products[0, 0]  # weighted means of the products
        ridge = np.concatenate([[self.OVERHEAD_RIDGE],
                                (self.RIDGE * moments[0, 1:4]) ** 2 + 1e-12])
        terms = _nonnegative_slopes(moments[:4, :4] + np.diag(ridge), moments[:4, 4])
        self.overhead, self.slopes = float(terms[0]), terms[1:]


def _nonnegative_slopes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solves a @ x = b with x >= 0: a negative slope is noise, so the most negative one is
    dropped and the others refitted until none is left negative."""
    x = np.zeros(len(b))
    active = list(range(len(b)))
    while active:
        solved = np.linalg.solve(a[np.ix_(active, active)], b[active])
        if (solved >= 0).all():
            x[active] = solved
            break
        active.pop(int(np.argmin(solved)))
    return x


class AcceptanceModel:
    """Per-position conditional acceptance of the whole engine, per source of drafts (the
    drafter, or prompt lookup where it is on), a per-class factor (greedy or sampled requests,
    from either source) and a per-request factor.

    Sampling accepts far fewer drafts than greedy decoding (the tiny pair: 7% at position 1
    at T = 1 against 80-95% greedy), so a sampled request starts from what sampled requests
    accepted, not from the engine's mix: the first sampled requests after greedy traffic do
    not draft the full block on the greedy requests' record, and in a mixed batch each kind
    drafts at its own rate from its first step. Prompt lookup's drafts are right or wrong in
    their own way (a copy goes on or breaks off; the SmolLM2 pair's drafter accepts 1.6 per
    step, its lookup drafts far more), so they are counted apart, per position and per
    request: a request that copies drafts the full block while one that does not drafts at
    the drafter's rate."""

    def __init__(self, max_draft: int) -> None:
        # [drafter, lookup] x positions: drafts whose position i was reached, and accepted.
        self.reached = np.zeros((NUM_SOURCES, max_draft))
        self.accepted = np.zeros((NUM_SOURCES, max_draft))
        # (req, source) -> (reached, accepted)
        self.requests: dict[tuple[str, int], tuple[float, float]] = {}
        self.sampled: set[str] = set()  # requests that sample (the others are greedy)
        self.lookup: set[str] = set()  # requests whose drafts are prompt lookup's this step
        # Classes (greedy, sampled) x (drafter, lookup) [draft_class] x [positions reached,
        # accepted], decayed as the tables are.
        self.by_class = np.zeros((2 * NUM_SOURCES, 2))
        # Per class: the (reached, accepted) counts of the last requests that finished, and
        # the weight of a request's prior that their spread gives.
        self.finished = tuple(deque(maxlen=FINISHED_REQUESTS) for _ in range(2 * NUM_SOURCES))
        self.request_prior = np.full(2 * NUM_SOURCES, REQUEST_PRIOR_WEIGHT)

    def observe(self, drafts: list[tuple[str, int, int]], source: int = DRAFTER) -> None:
        """drafts: (request id, draft tokens verified, draft tokens accepted), all from one
        source (DRAFTER or LOOKUP)."""
        if not drafts:
            return
        decay = GLOBAL_DECAY ** len(drafts)
        num_draft = np.array([d[1] for d in drafts])
        num_accepted = np.array([d[2] for d in drafts])
        reached = np.minimum(num_accepted + 1, num_draft)
        # Position i (0-based) was reached by the drafts with reached > i: counts from the
        # histogram's tail sums. A source's table ages with its own drafts.
        size = self.reached.shape[1]
        self.reached[source] = decay * self.reached[source] + _count_above(reached, size)
        self.accepted[source] = decay * self.accepted[source] + _count_above(num_accepted, size)
        self.by_class *= decay
        for (req_id, _, accepted), r in zip(drafts, reached.tolist()):
            old_reached, old_accepted = self.requests.get((req_id, source), (0.0, 0.0))
            self.requests[req_id, source] = (REQUEST_DECAY * old_reached + r,
                                             REQUEST_DECAY * old_accepted + accepted)
            self.by_class[self.draft_class(req_id, source)] += (r, accepted)

    def draft_class(self, req_id: str, source: int) -> int:
        return int(req_id in self.sampled) + 2 * source

    def sources(self, req_ids: list[str]) -> np.ndarray:
        """[n] the source of each request's drafts: LOOKUP where prompt lookup found them."""
        return np.array([r in self.lookup for r in req_ids], dtype=np.int64)

    def posterior(self, source: int = DRAFTER) -> tuple[np.ndarray, np.ndarray]:
        """[max_draft] mean and standard deviation of each position's conditional acceptance
        of one source's drafts (Beta posteriors, each position's prior the estimate of the one
        before)."""
        mean, std = np.empty(self.reached.shape[1]), np.empty(self.reached.shape[1])
        prior = PRIOR_ACCEPTANCE
        for i, (reached, accepted) in enumerate(zip(self.reached[source],
                                                    self.accepted[source])):
            weight = reached + PRIOR_WEIGHT
            mean[i] = prior = (accepted + prior * PRIOR_WEIGHT) / weight
            std[i] = np.sqrt(mean[i] * (1 - mean[i]) / (weight + 1))
        return mean, std

    @property
    def unproven(self) -> bool:
        """Fewer drafts verified than the prior is worth: the estimates are mostly prior."""
        return bool(self.reached[:, 0].sum() < PRIOR_WEIGHT)

    def rates(self, source: int = DRAFTER) -> np.ndarray:
        """[max_draft] conditional acceptance per position of one source's drafts as decisions
        read it: the posterior mean, raised by OPTIMISM standard deviations."""
        mean, std = self.posterior(source)
        return np.minimum(mean + OPTIMISM * std, 1.0)

    def expected_accepted(self, req_ids: list[str], low: float = 0.0) -> np.ndarray:
        """[n, max_draft + 1]: E_r(k) for k = 0..max_draft, as decisions read the rates;
        each request's own rate taken `low` of its posterior standard deviations below its
        mean."""
        rates = np.stack([self.rates(source) for source in range(NUM_SOURCES)])
        sources = self.sources(req_ids)
        reach = np.cumprod(self._request_rates(req_ids, sources, rates, low), axis=1)
        return _with_zero_draft(np.cumsum(reach, axis=1))

    def accepted_moments(self, req_ids: list[str], source: int = DRAFTER
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[n, max_draft + 1] each, for a draft of k = 0..max_draft tokens from `source`, at
        the posterior means: the mean E_r(k) of the tokens it accepts, their variance, and
        the standard error of E_r(k) that the rates' posteriors give."""
        posteriors = [self.posterior(s) for s in range(NUM_SOURCES)]
        std = posteriors[source][1]
        rates = self._request_rates(req_ids, np.full(len(req_ids), source),
                                    np.stack([mean for mean, _ in posteriors]))
        # A draft of k tokens accepts at least j of them (j <= k) with probability
        # reach_j = prod_{i<=j} a_i, so E[A] = sum_j reach_j and E[A^2] = sum_j (2j - 1) reach_j.
        reach = np.cumprod(rates, axis=1)
        mean = _with_zero_draft(np.cumsum(reach, axis=1))
        odd = 2 * np.arange(1, reach.shape[1] + 1) - 1
        variance = np.cumsum(odd * reach, axis=1) - mean[:, 1:] ** 2
        # dE(k)/da_j = (E(k) - E(j - 1)) / a_j for j <= k; positions' errors independent.
        below = np.tril(np.ones((reach.shape[1], reach.shape[1])))  # [k, j]: j <= k
        slopes = (mean[:, 1:, None] - mean[:, None, :-1]) * below / rates[:, None, :]
        error = np.sqrt(((slopes * std) ** 2).sum(axis=2))
        return mean, _with_zero_draft(variance), _with_zero_draft(error)

    def _request_rates(self, req_ids: list[str], sources: np.ndarray,
                       position_rates: np.ndarray, low: float = 0.0) -> np.ndarray:
        """[n, max_draft]: each source's per-position rates (position_rates [sources,
        max_draft]), shifted to each request (its own rate `low` posterior standard deviations
        below its mean)."""
        overall = (self.accepted.sum(axis=1) + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (
            self.reached.sum(axis=1) + PRIOR_WEIGHT)
        # Each class's rate, from the prior where it has no drafts yet; with one class of
        # traffic it is the engine's.
        class_rate = (self.by_class[:, 1] + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (
            self.by_class[:, 0] + PRIOR_WEIGHT)
        classes = np.array([self.draft_class(r, s) for r, s in zip(req_ids, sources.tolist())],
                           dtype=np.int64)
        own = np.array([self.requests.get((r, s), (0.0, 0.0))
                        for r, s in zip(req_ids, sources.tolist())]).reshape(-1, 2)
        prior = self.request_prior[classes]
        own_rate = (own[:, 1] + class_rate[classes] * prior) / (own[:, 0] + prior)
        own_rate -= low * np.sqrt(own_rate * (1 - own_rate) / (own[:, 0] + prior + 1))
        # A request's own rate, shrunk towards its class's, shifts every position's log-odds
        # by its own log-odds against its source's: easy requests approach 1 at every position.
        shift = _logit(own_rate) - _logit(overall[sources])
        return _sigmoid(_logit(position_rates[sources]) + shift[:, None])

    def finish(self, req_id: str) -> None:
        """A request ended: its counts join its classes' records of how requests differ."""
        for source in range(NUM_SOURCES):
            cls = self.draft_class(req_id, source)
            counts = self.requests.pop((req_id, source), None)
            if counts is not None and counts[0] >= 1.0:
                self.finished[cls].append(counts)
                self.request_prior[cls] = request_prior_weight(np.array(self.finished[cls]))
        self.sampled.discard(req_id)
        self.lookup.discard(req_id)

    def forget(self) -> None:
        """Drops every count: they describe traffic that has changed (_Choice.disproved)."""
        self.reached[:] = 0.0
        self.accepted[:] = 0.0
        self.by_class[:] = 0.0
        self.requests = {}
        for finished in self.finished:
            finished.clear()
        self.request_prior[:] = REQUEST_PRIOR_WEIGHT

    def forget_except(self, req_ids: list[str]) -> None:
        keep = set(req_ids)
        self.requests = {key: v for key, v in self.requests.items() if key[0] in keep}


def request_prior_weight(finished: np.ndarray) -> float:
    """The weight of the Beta prior whose spread is that of the finished requests' rates
    beyond what chance explains. finished: [n, 2] positions reached and accepted per request.
    Method of moments: with rates p_i = a_i / r_i around the pooled m, the weighted sum
    S = sum r_i (p_i - m)^2 expects (n - 1) m (1 - m) from chance alone, plus
    tau^2 (sum r_i - sum r_i^2 / sum r_i) from a spread tau^2 between requests; a Beta prior
    of weight w has the spread m (1 - m) / (w + 1)."""
    if len(finished) < MIN_FINISHED_REQUESTS:
        return REQUEST_PRIOR_WEIGHT
    reached, accepted = finished[:, 0], finished[:, 1]
    total = reached.sum()
    m = accepted.sum() / total
    spread = reached @ (accepted / reached - m) ** 2
    chance = (len(reached) - 1) * m * (1 - m)
    tau2 = (spread - chance) / (total - reached @ reached / total)
    if tau2 <= 0:
        return MAX_REQUEST_PRIOR_WEIGHT
    return float(np.clip(m * (1 - m) / tau2 - 1, MIN_REQUEST_PRIOR_WEIGHT,
                         MAX_REQUEST_PRIOR_WEIGHT))


def _with_zero_draft(per_length: np.ndarray) -> np.ndarray:
    """[n, max_draft] for draft lengths 1..max_draft -> [n, max_draft + 1] from length 0."""
    return np.concatenate([np.zeros((len(per_length), 1)), per_length], axis=1)


def _count_above(values: np.ndarray, size: int) -> np.ndarray:
    """[size]: how many of values exceed 0, 1, ..., size - 1."""
    tail = np.bincount(values, minlength=size + 1)[::-1].cumsum()[::-1]
    return tail[1 : size + 1]


def _logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


@dataclass
class _Choice:
    batch: tuple[str, ...]  # the request ids it was made for, in order
    lookup: frozenset[str]  # ... those whose drafts were prompt lookup's
    lengths: np.ndarray
    step: int
    hold: int  # steps it holds
    # What the estimates behind it say a draft of each length 0..max_draft from each source
    # accepts, as means over the batch, [source][length]: the mean, the variance of a draft's
    # outcome, and the standard error of the mean itself (from the rates' posteriors). Python
    # lists: record() reads them once per draft, every step.
    accepted_mean: list[list[float]]
    accepted_variance: list[list[float]]
    accepted_mean_error: list[list[float]]
    # ... and the drafts verified since, against them.
    drafts: int = 0
    accepted: float = 0.0
    predicted: float = 0.0
    variance: float = 0.0
    error: float = 0.0

    def record(self, drafts: list[tuple[str, int, int]], source: int) -> None:
        mean, variance, error = (self.accepted_mean[source], self.accepted_variance[source],
                                 self.accepted_mean_error[source])
        for _, verified, accepted in drafts:
            self.accepted += accepted
            self.predicted += mean[verified]
            self.variance += variance[verified]
            self.error += error[verified]
        self.drafts += len(drafts)

    def sources_changed(self, req_ids: list[str], lookup: set[str]) -> bool:
        """Whether a request it was made for now drafts from the other source."""
        if not self.lookup and not lookup:
            return False
        return any((r in self.lookup) != (r in lookup)
                   for r in set(self.batch).intersection(req_ids))

    @property
    def disproved(self) -> bool:
        """The drafts since the choice accepted far fewer, or far more, than it predicted:
        the outcomes' spread grows as the square root of their count, the estimates' error
        (the same for every draft) in proportion to it."""
        spread = math.sqrt(self.variance + self.error**2 + 1.0)
        return (self.drafts >= DISPROVE_MIN_DRAFTS
                and abs(self.accepted - self.predicted) > DISPROVE_Z * spread)

    @property
    def uniform(self) -> bool:
        """One length for every request."""
        return bool((self.lengths == self.lengths[0]).all())

    def remaining(self, req_ids: list[str]) -> float:
        """The share of the requests it was made for that are among req_ids."""
        return len(set(self.batch).intersection(req_ids)) / len(self.batch)


@dataclass
class Plan:
    lengths: list[int]  # draft tokens each request verifies this step, in the order given
    num_draft: int  # draft tokens the drafter proposes at the end of this step (0: skip it)


class DraftPolicy:
    """Chooses draft lengths per step; fed with what each step accepted and how long it took."""

    def __init__(self, max_draft: int, profile: StepProfile, prompt_lookup: bool = False
                 ) -> None:
        self.levels = np.array(draft_levels(max_draft))
        # With prompt lookup on, plan() is told each step whose drafts lookup finds; otherwise
        # every draft is the drafter's, and nothing is estimated for lookup's.
        self.prompt_lookup = prompt_lookup
        self.acceptance = AcceptanceModel(max_draft)
        self.cost = StepCostModel(profile)
        self.drafting = True
        self.explore_interval = EXPLORE_INTERVAL
        self.exploring = True
        self.steps = 0
        self.chosen: _Choice | None = None
        # Per source: drafts verified since the estimates last read them.
        self.pending_drafts: list[list[tuple[str, int, int]]] = [[] for _ in range(NUM_SOURCES)]
        self.pending_steps: list[tuple[int, int, int, int, float]] = []
        # (tokens, requests, requests the drafter ran for)
        self.seen_shapes: set[tuple[int, int, int]] = set()
        # Of this step's requests, those the drafter's pass leaves to lookup (0 unless the
        # profile says it does).
        self.lookup_rows = 0
        self.last_step_end: float | None = None  # None: idle, the next step starts at plan()
        self.step_start = 0.0
        self.report = _Report(self.levels)

    def plan(self, req_ids: list[str], remaining: list[int] | None = None,
             lookup: list[bool] | None = None) -> Plan:
        """Draft lengths for the decoding requests req_ids of the coming step. remaining:
        the most tokens each may still emit, given when no request waits to join the batch
        (then the batch's finish time decides, choose). lookup: with prompt lookup on, whether
        it finds each request's drafts (those it verifies now, and likely its next)."""
        max_draft = int(self.levels[-1])
        if lookup is not None:
            if not self.prompt_lookup:
                raise ValueError("lookup flags for a DraftPolicy made with prompt_lookup=False")
            self.acceptance.lookup = {r for r, found in zip(req_ids, lookup) if found}
        self.lookup_rows = (len(self.acceptance.lookup.intersection(req_ids))
                            if self.cost.profile.lookup_skips_drafter else 0)
        if self.last_step_end is None:
            self.step_start = time.perf_counter()
        if not req_ids:
            return Plan([], max_draft if self.drafting else 0)
        if len(self.acceptance.requests) > 2 * len(req_ids) + 64:
            self.acceptance.forget_except(req_ids)
        self.steps += 1
        batch = tuple(req_ids)
        chosen = self.chosen
        holds = chosen is not None and self.steps - chosen.step < chosen.hold
        if chosen is not None and chosen.disproved:
            holds, chosen.hold = False, self.steps - chosen.step  # it held this long
            self.acceptance.forget()
        if holds and self.drafting and chosen.sources_changed(req_ids, self.acceptance.lookup):
            holds = False  # a request's drafts change source: its length is chosen anew
        if holds and chosen.batch == batch:
            lengths = chosen.lengths.copy()
        elif holds and chosen.uniform and chosen.remaining(req_ids) >= HOLD_MIN_REMAINING:
            # One length for the whole batch holds for requests that join it, too.
            lengths = np.full(len(req_ids), chosen.lengths[0])
        else:
            lengths = self.choose(req_ids, remaining)
            self.chosen = _Choice(batch, frozenset(self.acceptance.lookup.intersection(batch)),
                                  lengths.copy(), self.steps, self._hold(chosen, lengths),
                                  *self._prediction(req_ids))
        num_draft = int(lengths.max())
        if self.drafting and self.steps % PROBE_INTERVAL == 0:
            lengths[:], num_draft = 0, 0  # a plain step: the fit's measure without drafts
        elif num_draft < max_draft and self.exploring:
            if self.acceptance.unproven:
                # Until the first drafts outweigh the prior, requests in turn explore at
                # every step, and the drafter runs for the next: a strong drafter is found
                # within a few steps of a burst's start.
                if self.steps >= EXPLORE_FIRST_STEP:
                    self._explore(lengths, self.steps, req_ids)
                num_draft = max_draft
            else:
                interval = self.explore_interval  # a power of 2: its phases stay aligned
                phase = (self.steps - EXPLORE_FIRST_STEP) % interval
                if phase == interval - 1:
                    num_draft = max_draft  # full drafts ready for the exploring step
                elif phase == 0:
                    self._explore(lengths, self.steps // interval, req_ids)
        self.report.add(lengths, num_draft > 0, self.acceptance.sources(req_ids))
        return Plan(lengths.tolist(), num_draft)

    def _explore(self, lengths: np.ndarray, turn: int, req_ids: list[str]) -> None:
        """Gives the full block to EXPLORE_WIDTHS[turn] requests (cyclically), from request
        `turn` on, of those whose drafts come from the source measured least."""
        sources = self.acceptance.sources(req_ids)
        present = np.unique(sources)
        least = present[np.argmin(self.acceptance.reached[present, 0])]
        candidates = np.flatnonzero(sources == least)
        width = min(EXPLORE_WIDTHS[turn % len(EXPLORE_WIDTHS)], len(candidates))
        first = turn % len(candidates)
        lengths[candidates[np.arange(first, first + width) % len(candidates)]] = self.levels[-1]

    def _hold(self, last: _Choice | None, lengths: np.ndarray) -> int:
        """How many steps a new choice of lengths holds."""
        if self.acceptance.unproven:
            return 1  # each verified draft still moves the estimates: choose again at once
        if not self.drafting:
            # Nothing but an exploration's measurements can turn drafting on: choose again
            # right after the next exploring step.
            return (EXPLORE_FIRST_STEP - self.steps) % self.explore_interval + 1
        if last is not None and last.uniform and (lengths == last.lengths[0]).all():
            return min(2 * last.hold, MAX_HOLD)
        return REPLAN_INTERVAL

    def choose(self, req_ids: list[str], remaining: list[int] | None = None) -> np.ndarray:
        """[n] draft lengths that maximise predicted tokens per second: of this step while
        requests wait to join the batch, of the rest of the batch when none does (remaining
        given: each request's most tokens left)."""
        self._absorb()
        n = len(req_ids)
        # A request is read OPTIMISM of its own standard deviations above its mean, as
        # positions are: one whose first drafts failed is not written off before its next.
        expected = self.acceptance.expected_accepted(req_ids, -OPTIMISM)[:, self.levels]
        lengths, on, off = self._fastest_step(expected)
        if remaining is not None and n > 1:  # one request: both goals are its own speed
            # The batch ends with its slowest request: each request is planned at a rate that
            # the slowest of n requests reaches, given how little is known of each.
            low = NormalDist().inv_cdf(1 - 1 / (n + 1))
            slowest = self.acceptance.expected_accepted(req_ids, low)[:, self.levels]
            finish, on, off = self._finish_together(
                slowest, np.maximum(np.asarray(remaining, dtype=float), 1.0))
            # Requests the plan lets draft less than the fastest step would keep their longer
            # drafts where that costs the step little (a memory-bound step): their own
            # latency is not given up for a finish time it barely moves.
            longer = np.maximum(finish, lengths)
            lengths = longer if self._step_s(longer) <= self._step_s(finish) * (
                1.0 + SWITCH_MARGIN) else finish
        self.exploring = self.could_pay(n, off)
        if self.drafting:  # stop only when plain decoding is clearly faster, and vice versa
            self.drafting = not off > on * (1.0 + SWITCH_MARGIN)
        else:
            self.drafting = on > off * (1.0 + SWITCH_MARGIN)
            self.explore_interval = (EXPLORE_INTERVAL if self.drafting else
                                     min(2 * self.explore_interval, MAX_EXPLORE_INTERVAL))
        return lengths if self.drafting else np.zeros(n, dtype=lengths.dtype)

    def _step_s(self, lengths: np.ndarray) -> float:
        """The predicted seconds of a step that verifies these draft lengths."""
        n, draft_tokens = len(lengths), int(lengths.sum())
        return float(self.cost.predict(n + draft_tokens, draft_tokens, n,
                                       self._drafter_rows(n, draft_tokens)))

    def _fastest_step(self, expected: np.ndarray) -> tuple[np.ndarray, float, float]:
        """The drafting plan of the most tokens per second this step, its rate, and the rate
        of a step without drafts."""
        n = len(expected)
        # One length for the whole batch (what a fixed K is), at every level; level 0 is off.
        rates = (n + expected.sum(axis=0)) / self.cost.predict(
            n + n * self.levels, n * self.levels, n, self._drafter_rows(n, self.levels))
        best = 1 + int(np.argmax(rates[1:]))
        lengths, on = np.full(n, self.levels[best]), rates[best]
        # Lengths per request only when predicted clearly faster: uniform batches keep the
        # target's shapes uniform, and small predicted gains are within the estimates' error.
        per_request, per_request_rate = self._per_request(expected)
        if per_request_rate > on * (1.0 + SWITCH_MARGIN):
            lengths, on = per_request, per_request_rate
        return lengths, on, float(rates[0])

    def _finish_together(self, expected: np.ndarray, remaining: np.ndarray
                         ) -> tuple[np.ndarray, float, float]:
        """The drafting plan that finishes the batch soonest, its rate over the batch's
        remaining tokens, and that of plain decoding.

        With no request waiting, the batch ends when its slowest request does: a token that
        a fast request's drafts win early shortens nothing, and costs the steps that verify
        it. For a finish within N steps, each request drafts the shortest length whose
        expected tokens per step, 1 + E_r(k), cover its remaining tokens in N steps; the
        batch then runs about N steps of that plan. N is chosen from the finish times
        between every request at the full block and plain decoding's max(remaining)."""
        n = len(expected)
        steps_needed = remaining[:, None] / (1.0 + expected)  # [n, L]
        soonest, plain = steps_needed[:, -1].max(), remaining.max()
        finishes = np.append(np.geomspace(soonest, plain, FINISH_CANDIDATES - 1), plain)
        fits = steps_needed[None, :, :] <= finishes[:, None, None] * (1 + 1e-9)  # [F, n, L]
        lengths = self.levels[fits.argmax(axis=2)]  # the shortest that fits, [F, n]
        draft_tokens = lengths.sum(axis=1)
        seconds = finishes * self.cost.predict(n + draft_tokens, draft_tokens, n,
                                               self._drafter_rows(n, draft_tokens))
        rates = remaining.sum() / seconds
        best = int(np.argmax(np.where(draft_tokens > 0, rates, -np.inf)))
        return lengths[best], float(rates[best]), float(rates[-1])

    def _prediction(self, req_ids: list[str]
                    ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
        """[source][max_draft + 1] each, means over the batch: the tokens a draft of each
        length accepts by the posterior means, their variance, and the standard error of the
        mean."""
        per_source = [self.acceptance.accepted_moments(req_ids, source)
                      for source in range(NUM_SOURCES if self.prompt_lookup else 1)]
        return tuple([moments[i].mean(axis=0).tolist() for moments in per_source]
                     for i in range(3))

    def _drafter_rows(self, n: int, draft_tokens: np.ndarray | int) -> np.ndarray:
        """The requests the drafter's pass runs for in a step of n requests that drafts
        draft_tokens tokens (none when it drafts none)."""
        return np.where(np.asarray(draft_tokens) > 0, n - self.lookup_rows, 0)

    def could_pay(self, n: int, off_rate: float) -> bool:
        """Whether drafting at some level would beat plain decoding for n requests if every
        draft were accepted: if not, exploring cannot find a length that pays."""
        ideal = n * (1 + self.levels[1:]) / self.cost.predict(
            n * (1 + self.levels[1:]), n * self.levels[1:], n,
            self._drafter_rows(n, self.levels[1:]))
        return bool(ideal.max() > off_rate)

    def _per_request(self, expected: np.ndarray) -> tuple[np.ndarray, float]:
        """The best drafting plan with a level per request, and its predicted tokens/s."""
        n = len(expected)
        # Upgrades: request r from level j-1 to j, worth gain[r, j] tokens for width[j] tokens.
        gain = np.diff(expected, axis=1)
        width = np.diff(self.levels)
        # Taking upgrades by falling gain per token gives each request a prefix of its own
        # upgrades (ties go to the lower level).
        per_token = np.minimum.accumulate(gain / width, axis=1)
        rows, cols = np.indices(gain.shape)
        order = np.lexsort((cols.ravel(), -per_token.ravel()))
        extra_tokens = np.cumsum(np.broadcast_to(width, gain.shape).ravel()[order])
        extra_gain = np.cumsum(gain.ravel()[order])
        tokens_per_s = (n + extra_gain) / self.cost.predict(n + extra_tokens, extra_tokens, n,
                                                            n - self.lookup_rows)
        best = int(np.argmax(tokens_per_s))
        lengths = self.levels[np.bincount(rows.ravel()[order[: best + 1]], minlength=n)]
        return lengths, float(tokens_per_s[best])

    def observe(self, drafts: list[tuple[str, int, int]], num_tokens: int, batch_size: int,
                drafted: bool) -> None:
        """One finished step: its drafts' (request, verified, accepted), the query tokens and
        requests it ran, and whether the drafter was asked for drafts at its end."""
        now = time.perf_counter()
        drafter_rows = max(batch_size - self.lookup_rows, 0) if drafted else 0
        # Steps follow each other back to back while requests run: the time since the last
        # step ended covers scheduling, the forward pass, sampling, drafting and output.
        start = self.step_start if self.last_step_end is None else self.last_step_end
        self.last_step_end = now
        lookup = self.acceptance.lookup
        by_source = ((drafts, []) if not lookup else
                     ([d for d in drafts if d[0] not in lookup],
                      [d for d in drafts if d[0] in lookup]))
        for source, part in enumerate(by_source):
            if part:
                self.pending_drafts[source] += part
                if self.chosen is not None:
                    self.chosen.record(part, source)
        draft_tokens = sum(verified for _, verified, _ in drafts)
        # The first step of each shape pays one-time costs later ones do not (on the CPU
        # build, oneDNN builds GEMM primitives for each new token count: 2-6 ms more on the
        # tiny pair), which the fit would read as what that kind of step always costs.
        shape = (num_tokens, batch_size, drafter_rows)
        seen = shape in self.seen_shapes
        if not seen and len(self.seen_shapes) < MAX_SHAPES_SEEN:
            self.seen_shapes.add(shape)
        # Only decode steps feed the cost fit: a prompt's tokens cost more than the profile
        # says (KV injection of the whole prompt, the new request's set-up), and such a step
        # verifies no drafts, so it would pass for a cheap step without drafts.
        if seen and num_tokens == batch_size + draft_tokens:
            self.pending_steps.append((num_tokens, draft_tokens, batch_size, drafter_rows,
                                       now - start))

    def _absorb(self) -> None:
        """Feeds the steps observed since the last choice to the models in one update: only
        a choice reads them, and one vectorised update costs what a single step's did."""
        if self.pending_steps:
            self.cost.observe(*map(np.array, zip(*self.pending_steps)))
            self.pending_steps = []
        self._absorb_drafts()

    def _absorb_drafts(self) -> None:
        for source, drafts in enumerate(self.pending_drafts):
            self.acceptance.observe(drafts, source)
            drafts.clear()

    def request_added(self, req_id: str, sampled: bool) -> None:
        """A new request, and whether it samples (temperature > 0) or decodes greedily."""
        if sampled:
            self.acceptance.sampled.add(req_id)

    def request_freed(self, req_id: str) -> None:
        self._absorb_drafts()  # its last drafts count too
        self.acceptance.finish(req_id)

    def idle(self) -> None:
        """No requests left: the gap until the next step is not a step's cost."""
        self.last_step_end = None

    def summary(self, flush: bool = False) -> str | None:
        """A one-line account of recent decisions, at most every REPORT_INTERVAL_S unless
        flush (the engine went idle: the account of a burst shorter than the interval)."""
        if not self.report.due(flush):
            return None
        self._absorb()
        return self.report.take(self)


class _Report:
    def __init__(self, levels: np.ndarray) -> None:
        self.levels = levels
        self.reset()

    def reset(self) -> None:
        self.since = time.perf_counter()
        self.counts = np.zeros((NUM_SOURCES, len(self.levels)), dtype=np.int64)
        self.steps = self.drafting_steps = 0

    def add(self, lengths: np.ndarray, drafting: bool, sources: np.ndarray) -> None:
        for source in range(NUM_SOURCES):
            self.counts[source] += np.bincount(
                np.searchsorted(self.levels, lengths[sources == source]),
                minlength=len(self.levels))
        self.steps += 1
        self.drafting_steps += drafting

    def due(self, flush: bool) -> bool:
        interval_over = time.perf_counter() - self.since >= REPORT_INTERVAL_S
        return self.steps > 0 and (interval_over or flush)

    def take(self, policy: DraftPolicy) -> str:
        counts = self.counts.sum(axis=0)
        total = counts.sum()
        mean = float(counts @ self.levels) / total
        shares = ", ".join(f"{k}: {c / total:.0%}" for k, c in zip(self.levels, counts))
        rates = " ".join(f"{a:.2f}" for a in policy.acceptance.rates(DRAFTER))
        line = (f"mean draft length {mean:.2f} per request-step ({shares}), drafter on in "
                f"{self.drafting_steps / self.steps:.0%} of {self.steps} steps; "
                f"acceptance per position {rates}; ")
        lookup = self.counts[LOOKUP]
        if lookup.any() or policy.acceptance.reached[LOOKUP].any():
            lookup_rates = " ".join(f"{a:.2f}" for a in policy.acceptance.rates(LOOKUP))
            line += (f"prompt lookup's drafts at {lookup.sum() / total:.0%} of request-steps, "
                     f"mean length {float(lookup @ self.levels) / max(lookup.sum(), 1):.2f}, "
                     f"acceptance per position {lookup_rates}; ")
        line += (f"step cost profile + {policy.cost.overhead * 1e3:.1f} ms + "
                 f"{policy.cost.per_request * 1e3:.2f} ms per request + "
                 f"{policy.cost.per_draft_token * 1e3:.3f} ms per draft token + "
                 f"{policy.cost.drafter_extra * 1e3:.2f} ms when the drafter runs")
        self.reset()
        return line
