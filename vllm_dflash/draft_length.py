"""What the scheduler does with the draft-length policy each step, without vLLM.

Before a step is scheduled, each decoding request's drafts are cut to the policy's length
(the scheduler then schedules 1 + k_r tokens for it) and the policy says how many draft
tokens the drafter proposes at the end of the step. Seeded sampling requests always draft
the full K: each verified draft token draws from the request's own generator, so its output
is reproducible only if its draft lengths are, and measured step times are not.

With prompt lookup on, the policy is told which requests' drafts lookup finds (from the
token ids the scheduler holds, by the rule the drafter applies): their drafts are judged on
what lookup's drafts accept.

Requests are read by duck typing: `request_id`, `spec_token_ids`, `is_prefill_chunk`,
`max_tokens`, `num_output_tokens`, `all_token_ids` and `sampling_params` (`seed`,
`temperature`), as vLLM's scheduler holds them.
"""

from collections.abc import Collection
from typing import Any

from vllm_dflash.draft_policy import DraftPolicy
from vllm_dflash.prompt_lookup import lookup_found

# vLLM decodes greedily below this temperature (its _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


def is_sampling(request: Any) -> bool:
    params = request.sampling_params
    return params is not None and params.temperature >= GREEDY_TEMPERATURE


def is_seeded_sampling(request: Any) -> bool:
    return is_sampling(request) and request.sampling_params.seed is not None


class DraftLengthController:
    """The policy as the scheduler uses it, and the seeded requests it holds."""

    def __init__(self, policy: DraftPolicy, max_draft: int) -> None:
        self.policy = policy
        self.max_draft = max_draft
        self.seeded: set[str] = set()  # ids of the seeded sampling requests held

    def plan_step(self, running: list[Any], waiting: Collection[Any]) -> int:
        """Cuts each running decoding request's drafts to its length for the coming step;
        returns how many draft tokens the drafter proposes at its end."""
        decoding = [r for r in running if not r.is_prefill_chunk]
        adaptive = [r for r in decoding if not is_seeded_sampling(r)]
        # No request waits or is still prefilling: the batch only shrinks from here, and the
        # policy plans for the time it takes to finish (the most tokens each may still emit).
        closed = not waiting and len(decoding) == len(running)
        remaining = [r.max_tokens - r.num_output_tokens for r in adaptive] if closed else None
        lookup = (lookup_found([r.all_token_ids for r in adaptive])
                  if self.policy.prompt_lookup and adaptive else None)
        plan = self.policy.plan([r.request_id for r in adaptive], remaining, lookup)
        for request, length in zip(adaptive, plan.lengths):
            if len(request.spec_token_ids) > length:
                request.spec_token_ids = request.spec_token_ids[:length]
        # Seeded requests prefilled this step (still waiting now) draft K from the start. The
        # waiting queue (all of an offline batch's prompts) is searched only if a seeded
        # request is held at all.
        seeded = len(adaptive) < len(decoding) or (
            bool(self.seeded) and any(map(is_seeded_sampling, waiting)))
        return self.max_draft if seeded else plan.num_draft

    def observe_step(self, drafts: list[tuple[str, int, int]], num_tokens: int,
                     batch_size: int, drafted: bool) -> str | None:
        """One finished step (see DraftPolicy.observe); returns the policy's summary line
        when one is due."""
        self.policy.observe(drafts, num_tokens=num_tokens, batch_size=batch_size,
                            drafted=drafted)
        return self.policy.summary()

    def idle(self) -> str | None:
        """No request left: returns the summary of the burst that ended."""
        self.policy.idle()
        return self.policy.summary(flush=True)

    def added(self, request: Any) -> None:
        self.policy.request_added(request.request_id, is_sampling(request))
        if is_seeded_sampling(request):
            self.seeded.add(request.request_id)

    def freed(self, request: Any) -> None:
        self.policy.request_freed(request.request_id)
        self.seeded.discard(request.request_id)
