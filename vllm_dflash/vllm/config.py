"""vLLM's engine configuration: which engines vllm-dflash runs, the checks at start-up, and the
runner a DFlash engine gets.

An engine is vllm-dflash's when its speculative config has method "dflash" and
VLLM_DFLASH_IMPL does not select vLLM's own DFlash (`runs_vllm_dflash`). Every patch here
returns vLLM's own answer for any other engine.
"""

import json
import logging
import os
from pathlib import Path
from typing import Any

from vllm_dflash import checkpoint, speculators
from vllm_dflash.config import (
    DFLASH2,
    LILICORR,
    DFlashConfig,
    DFlashConfigError,
    validate_against_target,
)
from vllm_dflash.vllm import contract

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler

IMPL_ENV = "VLLM_DFLASH_IMPL"
# "vllm-dflash": this package's proposer, drafter and kernels; "vllm": vLLM's in-tree DFlash.
IMPLEMENTATIONS = ("vllm-dflash", "vllm")
DRAFT_LENGTH_ENV = "VLLM_DFLASH_DRAFT_LENGTH"
# "adaptive": draft_policy.py picks 0..K draft tokens per request every step; "fixed": always K.
DRAFT_LENGTHS = ("adaptive", "fixed")
DRAFT_HEAD_ENV = "VLLM_DFLASH_DRAFT_HEAD"
# "target": draft logits through the target's own lm_head; "bfloat16": through a bf16 copy of
# it (an fp32 target's head is most of a small drafter's step; drafts are only proposals, so
# verification by the fp32 target keeps the output exact).
DRAFT_HEADS = ("target", "bfloat16")
PROMPT_LOOKUP_ENV = "VLLM_DFLASH_PROMPT_LOOKUP"
# "on": a request whose last tokens occurred before in its context drafts what followed them
# there instead of the drafter's tokens (prompt_lookup.py).
PROMPT_LOOKUPS = ("off", "on")
# What a vllm-dflash engine cannot do on Model Runner V2, as vLLM's own start-up line prints it
# when it then picks the V1 runner. Drafts sampled by a DFlash2 or LiLiCorr drafter: their
# drafts are a selector's walk, which MRV2's draft sampler cannot draw (the speculator drafts
# them greedy). LoRA: vLLM 0.32's MRV2 maps adapters per request, not per verified token, and
# its CPU LoRA logits fail on any speculator's verification rows (its in-tree DFlash's too).
V2_UNSUPPORTED_SAMPLED_SELECTOR = (
    "vllm-dflash's sampled drafts (draft_sample_method='probabilistic') of DFlash2 and LiLiCorr "
    "drafters (VLLM_USE_V2_MODEL_RUNNER=1 runs them greedy)")
V2_UNSUPPORTED_LORA = "LoRA with vllm-dflash's speculation"
# Block verification: vllm-dflash's runs in its V1 sampler (sampler.py); on MRV2 the speculator
# hands verification to MRV2's own rejection sampler, whose block mode is not vllm-dflash's.
V2_UNSUPPORTED_BLOCK = "vllm-dflash's block verification (rejection_sample_method='block')"
SELECTOR_ARCHITECTURES = {DFLASH2, LILICORR}


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


def draft_head_mode() -> str:
    return _env_choice(DRAFT_HEAD_ENV, DRAFT_HEADS, "a draft head")


def prompt_lookup_on() -> bool:
    return _env_choice(PROMPT_LOOKUP_ENV, PROMPT_LOOKUPS, "a prompt-lookup setting") == "on"


def copies_bf16_draft_head(target_model_config: Any) -> bool:
    """VLLM_DFLASH_DRAFT_HEAD=bfloat16 asks for a bf16 copy of the target's lm_head; a bf16
    target's own head is one already, and stays the draft head."""
    return draft_head_mode() == "bfloat16" and str(target_model_config.dtype) != "torch.bfloat16"


def steps_aside() -> bool:
    """VLLM_DFLASH_IMPL=vllm: every engine runs exactly as vLLM alone runs it."""
    return os.environ.get(IMPL_ENV, "").strip() == "vllm"


def runs_vllm_dflash(speculative_config: Any) -> bool:
    """Whether an engine with this SpeculativeConfig (or None) runs vllm-dflash."""
    return (speculative_config is not None and speculative_config.method == "dflash"
            and not steps_aside())


def check_vllm(version: str, problems: list[str]) -> None:
    """Start-up check of a vllm-dflash engine: every hook in contract.HOOKS is there."""
    supported = f"vLLM {contract.SUPPORTED_RANGE} (checked: {', '.join(contract.CHECKED_VERSIONS)})"
    if problems:
        raise DFlashSetupError(
            f"vllm-dflash cannot run on vLLM {version}: these hooks it relies on are missing or "
            f"changed: {'; '.join(problems)}. vllm-dflash supports {supported}; install one of "
            f"those, or set {IMPL_ENV}=vllm for vLLM's in-tree DFlash."
        )
    if version.split("+")[0] not in contract.CHECKED_VERSIONS:
        logger.warning("vllm-dflash: vLLM %s was not checked (supported: %s); every hook it "
                       "relies on is there, so it runs", version, supported)


