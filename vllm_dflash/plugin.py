"""The one module that touches vLLM internals: registration, patches and version checks.

vLLM loads `register()` through the `vllm.general_plugins` entry point in every process
(API server, engine core, workers). A new vLLM version should only need changes here.
"""

import logging
import os

import torch

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
IMPL_ENV = "VLLM_DFLASH_IMPL"
# "vllm-dflash": this package's proposer, drafter and kernels; "vllm": vLLM's in-tree DFlash.
IMPLEMENTATIONS = ("vllm-dflash", "vllm")
SUPPORTED_RUNNERS = ("GPUModelRunner (V1)", "CPUModelRunner")

_registered = False


class DFlashSetupError(RuntimeError):
    """vLLM or the environment cannot run vllm-dflash; the message says how to fix it."""


def selected_implementation() -> str:
    impl = os.environ.get(IMPL_ENV, "vllm-dflash").strip() or "vllm-dflash"
    if impl not in IMPLEMENTATIONS:
        raise DFlashSetupError(
            f"{IMPL_ENV}={impl!r} is not a known DFlash implementation; "
            f"valid values: {', '.join(IMPLEMENTATIONS)} (unset means vllm-dflash)."
        )
    return impl


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
    """Entry point of `vllm.general_plugins`; idempotent."""
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
    _patch_runner()
    _patch_engine_args()
    _registered = True


def _patch_runner() -> None:
    # The V1 runner (and CPUModelRunner, its subclass) builds and type-checks its drafter
    # through the module-level name `DFlashProposer`; rebinding it swaps in ours everywhere.
    from vllm.v1.worker import gpu_model_runner

    from vllm_dflash.proposer import DFlashProposer

    gpu_model_runner.DFlashProposer = DFlashProposer


def _patch_engine_args() -> None:
    # Check a `method: "dflash"` config where vLLM builds it, in the caller's process: a bad
    # drafter then fails LLM() / `vllm serve` with vllm-dflash's message before any engine
    # process starts, not as "Engine core initialization failed" after one did.
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_speculative_config
    if getattr(create, "vllm_dflash", False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config if isinstance(self.speculative_config, dict) else {}
        method = self.spec_method or spec.get("method")
        if method == "dflash" and not (self.spec_model or spec.get("model")):
            raise DFlashSetupError(
                'speculative config has method "dflash" but no "model"; set "model" to the '
                "DFlash drafter checkpoint (a directory with config.json and *.safetensors, or "
                'a hub id), e.g. {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", '
                '"num_speculative_tokens": 15}.'
            )
        config = create(self, target_model_config, target_parallel_config)
        if config is not None and config.method == "dflash":
            from pathlib import Path

            from vllm_dflash.proposer import check_weight_shapes, validate_speculative_config

            drafter_dir = config.draft_model_config.model
            if Path(drafter_dir).is_dir():  # anything else is left to the worker
                cfg = validate_speculative_config(config, target_model_config)
                check_weight_shapes(drafter_dir, cfg)
        return config

    create_speculative_config.vllm_dflash = True
    EngineArgs.create_speculative_config = create_speculative_config


def use_dflash_verification() -> None:
    """Route vLLM's rejection sampling through vllm-dflash's verification kernel; idempotent.

    Called by the proposer when an engine uses it; vLLM's RejectionSampler keeps its logits
    processing, bonus sampling, logprobs and metrics, only the accept/reject walk is ours.
    """
    from vllm.v1.sample import rejection_sampler

    from vllm_dflash.kernels.verify import vllm_rejection_sample

    if rejection_sampler.rejection_sample is vllm_rejection_sample:
        return
    rejection_sampler.rejection_sample = vllm_rejection_sample
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vLLM 0.32's CPU expand kernel writes into an int64 copy of a float32/int32 output
        # (`_ensure_int64(output)`), so per-request temperature, top_k and top_p reach the
        # rejection sampler as uninitialised memory: sampling breaks for every spec method.
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    constrain = rejection_sampler.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        # vLLM 0.32 runs the rejection sampler on steps with zero draft rows (prefills); its
        # top-k-only path then reduces an empty tensor and crashes. Zero rows need nothing.
        if logits.shape[0] == 0:
            return logits
        return constrain(logits, cu_num_draft_tokens, sampling_metadata)

    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints


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


def runner_name(runner: object) -> str:
    name = type(runner).__name__
    if name not in ("GPUModelRunner", "CPUModelRunner"):
        raise DFlashSetupError(
            f"vllm-dflash does not support the model runner {name}; supported: "
            f"{', '.join(SUPPORTED_RUNNERS)}. Set {IMPL_ENV}=vllm for vLLM's in-tree DFlash."
        )
    return name
