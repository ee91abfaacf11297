"""The one module that touches vLLM internals: registration, patches and version checks.

vLLM loads `register()` through the `vllm.general_plugins` entry point in every process
(API server, engine core, workers). A new vLLM version should only need changes here.
"""

import contextvars
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
IMPL_ENV = "VLLM_DFLASH_IMPL"
# "vllm-dflash": this package's proposer, drafter and kernels; "vllm": vLLM's in-tree DFlash.
IMPLEMENTATIONS = ("vllm-dflash", "vllm")
SUPPORTED_RUNNERS = ("GPUModelRunner (V1)", "CPUModelRunner")
DRAFT_LENGTH_ENV = "VLLM_DFLASH_DRAFT_LENGTH"
# "adaptive": draft_policy.py picks 0..K draft tokens per request every step; "fixed": always K.
DRAFT_LENGTHS = ("adaptive", "fixed")

_registered = False
# rejection_sample_method="block" of the RejectionSampler whose forward is running: vLLM's
# forward calls the module-level rejection_sample, which sees no sampler or config.
_block_verification = contextvars.ContextVar("vllm_dflash_block_verification", default=False)


class DFlashSetupError(RuntimeError):
    """vLLM or the environment cannot run vllm-dflash; the message says how to fix it."""


def _env_choice(name: str, choices: tuple[str, ...], what: str) -> str:
    """The value of env var `name`, one of `choices`; unset or empty means the first."""
    value = os.environ.get(name, "").strip() or choices[0]
    if value not in choices:
        raise DFlashSetupError(
            f"{name}={value!r} is not {what}; valid values: {', '.join(choices)} "
            f"(unset means {choices[0]})."
        )
    return value


def selected_implementation() -> str:
    return _env_choice(IMPL_ENV, IMPLEMENTATIONS, "a known DFlash implementation")


def draft_length_mode() -> str:
    return _env_choice(DRAFT_LENGTH_ENV, DRAFT_LENGTHS, "a draft-length mode")


def check_vllm_version(version: str) -> None:
    if version.split("+")[0] not in SUPPORTED_VLLM_VERSIONS:
        raise DFlashSetupError(
            f"vllm-dflash supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, found vLLM "
            f"{version}. Install a supported version (pip install 'vllm-dflash[cuda]' or "
            f"'vllm-dflash[cpu]'), or uninstall vllm-dflash to use vLLM's in-tree DFlash."
        )


