"""The DFlash drafter as a vLLM step runs it, on either runner (V1's proposer in
spec_decode.py, Model Runner V2's speculator in speculator.py).

Per step, for the whole batch:
  1. KV injection: the target's features of every token it just ran -> each draft layer's
     context K/V, written into the drafter's paged KV cache at the target's slots. Rejected
     positions are written too (no host sync on acceptance); they sit past the valid context
     and are overwritten when the target recomputes those positions.
  2. Draft: one block `[anchor, MASK x K]` per request at positions `p .. p+K`, p the one
     after the last accepted token's (ctx_len = seq_len - rejected for text); block queries
     attend to the ctx_len context tokens in the paged cache plus their own block (draft
     attention kernel), the target's lm_head gives K draft tokens (draft_sampling.py chooses).
     With prompt lookup on, a request whose last tokens occurred before in its context
     drafts what followed them instead (prompt_lookup.py; the step's token ids are written
     beside its KV in step 1).
"""

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_dflash.checkpoint import load_drafter
from vllm_dflash.config import DFlashConfig, DFlashConfigError
from vllm_dflash.context_queue import ContextQueue
from vllm_dflash.draft_graphs import DraftGraphs
from vllm_dflash.draft_policy import StepProfile
from vllm_dflash.draft_sampling import DraftSampling, choose_drafts
from vllm_dflash.kernels import _compiled
from vllm_dflash.kernels.draft_attention import DraftBatch, draft_attention, draft_attention_path
from vllm_dflash.kernels.kv_injection import kv_injection
from vllm_dflash.model import Attend, SelectorInputs
from vllm_dflash.prompt_lookup import TokenHistory, lookup_drafts, with_lookup_drafts
from vllm_dflash.vllm.attention import DraftKVLayer
from vllm_dflash.vllm.config import copies_bf16_draft_head, drafter_path, prompt_lookup_on
from vllm_dflash.vllm.model_executor import bf16_draft_head, target_head, use_vllm_cpu_gemm

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler
PROFILE_STOP_S = 0.5
# The context each request of the start-up profile attends to: a chat turn's prompt and part
# of its answer. Verification's cost in query tokens includes attention over the context,
# which grows with it: a profile without attention (vLLM's default dummy run in an eager
# engine) made verified drafts look a third cheaper than they were.
PROFILE_CONTEXT_TOKENS = 512
# Tokens whose KV injection may wait while no request drafts (context_queue.py): 64 decode
# steps at 8 requests, one injection instead of 64; 20 MB of features for Qwen3-8B.
CONTEXT_QUEUE_TOKENS = 512


def target_layer_ids_for_vllm(vllm_config: VllmConfig, cfg: DFlashConfig) -> None:
    """vLLM's runners read the aux-hidden-state layers from dflash_config.target_layer_ids;
    fill in the defaults so they capture exactly the layers this drafter was trained on."""
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    hf_config.dflash_config = {
        **(getattr(hf_config, "dflash_config", None) or {}),
        "target_layer_ids": list(cfg.target_layer_ids),
    }


def warn_about_setup(vllm_config: VllmConfig, device: torch.device) -> None:
    """Start-up warnings about settings this drafter ignores and kernels that do not load."""
    spec = vllm_config.speculative_config
    if spec.rejection_sample_method == "block" and spec.draft_sample_method != "probabilistic":
        logger.warning(
            "vllm-dflash: rejection_sample_method='block' changes nothing with one-hot "
            "drafts (draft_sample_method=%r): they keep the token rule, which already keeps "
            "each draft prefix with its target probability. Block verification keeps more "
            "drafts with draft_sample_method='probabilistic'.", spec.draft_sample_method)
    if spec.attention_backend is not None:
        logger.warning(
            "vllm-dflash: attention_backend=%s in --speculative-config is not used: the "
            "drafter runs vllm-dflash's draft attention (%s)",
            spec.attention_backend.name, draft_attention_path(device))
    cpu = device.type == "cpu"
    compiled_error = _compiled.cpu_import_error if cpu else _compiled.cuda_import_error
    if compiled_error is not None:
        # Also where it was built for another torch than this vLLM's (0.33 pins 2.14).
        logger.warning(
            "vllm-dflash: the compiled %s kernels do not import (%s); their slower %s "
            "fallbacks run. Reinstall against this torch (%s) with a %s compiler: "
            "`pip install --no-build-isolation vllm-dflash`.",
            "CPU" if cpu else "CUDA", compiled_error, "torch" if cpu else "Triton",
            torch.__version__, "C++" if cpu else "CUDA")


