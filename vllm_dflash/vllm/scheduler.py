"""vLLM's engine core and scheduler: the draft-length policy of a vllm-dflash engine.

The policy lives beside vLLM's scheduler, in the engine-core process, where acceptance counts
and step times are on the host (draft_length.py says what it does each step). Schedulers of
other engines have no controller and run vLLM's code alone. Checked on vLLM 0.32.0 and 0.33.0.
"""

import functools
import logging
import weakref

from vllm_dflash.draft_length import DraftLengthController
from vllm_dflash.draft_policy import DraftPolicy
from vllm_dflash.vllm.config import (
    DRAFT_LENGTH_ENV,
    draft_length_mode,
    prompt_lookup_on,
    runs_vllm_dflash,
)

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler

# vLLM's Scheduler -> its vllm-dflash controller, for vllm-dflash engines with adaptive lengths.
_controllers: "weakref.WeakKeyDictionary[object, DraftLengthController]" = (
    weakref.WeakKeyDictionary())


class _StepDraftLength:
    """Stands in for vLLM's dynamic-SD table (batch size -> draft length), which the scheduler
    reads once per step: the policy has already chosen this step's length."""

    def __init__(self, num_draft: int) -> None:
        self.num_draft = num_draft

    def __getitem__(self, batch_size: int) -> int:
        return self.num_draft


def patch_engine_core() -> None:
    # The policy starts from a profile of the workers' forward passes, taken once the KV cache
    # and CUDA graphs exist. The hook runs right after EngineCore builds its scheduler (vLLM
    # calls _initialize_effective_attention_block_size there); EngineCore.__init__ itself
    # cannot be wrapped: an engine-core process loads this plugin from inside it.
    from vllm.v1.engine.core import EngineCore

    after_scheduler = EngineCore._initialize_effective_attention_block_size

    def attach_draft_policy(self) -> None:
        after_scheduler(self)
        spec = self.vllm_config.speculative_config
        if not runs_vllm_dflash(spec) or draft_length_mode() == "fixed":
            return
        if spec.num_speculative_tokens_per_batch_size:
            logger.info("vllm-dflash: draft length from num_speculative_tokens_per_batch_size")
            return
        profile = self.collective_rpc(_profile_step_costs)[0]
        policy = DraftPolicy(spec.num_speculative_tokens, profile, prompt_lookup_on())
        _controllers[self.scheduler] = DraftLengthController(policy, spec.num_speculative_tokens)
        logger.info(
            "vllm-dflash: adaptive draft length, 0..%d tokens per request and step "
            "(%s=fixed for always %d); start-up profile (ms): target at %s tokens: %s, "
            "drafter at %s requests: %s",
            spec.num_speculative_tokens, DRAFT_LENGTH_ENV, spec.num_speculative_tokens,
            profile.tokens, _ms(profile.target_s), profile.batch_sizes, _ms(profile.drafter_s),
        )

    EngineCore._initialize_effective_attention_block_size = attach_draft_policy


def _profile_step_costs(worker):  # runs in every worker, through collective_rpc
    runner = worker.model_runner
    # The V1 runner's proposer, or Model Runner V2's speculator.
    drafter = runner.speculator if hasattr(runner, "speculator") else runner.drafter
    return drafter.draft_runner.profile_step_costs(runner)


def _ms(seconds: list[float]) -> list[float]:
    return [round(s * 1e3, 2) for s in seconds]


def patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule, update_from_output = Scheduler.schedule, Scheduler.update_from_output
    add_request, free_request = Scheduler.add_request, Scheduler._free_request

    @functools.wraps(schedule)
    def schedule_with_policy(self, *args, **kwargs):
        controller = _controllers.get(self)
        if controller is not None:
            num_draft = controller.plan_step(self.running, self.waiting)
            self.dynamic_sd_lookup = _StepDraftLength(num_draft)
        return schedule(self, *args, **kwargs)

    def update_from_output_with_policy(self, scheduler_output, model_runner_output):
        controller = _controllers.get(self)
        if controller is not None:
            _log(controller.observe_step(
                verified_drafts(scheduler_output, model_runner_output),
                num_tokens=scheduler_output.total_num_scheduled_tokens,
                batch_size=len(scheduler_output.num_scheduled_tokens),
                drafted=scheduler_output.num_spec_tokens_to_schedule > 0))
        outputs = update_from_output(self, scheduler_output, model_runner_output)
        if controller is not None and not self.has_unfinished_requests():
            _log(controller.idle())
        return outputs

    def add_request_noting_seeded(self, request) -> None:
        add_request(self, request)
        controller = _controllers.get(self)
        if controller is not None:
            controller.added(request)

    @functools.wraps(free_request)
    def free_request_noting_seeded(self, request, *args, **kwargs):
        controller = _controllers.get(self)
        if controller is not None:
            controller.freed(request)
        return free_request(self, request, *args, **kwargs)

    Scheduler.schedule = schedule_with_policy
    Scheduler.update_from_output = update_from_output_with_policy
    Scheduler.add_request = add_request_noting_seeded
    Scheduler._free_request = free_request_noting_seeded


def verified_drafts(scheduler_output, model_runner_output) -> list[tuple[str, int, int]]:
    """(request, drafts verified, drafts accepted) of each request that verified drafts."""
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    drafts = []
    for req_id, draft in scheduler_output.scheduled_spec_decode_tokens.items():
        i = index.get(req_id)
        if i is not None and i < len(sampled) and sampled[i]:
            # sampled: the accepted drafts plus the target's bonus or correction token.
            drafts.append((req_id, len(draft), len(sampled[i]) - 1))
    return drafts


def _log(summary: str | None) -> None:
    if summary:
        logger.info("vllm-dflash: %s", summary)