def require_v1_runner() -> None:
    """Model Runner V2 has its own speculators; this plugin hooks the V1 runners."""
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if value is not None and value.strip().lower() in ("1", "true"):
        raise DFlashSetupError(
            "vllm-dflash runs on the V1 model runners "
            f"({', '.join(SUPPORTED_RUNNERS)}), but VLLM_USE_V2_MODEL_RUNNER={value} selects "
            f"Model Runner V2. Unset it, or set {IMPL_ENV}=vllm for vLLM's in-tree DFlash."
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def register() -> None:
    """Entry point of `vllm.general_plugins`; idempotent: the patches below are applied once
    per process, each wrapping what vLLM defines."""
    global _registered
    if _registered:
        return
    import vllm

    impl = selected_implementation()
    check_vllm_version(vllm.__version__)
    if impl == "vllm":
        logger.info("vllm-dflash: implementation=vllm (vLLM's in-tree DFlash), not patched")
        _registered = True
        return
    require_v1_runner()
    draft_length_mode()
    _patch_runner()
    _patch_sampling_params()
    _patch_engine_args()
    _patch_v1_draft_checks()
    _patch_engine_core()
    _patch_scheduler()
    _patch_cpu_seeded_chunked_prefill()
    _registered = True


def _patch_runner() -> None:
    # The V1 runner (and CPUModelRunner, its subclass) builds and type-checks its drafter
    # through the module-level name `DFlashProposer`; rebinding it swaps in ours everywhere.
    from vllm.v1.worker import gpu_model_runner

    from vllm_dflash.proposer import DFlashProposer

    gpu_model_runner.DFlashProposer = DFlashProposer

    # With speculation vLLM builds only the min-tokens logits processor; vllm-dflash applies
    # the min_p and logit_bias ones to verified rows too (use_dflash_verification).
    build = gpu_model_runner.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "dflash" or is_pooling_model or custom_logitsprocs:
            return build(vllm_config, device, is_pin_memory, is_pooling_model,
                         custom_logitsprocs)
        from vllm.v1.sample.logits_processor import (
            BUILTIN_LOGITS_PROCESSORS,
            LogitsProcessors,
        )

        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory)
                                for ctor in BUILTIN_LOGITS_PROCESSORS)

    gpu_model_runner.build_logitsprocs = build_logitsprocs

    # vLLM skips the drafter for the whole batch once one request is within a block of
    # max_model_len (a drafter's own position limit). This drafter has none (its RoPE table
    # covers max_model_len + block), and a skipped step would leave that step's tokens out of
    # every other request's drafter context: lower acceptance for the rest of their lives.
    runner = gpu_model_runner.GPUModelRunner
    fits = runner._input_fits_in_drafter

    def input_fits_in_drafter(self, common_attn_metadata) -> bool:
        if isinstance(self.drafter, DFlashProposer):
            return common_attn_metadata is not None
        return fits(self, common_attn_metadata)

    runner._input_fits_in_drafter = input_fits_in_drafter

    # vLLM 0.32 takes its speculative path on every step of a speculative engine: spec-decode
    # metadata and the rejection sampler even when no request has drafts, which is every step
    # while the draft-length policy has drafting off. Such a step is a plain one: vLLM's
    # non-speculative inputs and sampler give the same tokens, and the proposer still gets
    # every token's features (its KV injection). Hybrid targets keep the speculative path: their
    # recurrent state reads zero-draft decode rows at an offset only that path applies.
    prepare_inputs = runner._prepare_inputs

    def prepare_plain_step_inputs(self, scheduler_output, num_scheduled_tokens):
        if (scheduler_output.scheduled_spec_decode_tokens or self.model_config.is_hybrid
                or not isinstance(getattr(self, "drafter", None), DFlashProposer)):
            return prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        speculative_config, self.speculative_config = self.speculative_config, None
        try:
            return prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        finally:
            self.speculative_config = speculative_config

    runner._prepare_inputs = prepare_plain_step_inputs


def _patch_sampling_params() -> None:
    # vLLM refuses min_p and logit_bias for every speculative method; vllm-dflash applies both
    # to the verified rows (use_dflash_verification), so its requests keep them.
    from vllm.sampling_params import SamplingParams

    validate = SamplingParams._validate_spec_decode

    def validate_spec_decode(self, speculative_config) -> None:
        if speculative_config is None or speculative_config.method != "dflash":
            validate(self, speculative_config)

    SamplingParams._validate_spec_decode = validate_spec_decode


def _patch_engine_args() -> None:
    # Check a `method: "dflash"` config where vLLM builds it, in the caller's process: a bad
    # drafter then fails LLM() / `vllm serve` with vllm-dflash's message before any engine
    # process starts, not as "Engine core initialization failed" after one did.
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        _select_dflash_method(self)
        config = create(self, target_model_config, target_parallel_config)
        if config is not None and config.method == "dflash":
            _check_dflash_config(config, target_model_config, target_parallel_config)
        return config

    EngineArgs.create_speculative_config = create_speculative_config


def _patch_v1_draft_checks() -> None:
    # vLLM refuses two kinds of DFlash drafter on the V1 runner, where its own proposer cannot
    # run them: mixed sliding/full layers (it would need a KV cache group per kind) and
    # candidate heads, DFlash2's and LiLiCorr's (it would ignore the head). vllm-dflash keeps
    # every draft layer in one group (a sliding layer masks by its window) and runs both heads.
    from vllm.config import VllmConfig

    VllmConfig._is_dflash_candidate_draft = lambda self: False
    VllmConfig._dflash_needs_multi_kv_group = lambda self: False


