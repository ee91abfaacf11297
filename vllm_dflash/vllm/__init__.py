"""Everything in vllm-dflash that knows vLLM internals, one file per vLLM subsystem:

    config.py          engine configuration: which engines are vllm-dflash's, start-up checks,
                       the runner a DFlash engine gets
    runner.py          the model runners: V1 builds the proposer, Model Runner V2 the speculator
    spec_decode.py     the V1 proposer (V1 spec_decode)
    speculator.py      the Model Runner V2 speculator (gpu/spec_decode)
    drafting.py        the drafter's step, shared by both
    attention.py       the draft layers' KV cache, declared to vLLM
    sampler.py         the rejection sampler: verification by vllm-dflash's kernel
    scheduler.py       the engine core and scheduler: the draft-length policy
    model_executor.py  the target's embedding and lm_head, vLLM's CPU GEMM
    contract.py        every vLLM hook the above patch or call, and their check

vLLM loads `register()` through the `vllm.general_plugins` entry point in every vLLM process
(API server, engine core, workers), whether or not an engine asks for DFlash. So every patch
leaves vLLM's behaviour unchanged unless the engine runs vllm-dflash (config.runs_vllm_dflash),
and nothing here writes the process environment or refuses a vLLM version: a vllm-dflash
engine checks the hook contract at start-up instead.
"""

import logging

from vllm_dflash.vllm import config, contract

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler

_registered = False


def register() -> None:
    """Entry point of `vllm.general_plugins`; idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    if config.steps_aside():
        return
    problems = contract.broken_hooks()
    try:
        config.patch_engine_args(problems)
    except (ImportError, AttributeError) as error:  # no start-up check to report through
        logger.warning("vllm-dflash cannot attach to this vLLM (%s); method \"dflash\" runs "
                       "vLLM's own DFlash", error)
        return
    if problems:  # a vllm-dflash engine fails at start-up naming them; others run as usual
        return
    from vllm_dflash.vllm import runner, sampler, scheduler

    config.patch_config()
    runner.patch_runner()
    runner.patch_model_runner_v2()
    sampler.patch_rejection_sampler()
    scheduler.patch_engine_core()
    scheduler.patch_scheduler()
