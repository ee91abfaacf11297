"""The adaptive draft-length policy in simulated bursts: no engine, no timing noise.

Each step of a burst runs the real policy (vllm_dflash/draft_policy.py) on a simulated engine:
requests accept draft position i with their drafter's conditional rate, and a step costs about
what a step of the tiny pair cost on the 2-core CPU VM (fp32, eager):

    step = target(query tokens) + host + [drafter ran] * (drafter(requests) + verify_extra)

target() and drafter() follow the engine's logged start-up profiles (1.8 ms up to 8 query
tokens, then 0.04 ms a token; 0.3 ms + 0.06 ms a request). `host` and `verify_extra` are what
the profile cannot see, estimated from measured steps: 1.0 ms of scheduling and output
handling in every step (no speculation's steps at 8 requests took 2.9 ms against 1.9 ms
profiled), and 1.85 ms more in a drafting step (the rest of the modest drafter's measured
excess at 8 requests). The policy must learn those two from the steps it runs.
Fixed K = 0 (no speculation), 1, 3 and 7 run the same bursts. A burst is N requests of L
tokens each at concurrency C (the queue refills the batch), after a warm-up burst of C
requests x 16 tokens, as `vllm-dflash bench` runs them; once the queue is empty the policy
is given each request's remaining tokens, as the engine's scheduler gives them. Prints
adaptive / best fixed choice, the median over --seeds bursts of each, for every drafter,
burst and concurrency.

    python benchmarks/policy_sim.py [--seeds 5] [--drafters "good per request,mixed"]
"""

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from vllm_dflash import draft_policy
from vllm_dflash.draft_policy import DraftPolicy, StepProfile

HOST_S = 0.0010
VERIFY_EXTRA_S = 0.00185
# Conditional acceptance per draft position; "mixed" requests are easy, middling or hard.
# The "per request" drafters draw each request's rates from those the tiny pair's requests
# measured in the engine (benchmarks/tiny-request-rates.json): with the same mean, requests
# differ far more than "mixed" ones, most of all at position 1.
REQUEST_RATES = json.loads((Path(__file__).parent / "tiny-request-rates.json").read_text())
DRAFTERS = {
    "good": lambda rng: [0.93, 0.85] + [0.95] * 5,
    "modest": lambda rng: [0.24, 0.38] + [0.92] * 5,
    "mixed": lambda rng: [rng.choice([0.95, 0.95, 0.95, 0.7, 0.3])] * 7,
    "good per request": lambda rng: rng.choice(REQUEST_RATES["good"]),
    "modest per request": lambda rng: rng.choice(REQUEST_RATES["modest"]),
}
BURSTS = {"short": (16, 64), "long": (32, 128)}
CONCURRENCY = [1, 4, 8, 16, 32]


def target_s(tokens: int) -> float:
    return 0.0018 + 0.00004 * max(0, tokens - 8)


def drafter_s(batch_size: int) -> float:
    return 0.0003 + 0.00006 * batch_size


def step_s(batch_size: int, draft_tokens: int, drafter_ran: bool) -> float:
    return (target_s(batch_size + draft_tokens) + HOST_S
            + drafter_ran * (drafter_s(batch_size) + VERIFY_EXTRA_S))


PROFILE = StepProfile([1, 2, 4, 8, 16, 32, 64, 128, 256],
                      [target_s(t) for t in [1, 2, 4, 8, 16, 32, 64, 128, 256]],
                      [1, 2, 4, 8, 16, 32], [drafter_s(b) for b in [1, 2, 4, 8, 16, 32]])


class Clock:
    """The policy's time.perf_counter, advanced by the simulated steps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_burst(choose: Callable[[list[str], list[int] | None], tuple[list[int], int]],
              policy: DraftPolicy | None,
              rates_of: Callable[[random.Random], list[float]], num_requests: int,
              tokens: int, concurrency: int, seed: int, clock: Clock) -> float:
    """Output tokens per second of one burst; choose(request ids, their remaining tokens
    when no request waits) -> (lengths, num_draft)."""
    rng = random.Random(seed)
    queue = [(f"{seed}-{i}", rates_of(rng)) for i in range(num_requests)]
    running: dict[str, list] = {}  # request -> [rates, tokens left]
    start, emitted, ready = clock.now, 0, 0
    while queue or running:
        while queue and len(running) < concurrency:
            req_id, rates = queue.pop(0)
            running[req_id] = [rates, tokens]
            if policy is not None:
                policy.request_added(req_id, sampled=False)
        req_ids = list(running)
        # With no request waiting, the policy plans the rest of the batch.
        remaining = None if queue else [running[r][1] for r in req_ids]
        lengths, num_draft = choose(req_ids, remaining)
        drafts = []
        for req_id, length in zip(req_ids, lengths):
            rates, left = running[req_id]
            verified = min(length, ready, left - 1)  # drafts exist only if the drafter ran
            accepted = 0
            while accepted < verified and rng.random() < rates[accepted]:
                accepted += 1
            if verified:
                drafts.append((req_id, verified, accepted))
            running[req_id][1] -= min(1 + accepted, left)
            emitted += min(1 + accepted, left)
        draft_tokens = sum(verified for _, verified, _ in drafts)
        clock.now += step_s(len(req_ids), draft_tokens, num_draft > 0)
        if policy is not None:
            policy.observe(drafts, len(req_ids) + draft_tokens, len(req_ids), num_draft > 0)
        for req_id in [r for r, state in running.items() if state[1] <= 0]:
            del running[req_id]
            if policy is not None:
                policy.request_freed(req_id)
        ready = num_draft
    if policy is not None:
        policy.idle()
    return emitted / (clock.now - start)


def tokens_per_s(method: str, drafter: str, burst: str, concurrency: int, seed: int) -> float:
    clock = Clock()
    # The policy times its steps on the simulated clock (its module's `time`, not the process's).
    draft_policy.time = SimpleNamespace(perf_counter=clock)
    rates_of = DRAFTERS[drafter]
    if method == "adaptive":
        policy = DraftPolicy(7, PROFILE)

        def choose(req_ids: list[str], remaining: list[int] | None) -> tuple[list[int], int]:
            plan = policy.plan(req_ids, remaining)
            return plan.lengths, plan.num_draft

        run_burst(choose, policy, rates_of, concurrency, 16, concurrency, 1000 + seed, clock)
    else:
        policy, k = None, int(method)

        def choose(req_ids: list[str], remaining: list[int] | None) -> tuple[list[int], int]:
            return [k] * len(req_ids), k

    return run_burst(choose, policy, rates_of, *BURSTS[burst], concurrency, seed, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--drafters", default=",".join(DRAFTERS),
                        help="comma-separated, from " + ", ".join(DRAFTERS))
    args = parser.parse_args()
    print("| drafter | burst | " + " | ".join(f"C={c}" for c in CONCURRENCY) + " |")
    print("| --- " * (len(CONCURRENCY) + 2) + "|")
    for drafter in args.drafters.split(","):
        for burst in BURSTS:
            cells = []
            for concurrency in CONCURRENCY:
                median = {m: float(np.median([tokens_per_s(m, drafter, burst, concurrency, s)
                                              for s in range(args.seeds)]))
                          for m in ["adaptive", "0", "1", "3", "7"]}
                best = max((m for m in median if m != "adaptive"), key=median.get)
                cells.append(f"{median['adaptive'] / median[best]:.2f} (K={best})")
            print(f"| {drafter} | {burst} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
