"""vLLM's rejection sampler: a vllm-dflash engine verifies with vllm-dflash's kernel.

vLLM's RejectionSampler keeps its logits processing, bonus sampling, logprobs and metrics; only
the accept/reject walk is ours, plus the per-request sampling parameters vLLM 0.32 does not
apply to draft rows. The sampler of any other engine runs exactly as vLLM's: the running
sampler's verification (None for other engines) travels in a context variable to the
module-level functions vLLM's forward calls, which see no sampler or config.
Checked on vLLM 0.32.0 and 0.33.0.
"""

import contextvars
import functools
from dataclasses import dataclass
from typing import Any

from vllm_dflash import sampling_rows
from vllm_dflash.kernels import verify
from vllm_dflash.vllm.config import runs_vllm_dflash

# vLLM 0.33 passes FLy's window and thresholds; a vllm-dflash engine refuses "fly" at start-up
# (config.py), so they are always the off values here.
FLY_ARGS = ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")


@dataclass(frozen=True)
class Verification:
    """How a vllm-dflash engine's RejectionSampler verifies."""

    block: bool  # rejection_sample_method="block"


_running: contextvars.ContextVar[Verification | None] = contextvars.ContextVar(
    "vllm_dflash_verification", default=None)


def patch_rejection_sampler() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    rejection_sampler_cls = rejection_sampler.RejectionSampler
    init, forward = rejection_sampler_cls.__init__, rejection_sampler_cls.forward
    process = rejection_sampler_cls.apply_logits_processors
    vllm_rejection_sample = rejection_sampler.rejection_sample
    vllm_constrain = rejection_sampler.apply_sampling_constraints
    vllm_expand = rejection_sampler.expand_batch_to_tokens

    @functools.wraps(init)
    def __init__(self, sampler, spec_config=None, device=None):
        init(self, sampler, spec_config, device)
        # vLLM 0.32 has block verification only in Model Runner V2; its V1 runners ignore it.
        self.vllm_dflash = (
            Verification(block=spec_config.rejection_sample_method == "block")
            if runs_vllm_dflash(spec_config) else None)

    @functools.wraps(forward)
    def forward_with_verification(self, *args, **kwargs):
        token = _running.set(getattr(self, "vllm_dflash", None))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _running.reset(token)

    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        if getattr(self, "vllm_dflash", None) is not None:
            # vLLM's sampler adds logit biases before penalties; per draft row here.
            bias = _processor(sampling_metadata.logitsprocs.non_argmax_invariant,
                              "LogitBiasLogitsProcessor")
            if bias is not None and bias.biases:
                sampling_rows.add_logit_bias(logits, bias.biases, metadata.num_draft_tokens)
        return process(self, logits, sampling_metadata, metadata)

    @functools.wraps(vllm_rejection_sample)
    def rejection_sample(*args: Any, **kwargs: Any):
        verification = _running.get()
        if verification is None:
            return vllm_rejection_sample(*args, **kwargs)
        for name in FLY_ARGS:
            kwargs.pop(name, None)
        return verify.vllm_rejection_sample(*args, **kwargs,
                                            block_verification=verification.block)

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if _running.get() is None:
            return vllm_constrain(logits, cu_num_draft_tokens, sampling_metadata)
        # A step without drafts reaches the rejection sampler with zero draft rows where it
        # keeps vLLM's speculative path (hybrid targets; other steps run plain): vLLM 0.32's
        # top-k-only path then reduces an empty tensor and crashed on CPU. Zero rows need nothing.
        if logits.shape[0] == 0:
            return logits
        # vLLM's sampler applies min_p after the temperature and before top-k/top-p.
        min_p = _processor(sampling_metadata.logitsprocs.argmax_invariant, "MinPLogitsProcessor")
        if min_p is not None and min_p.min_p_count and not sampling_metadata.all_greedy:
            sampling_rows.mask_below_min_p(logits, cu_num_draft_tokens,
                                           sampling_metadata.temperature, min_p.min_p.view(-1))
        return vllm_constrain(logits, cu_num_draft_tokens, sampling_metadata)

    @functools.wraps(vllm_expand)
    def expand_batch_to_tokens(*args: Any, **kwargs: Any):
        # vLLM 0.32's CPU expand kernel writes into an int64 copy of a float32/int32 output
        # (`_ensure_int64(output)`), so per-request temperature, top_k and top_p reach the
        # rejection sampler as uninitialised memory: sampling breaks for every spec method.
        expand = vllm_expand if _running.get() is None else sampling_rows.expand_batch_to_tokens
        return expand(*args, **kwargs)

    rejection_sampler_cls.__init__ = __init__
    rejection_sampler_cls.forward = forward_with_verification
    rejection_sampler_cls.apply_logits_processors = apply_logits_processors
    rejection_sampler.rejection_sample = rejection_sample
    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints
    if current_platform.is_cpu():
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def _processor(processors: list, name: str) -> Any:
    """vLLM's built-in logits processor of that class name, if the engine has it."""
    return next((p for p in processors if type(p).__name__ == name), None)