def _select_dflash_method(args) -> None:
    """EngineArgs with a DFlash drafter and no method get method "dflash"."""
    spec = args.speculative_config if isinstance(args.speculative_config, dict) else {}
    method = args.spec_method or spec.get("method")
    model = args.spec_model or spec.get("model")
    if method in (None, "draft_model") and is_dflash_checkpoint(model):
        # vLLM detects "dflash" by the drafter's name only; under another name it would run
        # this drafter as a plain draft model, whose drafts are never accepted.
        if method == "draft_model":
            raise DFlashSetupError(
                f'{model!r} is a DFlash drafter (DFlashDraftModel), but the speculative '
                'config has method "draft_model"; set "method": "dflash".'
            )
        logger.info("vllm-dflash: %s is a DFlash drafter; method \"dflash\"", model)
        method = "dflash"
        if args.speculative_config is None:
            args.spec_method = method
        else:
            args.speculative_config = {**spec, "method": method}
    if method == "dflash" and not model:
        raise DFlashSetupError(
            'speculative config has method "dflash" but no "model"; set "model" to the DFlash '
            "drafter checkpoint (a directory with config.json and *.safetensors, or a hub id), "
            'e.g. {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", '
            '"num_speculative_tokens": 15}.'
        )


def _check_dflash_config(config, target_model_config, target_parallel_config) -> None:
    """What would stop the engine later, or run it wrongly, as a start-up error now."""

    from vllm.platforms import current_platform

    from vllm_dflash.proposer import (
        check_weight_shapes,
        drafter_path,
        validate_speculative_config,
    )

    draft_length_mode()
    stages = target_parallel_config.pipeline_parallel_size
    if stages > 1:
        raise DFlashSetupError(
            f'method "dflash" does not run with pipeline parallelism in vLLM 0.32 '
            f"(pipeline_parallel_size={stages}: the first stage has no drafter, as for vLLM's "
            "in-tree DFlash); use tensor parallelism (--tensor-parallel-size) instead."
        )
    if current_platform.is_cpu() and target_model_config.is_hybrid:
        raise DFlashSetupError(
            f"the target {target_model_config.architecture} has recurrent (mamba / "
            "linear-attention) layers; with speculative decoding vLLM 0.32 copies their "
            "state with a Triton kernel that its CPU build lacks (the first request would stop "
            "the engine, for vLLM's in-tree DFlash too); run this target without "
            "--speculative-config on CPU."
        )
    # A hub drafter resolves to its snapshot (fetched here if need be, as the worker would).
    cfg = validate_speculative_config(config, target_model_config)
    check_weight_shapes(drafter_path(config.draft_model_config), cfg)


def is_dflash_checkpoint(model: str | None) -> bool:
    """Whether the config.json of `model`, a directory or a hub id, names DFlashDraftModel."""
    import json
    from pathlib import Path

    from vllm_dflash.checkpoint import is_hub_id

    config = Path(model or "") / "config.json"
    if not config.is_file():
        # Only "org/name": vLLM's method names ("ngram") and proposer paths are no drafters.
        if not model or "/" not in model or Path(model).exists() or not is_hub_id(model):
            return False
        from huggingface_hub import constants, hf_hub_download

        try:  # vLLM fetches the same file next, to build the drafter's model config
            config = Path(hf_hub_download(model, "config.json",
                                          local_files_only=constants.HF_HUB_OFFLINE))
        except OSError:  # not found or not reachable: vLLM's own loading reports it
            return False
    return "DFlashDraftModel" in (json.loads(config.read_text()).get("architectures") or ())


def _patch_engine_core() -> None:
    # The draft-length policy lives beside vLLM's scheduler, in the engine-core process, where
    # acceptance counts and step times are on the host. It starts from a profile of the
    # workers' forward passes, taken once the KV cache and CUDA graphs exist. The hook runs
    # right after EngineCore builds its scheduler (vLLM 0.32 calls
    # _initialize_effective_attention_block_size there); EngineCore.__init__ itself cannot be
    # wrapped: an engine-core process loads this plugin from inside it.
    from vllm.v1.engine.core import EngineCore

    after_scheduler = EngineCore._initialize_effective_attention_block_size

    def attach_draft_policy(self) -> None:
        after_scheduler(self)
        spec = self.vllm_config.speculative_config
        if spec is None or spec.method != "dflash" or draft_length_mode() == "fixed":
            return
        if spec.num_speculative_tokens_per_batch_size:
            logger.info("vllm-dflash: draft length from num_speculative_tokens_per_batch_size")
            return
        from vllm_dflash.draft_policy import DraftPolicy

        profile = self.collective_rpc(_profile_step_costs)[0]
        self.scheduler.vllm_dflash_policy = DraftPolicy(spec.num_speculative_tokens, profile)
        self.scheduler.vllm_dflash_seeded = set()  # ids of the seeded requests it holds
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
    return runner.drafter.profile_step_costs(runner)