def patch_engine_args(problems: list[str]) -> None:
    # Check a `method: "dflash"` config where vLLM builds it, in the caller's process: a bad
    # drafter or vLLM then fails LLM() / `vllm serve` with vllm-dflash's message before any
    # engine process starts, not as "Engine core initialization failed" after one did.
    # Checked on vLLM 0.32.0 and 0.33.0.
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        _select_dflash_method(self)
        config = create(self, target_model_config, target_parallel_config)
        if runs_vllm_dflash(config):
            selected_implementation()
            check_vllm(vllm.__version__, problems)
            _check_dflash_config(config, target_model_config, target_parallel_config)
        return config

    EngineArgs.create_speculative_config = create_speculative_config


def patch_config() -> None:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

    # vLLM refuses min_p and logit_bias for every speculative method; vllm-dflash applies both
    # to the verified rows (sampler.py), so its requests keep them. Checked on 0.32.0, 0.33.0.
    validate = SamplingParams._validate_spec_decode

    def validate_spec_decode(self, speculative_config) -> None:
        if not runs_vllm_dflash(speculative_config):
            validate(self, speculative_config)

    SamplingParams._validate_spec_decode = validate_spec_decode

    # The runner: vLLM picks Model Runner V2 (where Triton runs, unless VLLM_USE_V2_MODEL_RUNNER
    # says otherwise) when no feature of the engine is on its list of what V2 does not support.
    # A vllm-dflash engine adds what its MRV2 speculator does not do, so it runs where vLLM
    # would run it, and vLLM logs "Model Runner V2 does not yet support ...; using the V1
    # model runner" otherwise. Checked on 0.32.0 and 0.33.0.
    v2_unsupported = VllmConfig._get_v2_model_runner_unsupported_features

    def get_v2_model_runner_unsupported_features(self) -> list[str]:
        unsupported = v2_unsupported(self)
        if runs_vllm_dflash(self.speculative_config):
            unsupported += speculator_unsupported(self)
        return unsupported

    VllmConfig._get_v2_model_runner_unsupported_features = get_v2_model_runner_unsupported_features

    # vLLM refuses two kinds of DFlash drafter on the V1 runner, where its own proposer cannot
    # run them: mixed sliding/full layers (it would need a KV cache group per kind) and
    # candidate heads, DFlash2's and LiLiCorr's (it would ignore the head). vllm-dflash keeps
    # every draft layer in one group (a sliding layer masks by its window) and runs both heads.
    # Checked on 0.32.0 and 0.33.0 (where the candidate check also gates watermarking, which
    # needs Model Runner V2: vLLM's V2 check then refuses the engine, naming vllm-dflash).
    for name in ("_is_dflash_candidate_draft", "_dflash_needs_multi_kv_group"):
        setattr(VllmConfig, name, _false_for_vllm_dflash(getattr(VllmConfig, name)))


def speculator_unsupported(vllm_config: Any) -> list[str]:
    """What of a vllm-dflash engine's VllmConfig does not run on Model Runner V2."""
    spec = vllm_config.speculative_config
    unsupported = []
    architectures = set(spec.draft_model_config.architectures or [])
    if spec.draft_sample_method == "probabilistic" and architectures & SELECTOR_ARCHITECTURES:
        unsupported.append(V2_UNSUPPORTED_SAMPLED_SELECTOR)
    if vllm_config.lora_config is not None:
        unsupported.append(V2_UNSUPPORTED_LORA)
    if spec.rejection_sample_method == "block":
        unsupported.append(V2_UNSUPPORTED_BLOCK)
    return unsupported


def _false_for_vllm_dflash(check):
    def patched(self) -> bool:
        return False if runs_vllm_dflash(self.speculative_config) else check(self)

    return patched