class DraftRunner:
    """The drafter, its paged context KV cache and its step, for a batch of requests."""

    def __init__(self, vllm_config: VllmConfig, cfg: DFlashConfig, device: torch.device,
                 dtype: torch.dtype, max_batch_size: int) -> None:
        self.vllm_config, self.cfg, self.device, self.dtype = vllm_config, cfg, device, dtype
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.block_len = self.num_speculative_tokens + 1
        self.max_batch_size = max_batch_size
        num_target_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        # Names carry one integer past the target's layers, as vLLM's layer indexing expects.
        self.kv_layer_names = [
            f"vllm_dflash.layers.{num_target_layers + i}" for i in range(cfg.num_layers)
        ]
        self.kv_layers: list[DraftKVLayer] = []
        self.dummy_runs_draft = True  # off while profiling the target alone
        self.draft_graphs: DraftGraphs | None = None  # captured with vLLM's graphs
        self.context_queue: ContextQueue | None = None  # made in load()
        self.token_history: TokenHistory | None = None  # prompt lookup; made in kv_cache_group()
        self.last_draft_probs: torch.Tensor | None = None
        # vLLM captures each target layer once, in ascending order; the drafter wants its
        # target_layer_ids order, duplicates included.
        ids = cfg.target_layer_ids
        captured = sorted(set(ids))
        self.feature_order = None if ids == captured else [captured.index(i) for i in ids]

    # ---- set-up -------------------------------------------------------------------------

    def load(self, target_model: torch.nn.Module) -> None:
        """Loads the drafter, takes the target's embedding and lm_head, and declares the
        draft layers' KV cache in vLLM's forward context."""
        if not supports_eagle3(target_model):  # checked before vLLM asks for those features
            raise DFlashConfigError(
                f"the target {type(target_model).__name__} does not return the hidden states "
                "of its intermediate layers, which a DFlash drafter reads (vLLM's "
                "SupportsEagle3 interface); fix: use a target architecture that implements "
                "it, such as Qwen3ForCausalLM, Qwen2ForCausalLM or LlamaForCausalLM."
            )
        cfg, config = self.cfg, self.vllm_config
        self.drafter = load_drafter(
            drafter_path(config.speculative_config.draft_model_config), dtype=self.dtype,
            device=self.device).eval()
        self.embed, self.logits = target_head(target_model, lora=config.lora_config is not None)
        if self.drafter.lm_head is not None:  # a LiLiCorr drafter's own candidates' head
            self.logits = self.drafter.lm_head
        elif copies_bf16_draft_head(config.model_config):  # start-up refused other drafters
            self.logits = bf16_draft_head(target_model)
        self.kv_weight = self.drafter.kv_weight()
        self.k_norm_weight = self.drafter.k_norm_weight()
        if self.device.type == "cpu":
            use_vllm_cpu_gemm(self.drafter)
        # A block starts at most at max_model_len; the drafts past it are never verified, but
        # their positions need RoPE rows (the usual max_model_len is the drafter's trained
        # max_position_embeddings).
        self.cos_sin_cache = self.drafter.rope_cache(
            self.device, min_positions=config.model_config.max_model_len + self.block_len)
        self.mask_ids = torch.full((self.max_batch_size, self.block_len), cfg.mask_token_id,
                                   dtype=torch.int32, device=self.device)
        self.block_offsets = torch.arange(self.block_len, dtype=torch.int32, device=self.device)
        # query_start_loc of any batch: request r's block starts at r * block_len.
        self.block_starts = torch.arange(self.max_batch_size + 1, dtype=torch.int32,
                                         device=self.device) * self.block_len
        # A KV connector saves or sends the cache after each step: the drafter's part must be
        # current then, so its injection never waits.
        if config.kv_transfer_config is None:
            self.context_queue = ContextQueue(
                CONTEXT_QUEUE_TOKENS, len(set(cfg.target_layer_ids)) * cfg.hidden_size,
                config.model_config.dtype, self.device, self._inject)
        forward_context = config.compilation_config.static_forward_context
        for name in self.kv_layer_names:
            if name in forward_context:
                raise ValueError(f"duplicate layer name {name} in vLLM's forward context")
            layer = DraftKVLayer(cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
            forward_context[name] = layer
            self.kv_layers.append(layer)

    def kv_cache_group(self, kv_cache_config: KVCacheConfig) -> int:
        """The one KV cache group of the draft layers; sets the cache's block size."""
        groups = {
            gid for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names if name in self.kv_layer_names
        }
        if len(groups) != 1:
            raise ValueError(
                f"vllm-dflash draft layers landed in KV cache groups {sorted(groups)}; "
                "they must share one group"
            )
        gid = groups.pop()
        self.block_size = kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
        if prompt_lookup_on():
            self.token_history = TokenHistory(kv_cache_config.num_blocks * self.block_size,
                                              self.block_size, self.device)
        return gid

    # ---- per step -----------------------------------------------------------------------

    def inject_context(
        self, features: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
        slot_mapping: torch.Tensor
    ) -> torch.Tensor:
        """Writes the drafter's context K/V of the target's tokens (after any still queued)
        and, for prompt lookup, their ids; returns their fused context states [T, H]. A
        drafting step calls this."""
        self.flush_context()
        self.record_tokens(token_ids, slot_mapping)
        return self._inject(features, positions, slot_mapping)

    def queue_context(self, feature_chunks: list[torch.Tensor], token_ids: torch.Tensor,
                      positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The context of a step that drafts nothing: its injection waits in the queue until
        the next drafting step or until the queue is full (context_queue.py); its token ids
        are recorded now. feature_chunks: the captured target layers' hidden states [T, H]
        each."""
        self.record_tokens(token_ids, slot_mapping)
        if self.context_queue is None:
            self._inject(torch.cat(feature_chunks, dim=-1), positions, slot_mapping)
        else:
            self.context_queue.put(feature_chunks, positions, slot_mapping)

    def record_tokens(self, token_ids: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.token_history is not None:
            self.token_history.write(token_ids, slot_mapping)

    def flush_context(self) -> None:
        """Injects the queued context, so that the drafter's cache holds every token's."""
        if self.context_queue is not None:
            self.context_queue.flush()

    def _inject(self, features: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
        if self.feature_order is not None:
            chunks = features.view(features.shape[0], -1, self.cfg.hidden_size)
            features = chunks[:, self.feature_order].flatten(1)
        ctx = self.drafter.fuse(features.to(self.dtype))
        kv_injection(
            ctx, positions, slot_mapping, self.kv_weight, self.k_norm_weight,
            self.cfg.rms_norm_eps, self.cos_sin_cache,
            [layer.kv_cache for layer in self.kv_layers],
        )
        return ctx

    def draft_tokens(self, anchor_ids: torch.Tensor, batch: DraftBatch, num_draft: int,
                     sampling: DraftSampling | None = None,
                     anchor_states: torch.Tensor | None = None) -> torch.Tensor:
        """[B] anchors -> [B, num_draft] draft tokens. The drafter's pass is replayed from a
        CUDA graph when one fits the batch. Sampled drafts leave their distributions in
        last_draft_probs, where the runner reads them for verification. With prompt lookup,
        the requests it finds drafts for take those (one-hot distributions); on the CPU,
        where that is known without a device sync, the drafter's pass of a greedy batch runs
        for the other requests only."""
        lookup = self.lookup(anchor_ids, batch, num_draft)
        if self.lookup_skips_drafter and sampling is None:
            return self.drafts_where_lookup_fails(anchor_ids, batch, num_draft, anchor_states,
                                                  *lookup)
        tokens, self.last_draft_probs = self.choose_tokens(
            self.block_hidden(anchor_ids, batch)[:, :num_draft], anchor_ids, sampling,
            anchor_states)
        if lookup is not None:
            tokens = with_lookup_drafts(tokens, self.last_draft_probs, *lookup)
        return tokens

    def drafts_where_lookup_fails(self, anchor_ids: torch.Tensor, batch: DraftBatch,
                                  num_draft: int, anchor_states: torch.Tensor | None,
                                  lookup_tokens: torch.Tensor, found: torch.Tensor
                                  ) -> torch.Tensor:
        """Greedy drafts: lookup's where it found them, the drafter's for the other requests,
        from a pass over those alone (none when lookup found drafts for every request)."""
        self.last_draft_probs = None
        rows = (~found).nonzero().flatten()
        if rows.numel() == 0:
            return lookup_tokens
        others = DraftBatch(batch.block_table[rows], batch.context_lens[rows],
                            batch.query_start_loc[: rows.numel() + 1],
                            batch.anchor_positions[rows])
        hidden = self.block_hidden(anchor_ids[rows], others)[:, :num_draft]
        tokens, _ = self.choose_tokens(hidden, anchor_ids[rows], None,
                                       None if anchor_states is None else anchor_states[rows])
        lookup_tokens[rows] = tokens.to(lookup_tokens.dtype)
        return lookup_tokens

    @property
    def lookup_skips_drafter(self) -> bool:
        """Whether the drafter's pass leaves out the requests lookup drafts for: on the CPU,
        where which ones those are is known without a device sync."""
        return self.token_history is not None and self.device.type == "cpu"

    def lookup(self, anchor_ids: torch.Tensor, batch: DraftBatch, num_draft: int
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Prompt-lookup drafts [B, num_draft] and found [B], or None with lookup off."""
        if self.token_history is None:
            return None
        context = self.token_history.context(batch.block_table, batch.context_lens, anchor_ids)
        return lookup_drafts(context, num_draft)

    def block_hidden(self, anchor_ids: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
        """draft_hidden, replayed from a CUDA graph when one fits the batch."""
        hidden = None if self.draft_graphs is None else self.draft_graphs.run(anchor_ids, batch)
        return self.draft_hidden(anchor_ids, batch) if hidden is None else hidden

    def choose_tokens(self, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                      sampling: DraftSampling | None = None,
                      anchor_states: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, k, hidden] -> [B, k] tokens through the target's lm_head (and a DFlash2 or
        LiLiCorr drafter's candidate selector, which starts from the anchors [B] and, for
        LiLiCorr, their context states [B, H]), greedy or drawn for the requests `sampling`
        marks, and then their distributions [B, k, V]."""
        num_reqs, k = hidden.shape[:2]
        logits = self.logits(hidden.flatten(0, 1)).view(num_reqs, k, -1)
        if anchor_states is None and self.drafter.lilicorr is not None:
            # Profiling and dummy runs: shapes only, no context yet.
            anchor_states = hidden.new_zeros(num_reqs, hidden.shape[-1])
        inputs = SelectorInputs(anchor_ids, anchor_states, self.embed)
        return choose_drafts(self.drafter.selector, hidden, logits, inputs, sampling)

    def draft_hidden(self, anchor_ids: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
        """[B] anchors -> [B, K, hidden] drafter outputs at the block's K mask positions."""
        num_reqs = anchor_ids.shape[0]
        block_ids = self.mask_ids[:num_reqs].clone()
        block_ids[:, 0] = anchor_ids
        positions = (batch.anchor_positions[:, None] + self.block_offsets).flatten().long()
        embeds = self.embed(block_ids.flatten())
        if self.cfg.input_embedding_scale != 1.0:  # a full pass over the embeddings
            embeds = embeds * self.cfg.input_embedding_scale
        hidden = self.drafter(embeds.to(self.dtype), positions, self.paged_attend(batch),
                              block_len=self.block_len)
        return hidden.view(num_reqs, self.block_len, -1)[:, 1:]

    def paged_attend(self, batch: DraftBatch) -> Attend:
        cfg = self.cfg
        scale = cfg.head_dim**-0.5

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return draft_attention(
                q, k, v, self.kv_layers[layer].kv_cache, batch.block_table,
                batch.context_lens, batch.query_start_loc, scale,
                causal=cfg.layer_is_causal(layer), sliding_window=cfg.layer_window(layer),
                max_query_len=self.block_len,  # known on the host: no device sync for the grid
            )

        return attend

    # ---- profiling and graphs -----------------------------------------------------------

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, sampling: bool) -> None:
        """Profile-time run at the largest shapes; writes no cache (pages may not exist yet).
        sampling: every request draws its drafts, the largest memory the step takes."""
        features = torch.zeros(num_tokens, len(self.cfg.target_layer_ids) * self.cfg.hidden_size,
                               dtype=self.dtype, device=self.device)
        ctx = self.drafter.fuse(features)
        torch.nn.functional.linear(ctx, self.kv_weight)
        if self.dummy_runs_draft:
            num_reqs = max(1, min(self.max_batch_size, num_tokens // self.block_len))
            anchors, batch = self.dummy_draft_inputs(num_reqs)
            draws = (DraftSampling(anchors.new_ones(num_reqs, dtype=torch.float32),
                                   anchors.new_ones(num_reqs, dtype=torch.bool))
                     if sampling else None)
            self.choose_tokens(self.draft_hidden(anchors, batch), anchors, draws)

    def dummy_draft_inputs(self, num_reqs: int) -> tuple[torch.Tensor, DraftBatch]:
        """Anchors and an empty-context batch of num_reqs blocks, for profiling."""
        empty = torch.zeros(num_reqs, dtype=torch.int32, device=self.device)
        batch = DraftBatch(
            block_table=torch.zeros(num_reqs, 1, dtype=torch.int32, device=self.device),
            context_lens=empty, query_start_loc=self.block_starts[: num_reqs + 1],
            anchor_positions=empty,
        )
        return torch.zeros(num_reqs, dtype=torch.int32, device=self.device), batch

    def uses_cuda_graphs(self) -> bool:
        """Like vLLM's drafters: on CUDA unless the target or the speculative config is eager.
        Single GPU only: with tensor parallelism the target's embedding, which the captured
        step runs, is split across ranks and all-reduced."""
        config = self.vllm_config
        return (
            self.device.type == "cuda"
            and config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
            and not config.model_config.enforce_eager
            and not config.speculative_config.enforce_eager
            and config.parallel_config.tensor_parallel_size == 1
        )

    def capture_draft_graphs(self, use_cuda_graph: bool = True) -> None:
        """One graph per batch size in vLLM's capture sizes, up to the largest batch.
        use_cuda_graph=False keeps the graphs' static buffers and padding but runs the step
        eagerly: how the CPU tests run this path inside an engine."""
        capture_sizes = self.vllm_config.compilation_config.cudagraph_capture_sizes or []
        sizes = [s for s in capture_sizes if s < self.max_batch_size] + [self.max_batch_size]
        max_blocks = -(-self.vllm_config.model_config.max_model_len // self.block_size)
        graphs = DraftGraphs(self.draft_hidden, sizes, max_blocks, self.block_len, self.device,
                             use_cuda_graph)
        start = time.perf_counter()
        try:
            graphs.capture()
        except RuntimeError as error:
            logger.warning("vllm-dflash: capturing the drafter's CUDA graphs failed (%s); the "
                           "drafter runs eagerly", error)
            return
        self.draft_graphs = graphs
        logger.info("vllm-dflash: drafter %s for %d batch sizes (1..%d) in %.1f s",
                    "CUDA graphs captured" if use_cuda_graph else "graph buffers set up (eager)",
                    len(graphs.sizes), graphs.sizes[-1], time.perf_counter() - start)

    @torch.inference_mode()
    def profile_step_costs(self, runner: Any) -> StepProfile:
        """Start-up profile for the draft-length policy: the target's step at 1, 2, 4, ...
        query tokens (target_step: the runner's own dummy runs, CUDA graphs included, drafter
        excluded, and the verification's logits) and the drafter at 1, 2, 4, ... requests. A
        shape slower than PROFILE_STOP_S ends its series; the policy extrapolates from the last
        two points."""
        max_reqs = runner.max_num_reqs
        max_tokens = min(runner.max_num_tokens, max_reqs * self.block_len)
        if self.context_queue is not None:
            # Its flushes' one-time costs, here rather than in the first steps that drafting
            # resumes (adaptive engines only: with a fixed K every step drafts, none queues).
            self.context_queue.warm_up()
        self.dummy_runs_draft = False
        try:
            tokens, target_s = _time_series(
                max_tokens, lambda t: target_step(runner, t, PROFILE_CONTEXT_TOKENS),
                self.device)
        finally:
            self.dummy_runs_draft = True
        batch_sizes, drafter_s = _time_series(
            max_reqs,
            lambda n: self.draft_tokens(*self.dummy_draft_inputs(n), self.num_speculative_tokens),
            self.device)
        # On the CPU the pass leaves out the requests lookup drafts for (greedy drafts:
        # drafts_where_lookup_fails).
        return StepProfile(tokens, target_s, batch_sizes, drafter_s,
                           lookup_skips_drafter=self.lookup_skips_drafter)


def target_step(runner: Any, num_tokens: int, context_len: int) -> None:
    """The target's work in a step of num_tokens query tokens spread over up to max_num_seqs
    requests, each after context_len tokens of context: the forward pass with attention (the
    runner's dummy run, which returns the hidden states of every token first) and the logits
    and greedy token of every row. Verification computes logits at each draft position, so a
    draft token costs the target's lm_head too: a fifth of a small model's weights."""
    if hasattr(runner, "speculator"):  # Model Runner V2 runs attention in its dummy runs
        hidden_states = runner._dummy_run(num_tokens, context_len=context_len)[0]
    else:
        # V1 spreads the tokens as evenly as it can; its last request takes the remainder.
        num_reqs = min(num_tokens, runner.scheduler_config.max_num_seqs)
        query_len = num_tokens // num_reqs + num_tokens % num_reqs
        seq_len = min(context_len + query_len, runner.vllm_config.model_config.max_model_len)
        hidden_states = runner._dummy_run(num_tokens, force_attention=True,
                                          profile_seq_lens=seq_len)[0]
    if isinstance(hidden_states, torch.Tensor):  # not on a pipeline stage before the last
        runner.model.compute_logits(hidden_states).argmax(dim=-1)


def _time_series(
    limit: int, run: Callable[[int], Any], device: torch.device
) -> tuple[list[int], list[float]]:
    """Best-of-3 seconds of run(x) (after a warm-up) for x = 1, 2, 4, ... up to limit, made
    non-decreasing in x: a larger shape never costs less, whatever the noise said."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sizes = sorted({2**i for i in range(limit.bit_length()) if 2**i < limit} | {limit})
    xs, seconds = [], []
    for x in sizes:
        run(x)
        sync()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            run(x)
            sync()
            best = min(best, time.perf_counter() - start)
        xs.append(x)
        seconds.append(best)
        if best > PROFILE_STOP_S:
            break
    return xs, list(itertools.accumulate(seconds, max))