def _ms(seconds: list[float]) -> list[float]:
    return [round(s * 1e3, 2) for s in seconds]


class _StepDraftLength:
    """Stands in for vLLM's dynamic-SD table (batch size -> draft length), which the scheduler
    reads once per step: the policy has already chosen this step's length."""

    def __init__(self, num_draft: int) -> None:
        self.num_draft = num_draft

    def __getitem__(self, batch_size: int) -> int:
        return self.num_draft


def _patch_scheduler() -> None:
    # Before each schedule: the policy's lengths cut each request's drafts (the scheduler
    # then schedules 1 + k_r tokens for it) and set how many the drafter proposes next.
    # After each step: what was accepted and how long the step took feed the policy.
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule, update_from_output = Scheduler.schedule, Scheduler.update_from_output
    add_request, free_request = Scheduler.add_request, Scheduler._free_request

    def schedule_with_policy(self, *args, **kwargs):
        policy = getattr(self, "vllm_dflash_policy", None)
        if policy is not None:
            decoding = [r for r in self.running if not r.is_prefill_chunk]
            adaptive = [r for r in decoding if not _is_seeded_sampling(r)]
            plan = policy.plan([r.request_id for r in adaptive])
            for request, length in zip(adaptive, plan.lengths):
                if len(request.spec_token_ids) > length:
                    request.spec_token_ids = request.spec_token_ids[:length]
            # Seeded requests prefilled this step (still waiting now) draft K from the start. The
            # waiting queue (all of an offline batch's prompts) is searched only if the
            # scheduler holds a seeded request at all.
            seeded = len(adaptive) < len(decoding) or (
                bool(self.vllm_dflash_seeded) and any(map(_is_seeded_sampling, self.waiting)))
            num_draft = self.num_spec_tokens if seeded else plan.num_draft
            self.dynamic_sd_lookup = _StepDraftLength(num_draft)
        return schedule(self, *args, **kwargs)

    def update_from_output_with_policy(self, scheduler_output, model_runner_output):
        policy = getattr(self, "vllm_dflash_policy", None)
        if policy is not None:
            _observe_step(policy, scheduler_output, model_runner_output)
        outputs = update_from_output(self, scheduler_output, model_runner_output)
        if policy is not None and not self.has_unfinished_requests():
            policy.idle()
            _log_summary(policy.summary(flush=True))
        return outputs

    def add_request_noting_seeded(self, request) -> None:
        add_request(self, request)
        if getattr(self, "vllm_dflash_policy", None) is not None and _is_seeded_sampling(request):
            self.vllm_dflash_seeded.add(request.request_id)

    def free_request_noting_seeded(self, request, *args, **kwargs):
        if getattr(self, "vllm_dflash_policy", None) is not None:
            self.vllm_dflash_seeded.discard(request.request_id)
        return free_request(self, request, *args, **kwargs)

    Scheduler.schedule = schedule_with_policy
    Scheduler.update_from_output = update_from_output_with_policy
    Scheduler.add_request = add_request_noting_seeded
    Scheduler._free_request = free_request_noting_seeded


def _is_seeded_sampling(request) -> bool:
    # A seeded request draws one random number per verified draft token from its own
    # generator: its output is reproducible only if its draft lengths are, so it always
    # drafts K rather than lengths that depend on measured step times.
    params = request.sampling_params
    return params is not None and params.seed is not None and params.temperature > 0


