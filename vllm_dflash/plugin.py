"""The one module that touches vLLM internals: registration, patches and version checks.

vLLM loads `register()` through the `vllm.general_plugins` entry point in every process
(API server, engine core, workers). A new vLLM version should only need changes here.
"""

import logging
import os

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
    _registered = True


def _patch_runner() -> None:
    # The V1 runner (and CPUModelRunner, its subclass) builds and type-checks its drafter
    # through the module-level name `DFlashProposer`; rebinding it swaps in ours everywhere.
    from vllm.v1.worker import gpu_model_runner

    from vllm_dflash.proposer import DFlashProposer

    gpu_model_runner.DFlashProposer = DFlashProposer


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
    constrain = rejection_sampler.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        # vLLM 0.32 runs the rejection sampler on steps with zero draft rows (prefills); with
        # top-k alone, its CPU top-k path then reduces an empty tensor and crashes.
        if logits.shape[0] == 0:
            return logits
        return constrain(logits, cu_num_draft_tokens, sampling_metadata)

    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints


def runner_name(runner: object) -> str:
    name = type(runner).__name__
    if name not in ("GPUModelRunner", "CPUModelRunner"):
        raise DFlashSetupError(
            f"vllm-dflash does not support the model runner {name}; supported: "
            f"{', '.join(SUPPORTED_RUNNERS)}. Set {IMPL_ENV}=vllm for vLLM's in-tree DFlash."
        )
    return name
