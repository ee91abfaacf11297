"""vLLM's model runners: the V1 runner (GPUModelRunner, and CPUModelRunner, its subclass)
builds vllm-dflash's proposer, Model Runner V2 its speculator, for a vllm-dflash engine. Every
patch here runs vLLM's own code unless the engine runs vllm-dflash. Checked on vLLM 0.32.0 and
0.33.0.
"""

import functools
import sys

import torch

from vllm_dflash.vllm import contract
from vllm_dflash.vllm.config import DFlashSetupError, runs_vllm_dflash
from vllm_dflash.vllm.spec_decode import DFlashProposer


def patch_model_runner_v2() -> None:
    # MRV2's model runner imports `init_speculator` by name from its spec_decode package:
    # rebinding it there before that import (and in the runner's module if it is already
    # imported) builds vllm-dflash's speculator for vllm-dflash engines, vLLM's for the rest.
    from vllm.v1.worker.gpu import spec_decode

    vllm_init_speculator = spec_decode.init_speculator

    def init_speculator(vllm_config, device, req_states):
        if not runs_vllm_dflash(vllm_config.speculative_config):
            return vllm_init_speculator(vllm_config, device, req_states)
        problems = contract.broken_hooks(contract.MRV2_HOOKS)
        if problems:
            raise DFlashSetupError(
                "vllm-dflash cannot run on this vLLM's Model Runner V2: these hooks it relies on "
                f"are missing or changed: {'; '.join(problems)}. Set VLLM_USE_V2_MODEL_RUNNER=0 "
                "for the V1 runner, or VLLM_DFLASH_IMPL=vllm for vLLM's in-tree DFlash."
            )
        from vllm_dflash.vllm.speculator import DFlashSpeculator  # MRV2 loads after CPU patches

        return DFlashSpeculator(vllm_config, device)

    spec_decode.init_speculator = init_speculator
    runner_module = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner_module is not None:
        runner_module.init_speculator = init_speculator


def patch_runner() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.worker import gpu_model_runner

    # The runner builds and type-checks its drafter through the module-level name
    # `DFlashProposer` when the method is "dflash"; rebinding it swaps in ours.
    gpu_model_runner.DFlashProposer = DFlashProposer
    _patch_logitsprocs(gpu_model_runner)
    _patch_drafting(gpu_model_runner.GPUModelRunner)
    if current_platform.is_cpu():
        _patch_cpu_seeded_chunked_prefill(gpu_model_runner.GPUModelRunner)


def _patch_logitsprocs(gpu_model_runner) -> None:
    # With speculation vLLM builds only the min-tokens logits processor; vllm-dflash applies
    # the min_p and logit_bias ones to verified rows too (sampler.py).
    build = gpu_model_runner.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        if (not runs_vllm_dflash(vllm_config.speculative_config) or is_pooling_model
                or custom_logitsprocs):
            return build(vllm_config, device, is_pin_memory, is_pooling_model,
                         custom_logitsprocs)
        from vllm.v1.sample.logits_processor import (
            BUILTIN_LOGITS_PROCESSORS,
            LogitsProcessors,
        )

        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory)
                                for ctor in BUILTIN_LOGITS_PROCESSORS)

    gpu_model_runner.build_logitsprocs = build_logitsprocs


def _uses_vllm_dflash(runner) -> bool:
    return isinstance(getattr(runner, "drafter", None), DFlashProposer)