def _observe_step(policy, scheduler_output, model_runner_output) -> None:
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    drafts = []
    for req_id, draft in scheduler_output.scheduled_spec_decode_tokens.items():
        i = index.get(req_id)
        if i is not None and i < len(sampled) and sampled[i]:
            # sampled: the accepted drafts plus the target's bonus or correction token.
            drafts.append((req_id, len(draft), len(sampled[i]) - 1))
    policy.observe(
        drafts,
        num_tokens=scheduler_output.total_num_scheduled_tokens,
        batch_size=len(scheduler_output.num_scheduled_tokens),
        drafted=scheduler_output.num_spec_tokens_to_schedule > 0,
    )
    _log_summary(policy.summary())


def _log_summary(summary: str | None) -> None:
    if summary:
        logger.info("vllm-dflash: %s", summary)


def _patch_cpu_seeded_chunked_prefill() -> None:
    # vLLM 0.32 samples a token for every scheduled request, also one whose prompt is only
    # partly prefilled, and discards it. So that the discarded sample does not advance a seeded
    # request's generator (its output must not depend on how the prompt was chunked),
    # _bookkeeping_sync rewinds it with Generator.set_offset, which CPU generators lack: the
    # engine stops ("CPU Generator does not use offset"), with or without speculation. On CPU,
    # save those generators' states before sampling and restore them after, which is the
    # rewind done exactly, and keep _bookkeeping_sync from rewinding them again.
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    if not current_platform.is_cpu():
        return

    def sample_keeping_discarded_generators(self, logits, spec_decode_metadata):
        generators = self.input_batch.generators
        num_reqs = self.input_batch.num_reqs
        discarded = self.discard_request_mask.np[:num_reqs].nonzero()[0].tolist()
        saved = {i: generators[i].get_state() for i in discarded if i in generators}
        output = sample(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            generators[i].set_state(state)
        return output

    def bookkeeping_without_rewind(self, *args, **kwargs):
        # input_batch.generators is read in _bookkeeping_sync only for the rewind.
        generators = self.input_batch.generators
        self.input_batch.generators = {}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    GPUModelRunner._sample = sample_keeping_discarded_generators
    GPUModelRunner._bookkeeping_sync = bookkeeping_without_rewind


def use_dflash_verification() -> None:
    """Route vLLM's rejection sampling through vllm-dflash's verification kernel; idempotent.

    Called by the proposer when an engine uses it; vLLM's RejectionSampler keeps its logits
    processing, bonus sampling, logprobs and metrics, only the accept/reject walk is ours.
    """
    from vllm.v1.sample import rejection_sampler

    # Imported now, not inside the first verified step: that step's extra ~6 ms skewed the
    # draft-length policy's first step-cost fit (0.18 ms per draft token, not 0.05), which kept
    # drafts short at C=4 (acceptance 5.8 against 6.7).
    from vllm_dflash.kernels import verify  # noqa: F401

    if rejection_sampler.rejection_sample is rejection_sample:
        return
    rejection_sampler.rejection_sample = rejection_sample
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vLLM 0.32's CPU expand kernel writes into an int64 copy of a float32/int32 output
        # (`_ensure_int64(output)`), so per-request temperature, top_k and top_p reach the
        # rejection sampler as uninitialised memory: sampling breaks for every spec method.
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    constrain = rejection_sampler.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        # A step without drafts reaches the rejection sampler with zero draft rows where it
        # keeps vLLM's speculative path (hybrid targets; other steps run plain): vLLM 0.32's
        # top-k-only path then reduces an empty tensor and crashed on CPU. Zero rows need nothing.
        if logits.shape[0] == 0:
            return logits
        # vLLM's sampler applies min_p after the temperature and before top-k/top-p.
        min_p = _processor(sampling_metadata.logitsprocs.argmax_invariant, "MinPLogitsProcessor")
        if min_p is not None and min_p.min_p_count and not sampling_metadata.all_greedy:
            mask_below_min_p(logits, cu_num_draft_tokens, sampling_metadata.temperature,
                             min_p.min_p.view(-1))  # [B], on the device
        return constrain(logits, cu_num_draft_tokens, sampling_metadata)

    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints
    sampler = rejection_sampler.RejectionSampler
    process = sampler.apply_logits_processors

    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        # vLLM's sampler adds logit biases before penalties; per draft row here.
        bias = _processor(sampling_metadata.logitsprocs.non_argmax_invariant,
                          "LogitBiasLogitsProcessor")
        if bias is not None and bias.biases:
            add_logit_bias(logits, bias.biases, metadata.num_draft_tokens)
        return process(self, logits, sampling_metadata, metadata)

    sampler.apply_logits_processors = apply_logits_processors
    init, forward = sampler.__init__, sampler.forward

    def __init__(self, sampler_, spec_config=None, device=None):
        init(self, sampler_, spec_config, device)
        # vLLM 0.32 has block verification only in Model Runner V2; its V1 runners ignore it.
        self.block_verification = getattr(spec_config, "rejection_sample_method", "") == "block"

    def forward_with_method(self, *args, **kwargs):
        token = _block_verification.set(getattr(self, "block_verification", False))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _block_verification.reset(token)

    sampler.__init__, sampler.forward = __init__, forward_with_method


def rejection_sample(*args: Any, **kwargs: Any) -> torch.Tensor:
    """vLLM's rejection_sample, replaced: vllm-dflash's verification, block or token by token
    as the running RejectionSampler's config says."""
    from vllm_dflash.kernels.verify import vllm_rejection_sample

    return vllm_rejection_sample(*args, **kwargs, block_verification=_block_verification.get())


def _processor(processors: list, name: str) -> Any:
    """vLLM's built-in logits processor of that class name, if the engine has it."""
    return next((p for p in processors if type(p).__name__ == name), None)


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


def target_head(target: torch.nn.Module, lora: bool) -> tuple[Callable, Callable]:
    """The target's token embedding and logits, as the drafter calls them: ids -> embeddings,
    hidden states -> logits.

    With LoRA on, vLLM wraps the embedding, lm_head and logits processor in adapter layers that
    index the target's own batch of tokens; the drafter's batch is another, so it runs their
    base layers. Adapters apply to the target alone: verification by the adapted target keeps
    the output exact, only acceptance can change.
    """
    if not lora:
        return target.embed_input_ids, target.compute_logits
    from vllm.lora.layers import BaseLayerWithLoRA

    def base(module: torch.nn.Module) -> torch.nn.Module:
        return module.base_layer if isinstance(module, BaseLayerWithLoRA) else module

    model = target.get_language_model() if hasattr(target, "get_language_model") else target
    inner = getattr(model, "model", None)
    found = {"model.embed_tokens": hasattr(inner, "embed_tokens"),
             "lm_head": hasattr(model, "lm_head"),
             "logits_processor": hasattr(model, "logits_processor")}
    missing = [name for name, present in found.items() if not present]
    if missing:
        raise DFlashSetupError(
            f"vllm-dflash with LoRA needs the target's base embedding and lm_head, but "
            f"{type(model).__name__} has no {', '.join(missing)}. Run without --enable-lora, or "
            f"set {IMPL_ENV}=vllm."
        )
    embed_tokens, lm_head = base(inner.embed_tokens), base(model.lm_head)
    logits_processor = base(model.logits_processor)
    return embed_tokens, lambda hidden: logits_processor(lm_head, hidden)


def use_vllm_cpu_gemm(module: torch.nn.Module) -> None:
    """Runs every nn.Linear of `module` through vLLM's CPU GEMM, as vLLM's own linear layers
    do: oneDNN on a weight packed once at load (2.2-2.4x torch's F.linear at the test
    drafter's shapes on an AMD EPYC, whose MKL path is slow), where vLLM's build has it. The
    unpacked weights are freed as vLLM frees its own, so read any (kv_weight) before."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for linear in module.modules():
        if isinstance(linear, torch.nn.Linear):
            dispatch_cpu_unquantized_gemm(linear, remove_weight=True)
            # The weight left is empty where packed (and unused), the layer's own otherwise.
            linear.forward = partial(linear.cpu_linear, weight=linear.weight, bias=linear.bias)


def runner_name(runner: object) -> str:
    name = type(runner).__name__
    if name not in ("GPUModelRunner", "CPUModelRunner"):
        raise DFlashSetupError(
            f"vllm-dflash does not support the model runner {name}; supported: "
            f"{', '.join(SUPPORTED_RUNNERS)}. Set {IMPL_ENV}=vllm for vLLM's in-tree DFlash."
        )
    return name
