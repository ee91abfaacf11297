"""The vLLM hooks vllm-dflash patches or calls, and the checks that they are there.

Every vLLM symbol this folder wraps, rebinds, subclasses or calls is listed in HOOKS with the
parameters it relies on. A DFlash engine checks them at start-up against the running vLLM
(`broken_hooks`); `broken_hooks_in_sources` runs the same check on a release's source files,
read and not imported, so a vLLM wheel can be checked before it is installed
(`python scripts/check_vllm_hooks.py --release X.Y.Z`).
"""

import ast
import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

# The releases whose hooks and behaviour the code here was checked against.
CHECKED_VERSIONS = ("0.32.0", "0.33.0")
SUPPORTED_RANGE = ">=0.32,<0.34"


@dataclass(frozen=True)
class Hook:
    module: str  # "vllm.v1.core.sched.scheduler"
    name: str  # "Scheduler.schedule": a module-level name or Class.attribute
    params: tuple[str, ...] = ()  # parameter names the code here passes or reads

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


HOOKS = (
    # config.py: start-up checks and the runner choice.
    Hook("vllm.engine.arg_utils", "EngineArgs.create_speculative_config",
         ("target_model_config", "target_parallel_config")),
    Hook("vllm.sampling_params", "SamplingParams._validate_spec_decode", ("speculative_config",)),
    Hook("vllm.config.vllm", "VllmConfig._get_v2_model_runner_unsupported_features"),
    Hook("vllm.config.vllm", "VllmConfig._is_dflash_candidate_draft"),
    Hook("vllm.config.vllm", "VllmConfig._dflash_needs_multi_kv_group"),
    # runner.py: the V1 runner builds the proposer and runs drafts; MRV2 its speculator.
    Hook("vllm.v1.worker.gpu.spec_decode", "init_speculator",
         ("vllm_config", "device", "req_states")),
    Hook("vllm.v1.worker.gpu_model_runner", "DFlashProposer"),
    Hook("vllm.v1.worker.gpu_model_runner", "build_logitsprocs",
         ("vllm_config", "device", "is_pin_memory", "is_pooling_model", "custom_logitsprocs")),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._input_fits_in_drafter",
         ("common_attn_metadata",)),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs",
         ("scheduler_output", "num_scheduled_tokens")),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids",
         ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
          "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
          "common_attn_metadata", "slot_mappings")),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._get_positions",
         ("num_tokens",)),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample",
         ("logits", "spec_decode_metadata")),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._dummy_run",
         ("num_tokens", "force_attention", "profile_seq_lens")),
    Hook("vllm.v1.sample.logits_processor", "BUILTIN_LOGITS_PROCESSORS"),
    Hook("vllm.v1.sample.logits_processor", "LogitsProcessors"),
    # scheduler.py: the draft-length policy beside the scheduler.
    Hook("vllm.v1.engine.core", "EngineCore._initialize_effective_attention_block_size"),
    Hook("vllm.v1.engine.core", "EngineCore.collective_rpc", ("method",)),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
         ("scheduler_output", "model_runner_output")),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler.add_request", ("request",)),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler._free_request", ("request",)),
    # sampler.py: verification.
    Hook("vllm.v1.sample.rejection_sampler", "rejection_sample",
         ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens",
          "draft_probs", "target_logits", "bonus_token_ids", "sampling_metadata",
          "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel")),
    Hook("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens",
         ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),
    Hook("vllm.v1.sample.rejection_sampler", "apply_sampling_constraints",
         ("logits", "cu_num_draft_tokens", "sampling_metadata")),
    Hook("vllm.v1.sample.rejection_sampler", "RejectionSampler.__init__",
         ("sampler", "spec_config", "device")),
    Hook("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward"),
    Hook("vllm.v1.sample.rejection_sampler", "RejectionSampler.apply_logits_processors",
         ("logits", "sampling_metadata", "metadata")),
    # spec_decode.py: the proposer and its draft KV layers.
    Hook("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.__init__",
         ("vllm_config", "device", "pass_hidden_states_to_model", "runner")),
    Hook("vllm.v1.spec_decode.llm_base_proposer",
         "SpecDecodeBaseProposer.prepare_next_token_ids_padded",
         ("sampled_token_ids", "requests", "discard_request_mask")),
    Hook("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase"),
    Hook("vllm.model_executor.models.interfaces", "supports_eagle3"),
    Hook("vllm.v1.attention.backend", "AttentionBackend"),
    Hook("vllm.v1.attention.backend", "AttentionMetadataBuilder"),
    Hook("vllm.v1.attention.backend", "CommonAttentionMetadata"),
    Hook("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    # model_executor.py: the target's head and vLLM's CPU GEMM for the drafter.
    Hook("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm",
         ("layer", "remove_weight")),
    Hook("vllm.lora.layers", "BaseLayerWithLoRA"),
    # A bf16 draft head applies the target's logit soft cap and scale to its vocabulary rows.
    Hook("vllm.model_executor.layers.logits_processor", "LogitsProcessor.__init__",
         ("org_vocab_size", "scale", "soft_cap")),
)