def _patch_drafting(runner) -> None:
    # vLLM skips the drafter for the whole batch once one request is within a block of
    # max_model_len (a drafter's own position limit). This drafter has none (its RoPE table
    # covers max_model_len + block), and a skipped step would leave that step's tokens out of
    # every other request's drafter context: lower acceptance for the rest of their lives.
    fits = runner._input_fits_in_drafter

    def input_fits_in_drafter(self, common_attn_metadata) -> bool:
        if _uses_vllm_dflash(self):
            return common_attn_metadata is not None
        return fits(self, common_attn_metadata)

    runner._input_fits_in_drafter = input_fits_in_drafter

    # vLLM takes its speculative path on every step of a speculative engine: spec-decode
    # metadata and the rejection sampler even when no request has drafts, which is every step
    # while the draft-length policy has drafting off. Such a step is a plain one: vLLM's
    # non-speculative inputs and sampler give the same tokens, and the proposer still gets
    # every token's features (its KV injection). Hybrid targets keep the speculative path: their
    # recurrent state reads zero-draft decode rows at an offset only that path applies.
    prepare_inputs = runner._prepare_inputs

    def prepare_plain_step_inputs(self, scheduler_output, num_scheduled_tokens):
        if (scheduler_output.scheduled_spec_decode_tokens or self.model_config.is_hybrid
                or not _uses_vllm_dflash(self)):
            return prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        speculative_config, self.speculative_config = self.speculative_config, None
        try:
            return prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        finally:
            self.speculative_config = speculative_config

    runner._prepare_inputs = prepare_plain_step_inputs

    # On a step that verified no drafts and drafts none (drafting off), vLLM's propose path
    # still computes every request's next token (prepare_next_token_ids_padded, a Python loop
    # over the requests), which only anchors drafts and, under async scheduling, feeds the next
    # step's inputs. Without async scheduling such a step needs only the KV injection, which
    # waits for the next drafting step (context_queue.py).
    propose = runner.propose_draft_token_ids

    @functools.wraps(propose)
    def propose_or_inject_only(self, scheduler_output, sampled_token_ids, sampling_metadata,
                               hidden_states, sample_hidden_states, aux_hidden_states,
                               spec_decode_metadata, common_attn_metadata, slot_mappings):
        if (not _uses_vllm_dflash(self) or scheduler_output.num_spec_tokens_to_schedule
                or spec_decode_metadata is not None
                or self.valid_sampled_token_count_event is not None
                or self.speculative_config.disable_padded_drafter_batch):
            return propose(self, scheduler_output, sampled_token_ids, sampling_metadata,
                           hidden_states, sample_hidden_states, aux_hidden_states,
                           spec_decode_metadata, common_attn_metadata, slot_mappings)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        self._draft_probs = self._draft_prob_req_ids = None
        self.drafter.queue_context(aux_hidden_states, self.input_ids.gpu[:num_tokens],
                                   self._get_positions(num_tokens),
                                   common_attn_metadata)
        return torch.empty(self.input_batch.num_reqs, 0, dtype=torch.int64, device=self.device)

    runner.propose_draft_token_ids = propose_or_inject_only


def _patch_cpu_seeded_chunked_prefill(runner) -> None:
    # vLLM 0.32 samples a token for every scheduled request, also one whose prompt is only
    # partly prefilled, and discards it. So that the discarded sample does not advance a seeded
    # request's generator (its output must not depend on how the prompt was chunked),
    # _bookkeeping_sync rewinds it with Generator.set_offset, which CPU generators lack: the
    # engine stops ("CPU Generator does not use offset"), with or without speculation. In a
    # vllm-dflash engine on CPU, save those generators' states before sampling and restore
    # them after, which is the rewind done exactly, and keep _bookkeeping_sync from rewinding
    # them again. Other engines keep vLLM's behaviour, failure included.
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    def sample_keeping_discarded_generators(self, logits, spec_decode_metadata):
        if not _uses_vllm_dflash(self):
            return sample(self, logits, spec_decode_metadata)
        generators = self.input_batch.generators
        num_reqs = self.input_batch.num_reqs
        discarded = self.discard_request_mask.np[:num_reqs].nonzero()[0].tolist()
        saved = {i: generators[i].get_state() for i in discarded if i in generators}
        output = sample(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            generators[i].set_state(state)
        return output

    @functools.wraps(bookkeeping)
    def bookkeeping_without_rewind(self, *args, **kwargs):
        if not _uses_vllm_dflash(self):
            return bookkeeping(self, *args, **kwargs)
        # input_batch.generators is read in _bookkeeping_sync only for the rewind.
        generators = self.input_batch.generators
        self.input_batch.generators = {}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    runner._sample = sample_keeping_discarded_generators
    runner._bookkeeping_sync = bookkeeping_without_rewind