def _select_dflash_method(args) -> None:
    """EngineArgs with a DFlash drafter and no method get method "dflash"."""
    if steps_aside():
        return
    spec = args.speculative_config if isinstance(args.speculative_config, dict) else {}
    method = args.spec_method or spec.get("method")
    model = args.spec_model or spec.get("model")
    if method in (None, "draft_model") and is_dflash_checkpoint(model):
        # vLLM detects "dflash" by the drafter's name only; under another name it would run
        # this drafter as a plain draft model, whose drafts are never accepted.
        if method == "draft_model":
            raise DFlashSetupError(
                f'{model!r} is a DFlash drafter, but the speculative '
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

    draft_length_mode()
    prompt_lookup_on()
    if getattr(config, "rejection_sample_method", "standard") == "fly":
        raise DFlashSetupError(
            'rejection_sample_method "fly" is lossy (it accepts drafts the target would not '
            "have produced); vllm-dflash verifies exactly. Use \"standard\" or \"block\", or "
            f"set {IMPL_ENV}=vllm for vLLM's in-tree DFlash with FLy."
        )
    stages = target_parallel_config.pipeline_parallel_size
    if stages > 1:
        raise DFlashSetupError(
            f'method "dflash" does not run with pipeline parallelism '
            f"(pipeline_parallel_size={stages}: the first stage has no drafter, as for vLLM's "
            "in-tree DFlash on the V1 runner); use tensor parallelism (--tensor-parallel-size)."
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
    checkpoint.check_weight_shapes(drafter_path(config.draft_model_config), cfg)
    if copies_bf16_draft_head(target_model_config):
        _check_bf16_draft_head(cfg, target_parallel_config)


def _check_bf16_draft_head(cfg: DFlashConfig, target_parallel_config: Any) -> None:
    ranks = target_parallel_config.tensor_parallel_size
    if ranks > 1:
        raise DFlashSetupError(
            f"{DRAFT_HEAD_ENV}=bfloat16 copies the whole lm_head, but with "
            f"tensor_parallel_size={ranks} each rank holds a shard of it; unset "
            f"{DRAFT_HEAD_ENV} with tensor parallelism.")
    if cfg.architecture in SELECTOR_ARCHITECTURES:
        raise DFlashSetupError(
            f"{DRAFT_HEAD_ENV}=bfloat16 is for DFlash drafters; a {cfg.architecture} drafter "
            f"picks its drafts from candidates that need the target's own logits; unset "
            f"{DRAFT_HEAD_ENV}.")


def validate_speculative_config(spec: Any, target: Any) -> DFlashConfig:
    """Check a `method: "dflash"` SpeculativeConfig against the target's ModelConfig.

    Runs in the worker before the drafter loads, and earlier in the front-end process at
    config time, where an error reaches the caller before any engine starts.
    """
    cfg = checkpoint.read_config(drafter_path(spec.draft_model_config))
    validate_against_target(
        cfg,
        target_hidden_size=target.get_hidden_size(),
        target_num_layers=target.hf_text_config.num_hidden_layers,
        target_vocab_size=target.get_vocab_size(),
        num_speculative_tokens=spec.num_speculative_tokens,
        dtype=target.dtype,
    )
    if spec.kv_cache_dtype not in (None, "auto"):
        raise DFlashConfigError(
            f"kv_cache_dtype={spec.kv_cache_dtype!r} for the drafter: vllm-dflash keeps the "
            "drafter's context cache in the model dtype (its KV injection and draft attention "
            "kernels read no scales); fix: remove kv_cache_dtype from --speculative-config (the "
            "target's own --kv-cache-dtype is unaffected)."
        )
    if spec.draft_model_config.quantization is not None:
        raise DFlashConfigError(
            f"quantization={spec.draft_model_config.quantization!r} for the drafter: vllm-dflash "
            "runs the drafter unquantized, in the target's dtype; fix: remove quantization from "
            "--speculative-config (the target's own --quantization is unaffected) or use an "
            "unquantized drafter checkpoint."
        )
    if spec.disable_padded_drafter_batch:
        raise DFlashConfigError(
            "disable_padded_drafter_batch=True: vllm-dflash drafts the padded batch (every "
            "request's block in one pass, rejected tokens masked on the device); remove "
            "disable_padded_drafter_batch from --speculative-config."
        )
    return cfg


def drafter_path(draft_model_config: Any) -> Path:
    """The drafter's directory: the model's own, or a hub id's snapshot at the revision asked
    for (vLLM pins it to a commit, default main)."""
    revision = draft_model_config.revision
    return checkpoint.drafter_dir(draft_model_config.model,
                                  None if revision is None else str(revision))


def is_dflash_checkpoint(model: str | None) -> bool:
    """Whether the config.json of `model`, a directory or a hub id, is a DFlash drafter's
    (z-lab or speculators schema)."""
    config = Path(model or "") / "config.json"
    if not config.is_file():
        # Only "org/name": vLLM's method names ("ngram") and proposer paths are no drafters.
        if (not model or "/" not in model or Path(model).exists()
                or not checkpoint.is_hub_id(model)):
            return False
        from huggingface_hub import constants, hf_hub_download

        try:  # vLLM fetches the same file next, to build the drafter's model config
            config = Path(hf_hub_download(model, "config.json",
                                          local_files_only=constants.HF_HUB_OFFLINE))
        except OSError:  # not found or not reachable: vLLM's own loading reports it
            return False
    return speculators.is_dflash_config(json.loads(config.read_text()))