# speculator.py, checked when Model Runner V2 builds vllm-dflash's speculator: MRV2's modules
# load only in its worker, after the CPU build's patches to torch.
MRV2_HOOKS = (
    Hook("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.__init__",
         ("vllm_config", "device")),
    Hook("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.load_model",
         ("target_model",)),
    Hook("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.load_draft_model",
         ("target_model", "target_attn_layer_names")),
    Hook("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.set_attn",
         ("model_state", "kv_cache_config", "block_tables", "target_input_buffers",
          "target_attn_groups")),
    Hook("vllm.v1.worker.gpu.spec_decode.speculator", "BaseSpeculator.propose",
         ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
          "aux_hidden_states", "num_sampled", "num_rejected", "last_sampled",
          "next_prefill_tokens", "temperature", "seeds", "dummy_run", "num_speculative_tokens")),
    Hook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner._dummy_run",
         ("num_tokens", "context_len")),
)


def broken_hooks(hooks: tuple[Hook, ...] = HOOKS) -> list[str]:
    """What is missing or changed in the running vLLM, one line per hook; empty if none."""
    problems = []
    for hook in hooks:
        try:
            obj = importlib.import_module(hook.module)
            for part in hook.name.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as error:
            problems.append(f"{hook}: missing ({error})")
            continue
        if hook.params:
            problems += _missing_params(hook, _parameters(obj))
    return problems


def broken_hooks_in_sources(root: Path, hooks: tuple[Hook, ...] = HOOKS + MRV2_HOOKS
                            ) -> list[str]:
    """The same check on a vLLM source tree (the directory holding `vllm/`), by reading each
    module's file: top-level names defined, imported or assigned there, and the methods a
    class body defines."""
    problems = []
    trees: dict[str, ast.Module | None] = {}
    for hook in hooks:
        if hook.module not in trees:
            trees[hook.module] = _parse_module(root, hook.module)
        tree = trees[hook.module]
        if tree is None:
            problems.append(f"{hook}: missing (no module {hook.module})")
            continue
        node = _find(tree, hook.name.split("."))
        if node is None:
            problems.append(f"{hook}: missing (not defined in {hook.module})")
        elif hook.params and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            problems += _missing_params(hook, names)
    return problems


def _parameters(obj: object) -> list[str]:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return []


def _missing_params(hook: Hook, names: list[str]) -> list[str]:
    missing = [p for p in hook.params if p not in names]
    return [f"{hook}: no parameter {', '.join(missing)}"] if missing else []


def _parse_module(root: Path, module: str) -> ast.Module | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return ast.parse(path.read_text(), filename=str(path))
    return None


def _find(tree: ast.Module, parts: list[str]) -> ast.AST | None:
    """The definition of parts[0] at the module's top level (and parts[1] in its class body)."""
    node = _defined_in(tree.body, parts[0])
    if node is None or len(parts) == 1:
        return node
    if not isinstance(node, ast.ClassDef):
        return None
    return _defined_in(node.body, parts[1])


def _defined_in(body: list[ast.stmt], name: str) -> ast.AST | None:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
        elif isinstance(node, (ast.If, ast.Try)):  # names defined under a version guard
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            found = _defined_in(inner, name)
            if found is not None:
                return found
    return None
