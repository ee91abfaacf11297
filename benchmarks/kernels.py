"""Step-cost benchmark: per-step time of each part of a DFlash decoding step, on every path.

    kv_injection     the proposer's context injection for --new-tokens tokens per request:
                     fc + hidden_norm of the target features, then K/V of every draft layer
                     into the paged caches. Paths: reference, torch, triton, cuda (vllm_dflash._C)
    draft_attention  the block queries of one draft layer over the paged context and their own
                     block; per step = layers x per layer. Paths: reference, torch, triton
    verify_greedy    all-greedy verification as vLLM's rejection sampler runs it: argmax, then
                     the accept walk. Paths: reference, triton
    verify_sampled   verify() at temperature > 0: argmax, random draws, rejection walk (the
                     softmax before it is not counted). Paths: reference, triton
    drafter_step     one block of --draft-block-size tokens per request: embed -> DFlashDrafter
                     (random weights, paged draft attention) -> lm_head argmax over --vocab
                     (with --dflash2 or --lilicorr: the candidate head's greedy walk).
                     Paths: the attention used (torch, triton) and, with --cuda-graph, the triton
                     step captured in a CUDA graph per batch size, checked token for token
                     against eager

CUDA: Qwen3-8B / Qwen3-8B-DFlash-b16 shapes in bf16 (hidden 4096, 5 draft layers, 32 heads,
8 KV heads, head_dim 128, intermediate 12288, features of 5 target layers, vocab 151936,
context 1024). CPU: small fp32 shapes, the torch paths only; it runs in seconds.

    python benchmarks/kernels.py                          # defaults for the device found
    python benchmarks/kernels.py --batches 1,8,64 --cuda-graph --json step_costs.json
    OMP_NUM_THREADS=1 python benchmarks/kernels.py        # CPU: steadier on a small, busy VM

Times are medians over --repeats calls, each timed from host to device synchronisation, so
they include launch overhead: what a step pays. Exits 1 when a CUDA graph's draft tokens differ
from eager's.
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn import functional as F

from vllm_dflash.config import (
    DFLASH2_METAVAR,
    LILICORR_METAVAR,
    DFlashConfig,
    dflash2_fields,
    dflash2_option,
    lilicorr_fields,
    lilicorr_option,
)
from vllm_dflash.draft_graphs import DraftGraphs
from vllm_dflash.draft_sampling import choose_drafts
from vllm_dflash.kernels import _compiled
from vllm_dflash.kernels.draft_attention import (
    DraftBatch,
    draft_attention_cpu,
    draft_attention_reference,
    draft_attention_torch,
    draft_attention_triton,
)
from vllm_dflash.kernels.inputs import block_table, paged_cache
from vllm_dflash.kernels.kv_injection import (
    kv_injection,
    kv_injection_reference,
    kv_injection_torch,
    kv_injection_triton,
)
from vllm_dflash.kernels.verify import (
    rejection_walk_reference,
    rejection_walk_triton,
    verify_reference,
    verify_triton,
)
from vllm_dflash.model import DFlashDrafter, SelectorInputs
from vllm_dflash.tiny import random_drafter

GPU_SHAPES = {"hidden": 4096, "layers": 5, "heads": 32, "kv_heads": 8, "head_dim": 128,
              "intermediate": 12288, "features": 5, "context": 1024, "vocab": 151936}
CPU_SHAPES = {"hidden": 512, "layers": 2, "heads": 8, "kv_heads": 2, "head_dim": 64,
              "intermediate": 1024, "features": 3, "context": 256, "vocab": 8192}
MASK_TOKEN_ID = 1
Row = dict[str, object]


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of fn() in ms, synchronising the device around every call."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def report(rows: list[Row], row: Row, note: str = "") -> None:
    """Print one row and keep it for --json."""
    rows.append(row)
    print(f"{row['what']:16s} {row['path']:18s} batch {row['batch']:4d}  "
          f"tokens {row['tokens']:6d}  {row['ms_per_step']:9.3f} ms/step{note}", flush=True)


def drafter_config(args: argparse.Namespace) -> DFlashConfig:
    """The benchmarked drafter's shape. Only the number of target layer ids matters here."""
    window = args.sliding_window
    return DFlashConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=args.context + args.draft_block_size + args.new_tokens,
        vocab_size=args.vocab,
        layer_types=["full_attention" if window is None else "sliding_attention"] * args.layers,
        sliding_window=window, block_size=args.draft_block_size, mask_token_id=MASK_TOKEN_ID,
        target_layer_ids=list(range(args.features)), num_target_layers=args.features + 2,
        causal=args.causal,
        **dflash2_fields(args.dflash2),
        **lilicorr_fields(args.lilicorr, args.hidden),
    )


@dataclass
class PagedBatch:
    """One draft block per request over a paged context."""

    caches: list[torch.Tensor]  # per layer [num_blocks, Hkv, cache_block, 2D] (strided view)
    draft: DraftBatch  # block table shuffled, contexts of args.context tokens
    anchors: torch.Tensor  # [B] int32


def paged_batch(args: argparse.Namespace, batch: int, device: torch.device) -> PagedBatch:
    """Random caches in vLLM's strided layout, contexts of args.context tokens each; every
    request's blocks, all of them used, also hold its draft block and injected tokens."""
    tokens_per_request = args.context + max(args.draft_block_size, args.new_tokens)
    blocks_per_request = -(-tokens_per_request // args.cache_block_size)
    num_blocks = batch * blocks_per_request
    gen = torch.Generator(device).manual_seed(0)
    caches = [paged_cache(num_blocks, args.kv_heads, args.cache_block_size, args.head_dim,
                          args.dtype, "permuted", gen) for _ in range(args.layers)]
    b = args.draft_block_size
    return PagedBatch(
        caches=caches,
        draft=DraftBatch(
            block_table=block_table([blocks_per_request] * batch, num_blocks, blocks_per_request,
                                    gen),
            context_lens=torch.full((batch,), args.context, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, batch * b + 1, b, dtype=torch.int32, device=device),
            anchor_positions=torch.full((batch,), args.context, dtype=torch.int32,
                                        device=device),
        ),
        anchors=torch.randint(2, args.vocab, (batch,), dtype=torch.int32, device=device),
    )


def bench_kv_injection(args: argparse.Namespace, drafter: DFlashDrafter, paged: PagedBatch,
                       rows: list[Row]) -> None:
    device, batch, n = paged.anchors.device, paged.anchors.shape[0], args.new_tokens
    positions = (args.context + torch.arange(n, device=device)).repeat(batch)
    requests = torch.arange(batch, device=device).repeat_interleave(n)
    blocks = paged.draft.block_table[requests, positions // args.cache_block_size].long()
    slot_mapping = blocks * args.cache_block_size + positions % args.cache_block_size
    features = torch.randn(batch * n, args.features * args.hidden, dtype=args.dtype,
                           device=device)
    weights = (drafter.kv_weight(), drafter.k_norm_weight(), drafter.cfg.rms_norm_eps,
               drafter.rope_cache(device), paged.caches)
    paths = {"reference": kv_injection_reference, "torch": kv_injection_torch}
    if device.type == "cuda":
        paths["triton"] = kv_injection_triton
        if _compiled.cuda_available():
            paths["cuda"] = kv_injection  # the dispatcher picks the compiled op
    elif _compiled.cpu_available():
        paths["c++"] = kv_injection  # the dispatcher picks the compiled op

    for name, inject in paths.items():
        def step(inject=inject) -> None:
            inject(drafter.fuse(features), positions, slot_mapping, *weights)

        ms = median_ms(step, device, args.repeats, args.warmup)
        report(rows, {"what": "kv_injection", "path": name, "batch": batch,
                      "tokens": batch * n, "ms_per_step": ms})


def bench_draft_attention(args: argparse.Namespace, paged: PagedBatch, rows: list[Row]) -> None:
    device, batch, b = paged.anchors.device, paged.anchors.shape[0], args.draft_block_size
    tokens = batch * b
    inputs = (
        torch.randn(tokens, args.heads, args.head_dim, dtype=args.dtype, device=device),
        torch.randn(tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device=device),
        torch.randn(tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device=device),
        paged.caches[0], paged.draft.block_table, paged.draft.context_lens,
        paged.draft.query_start_loc,
        args.head_dim**-0.5, args.causal, args.sliding_window,
    )
    paths = {"reference": draft_attention_reference,
             "torch": lambda *a: draft_attention_torch(*a, max_query_len=b)}
    if device.type == "cuda":
        paths["triton"] = lambda *a: draft_attention_triton(*a, max_query_len=b)
    elif _compiled.cpu_available():
        paths["c++"] = draft_attention_cpu
    for name, attention in paths.items():
        ms = median_ms(lambda fn=attention: fn(*inputs), device, args.repeats, args.warmup)
        report(rows, {"what": "draft_attention", "path": name, "batch": batch, "tokens": tokens,
                      "ms_per_layer": ms, "ms_per_step": ms * args.layers},
               f"  ({ms:.3f} ms/layer x {args.layers} layers)")


def bench_verify(args: argparse.Namespace, batch: int, device: torch.device,
                 rows: list[Row]) -> None:
    """Every request verifies draft-block-size - 1 drafts; each accepts a random prefix."""
    k = args.draft_block_size - 1
    logits = torch.randn(batch * k, args.vocab, device=device)
    probs = logits.softmax(dim=-1)
    argmax = logits.argmax(dim=-1)
    accepted = torch.randint(0, k + 1, (batch, 1), device=device)
    wrong = torch.arange(k, device=device) >= accepted
    drafts = torch.where(wrong.flatten(), (argmax + 1) % args.vocab, argmax)
    cu_num_draft_tokens = torch.arange(k, batch * k + 1, k, dtype=torch.int32, device=device)
    bonus = torch.randint(args.vocab, (batch,), device=device)
    greedy = torch.ones(batch, dtype=torch.bool, device=device)
    paths = {"reference": (rejection_walk_reference, verify_reference)}
    if device.type == "cuda":
        paths["triton"] = (rejection_walk_triton, verify_triton)
    for name, (walk, verify) in paths.items():
        def greedy_step(walk=walk) -> None:
            walk(drafts, cu_num_draft_tokens, k, None, logits, bonus, greedy,
                 logits.argmax(dim=-1), None)

        def sampled_step(verify=verify) -> None:
            verify(drafts, cu_num_draft_tokens, k, None, probs, bonus, ~greedy, {})

        for what, step in (("verify_greedy", greedy_step), ("verify_sampled", sampled_step)):
            ms = median_ms(step, device, args.repeats, args.warmup)
            report(rows, {"what": what, "path": name, "batch": batch, "tokens": batch * k,
                          "ms_per_step": ms})


def draft_step(drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head: torch.Tensor,
               caches: list[torch.Tensor], anchors: torch.Tensor, batch: DraftBatch,
               attention: Callable[..., torch.Tensor]) -> torch.Tensor:
    """[B] anchors -> [B, block-1] greedy draft tokens, the steps of DFlashProposer.draft."""
    cfg = drafter.cfg
    num_reqs = anchors.shape[0]
    block_ids = torch.full((num_reqs, cfg.block_size), cfg.mask_token_id, device=anchors.device)
    block_ids[:, 0] = anchors
    offsets = torch.arange(cfg.block_size, device=block_ids.device)
    positions = (batch.anchor_positions[:, None] + offsets).flatten()

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, caches[layer], batch.block_table, batch.context_lens,
                         batch.query_start_loc, drafter.scale, cfg.layer_is_causal(layer),
                         cfg.layer_window(layer), max_query_len=cfg.block_size)

    hidden = drafter(F.embedding(block_ids.flatten(), embed_weight), positions, attend,
                     block_len=cfg.block_size)
    hidden = hidden.view(num_reqs, cfg.block_size, -1)[:, 1:]
    # A LiLiCorr head's anchor states: the first block position's hidden state stands in (the
    # proposer reads the last accepted token's context state, of the same shape).
    inputs = SelectorInputs(anchors, hidden[:, 0], partial(F.embedding, weight=embed_weight))
    return choose_drafts(drafter.selector, hidden, F.linear(hidden, lm_head), inputs)[0]


def bench_drafter_step(args: argparse.Namespace, drafter: DFlashDrafter,
                       weights: tuple[torch.Tensor, torch.Tensor], paged: PagedBatch,
                       rows: list[Row]) -> bool:
    """Eager steps per attention path, then the CUDA graph; False when its tokens differ."""
    device, batch = paged.anchors.device, paged.anchors.shape[0]
    tokens = batch * args.draft_block_size
    paths = {"torch": draft_attention_torch}
    if device.type == "cuda":
        paths["triton"] = draft_attention_triton
    elif _compiled.cpu_available():  # no grid: max_query_len means nothing to it
        paths["c++"] = lambda *a, max_query_len: draft_attention_cpu(*a)
    draft_batch = paged.draft
    eager_ms = {}
    for name, attention in paths.items():
        def step(attention=attention) -> torch.Tensor:
            return draft_step(drafter, *weights, paged.caches, paged.anchors, draft_batch,
                              attention)

        eager_ms[name] = median_ms(step, device, args.repeats, args.warmup)
        report(rows, {"what": "drafter_step", "path": name, "batch": batch, "tokens": tokens,
                      "ms_per_step": eager_ms[name]})
    if not args.cuda_graph:
        return True

    def triton_step(anchors: torch.Tensor, draft: DraftBatch) -> torch.Tensor:
        return draft_step(drafter, *weights, paged.caches, anchors, draft,
                          draft_attention_triton)

    # The proposer's graphs: inputs copied into static buffers, replay, output copied out.
    graphs = DraftGraphs(triton_step, [batch], draft_batch.block_table.shape[1],
                         args.draft_block_size, device)
    graphs.capture()
    equal = True
    for anchors in (paged.anchors, torch.randint_like(paged.anchors, 2, args.vocab)):
        equal &= torch.equal(graphs.run(anchors, draft_batch), triton_step(anchors, draft_batch))
    ms = median_ms(lambda: graphs.run(paged.anchors, draft_batch), device, args.repeats,
                   args.warmup)
    note = (f"  (eager {eager_ms['triton']:.3f} ms, {eager_ms['triton'] / ms:.2f}x; "
            f"draft tokens equal eager: {'yes' if equal else 'NO'})")
    report(rows, {"what": "drafter_step", "path": "triton+cuda-graph", "batch": batch,
                  "tokens": tokens, "ms_per_step": ms, "eager_ms_per_step": eager_ms["triton"],
                  "tokens_equal_eager": equal}, note)
    if args.profile:
        profile_kernels(lambda: triton_step(paged.anchors, draft_batch), args.repeats)
    return equal


def profile_kernels(step: Callable[[], torch.Tensor], repeats: int) -> None:
    """The GPU kernels of `repeats` eager steps by their total time, and their sum per step:
    the floor under a CUDA graph replay of the step."""
    from torch.profiler import ProfilerActivity, profile, schedule

    # Two steps before the recorded ones: the first profiled cycle also reported kernels that
    # ran before profiling began (a 30 ms GEMM of the reference path in a 7 ms step).
    with profile(activities=[ProfilerActivity.CUDA],
                 schedule=schedule(wait=1, warmup=1, active=repeats)) as prof:
        for _ in range(repeats + 2):
            step()
            torch.cuda.synchronize()
            prof.step()
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total", row_limit=15,
                       max_name_column_width=70))
    per_step_ms = sum(e.self_device_time_total for e in events) / repeats / 1000
    print(f"kernel time per step: {per_step_ms:.3f} ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    for name, gpu_value in GPU_SHAPES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {gpu_value} on CUDA, {CPU_SHAPES[name]} on CPU")
    parser.add_argument("--cache-block-size", type=int, default=16)
    parser.add_argument("--draft-block-size", type=int, default=16, help="queries per request")
    parser.add_argument("--new-tokens", type=int, default=7,
                        help="tokens injected per request and step (accepted + bonus)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dflash2", type=dflash2_option, default=None,
                        metavar=DFLASH2_METAVAR,
                        help="a DFlash2 drafter: conv_kernel_size, conv_group_size, "
                             "selector_rank, selector_top_k")
    parser.add_argument("--lilicorr", type=lilicorr_option, default=None,
                        metavar=LILICORR_METAVAR,
                        help="a LiLiCorr drafter: lilicorr_candidate_topk, lilicorr_num_layers, "
                             "lilicorr_num_heads, lilicorr_factor_dim")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also replay the drafter step from a CUDA graph (CUDA only)")
    parser.add_argument("--profile", action="store_true",
                        help="with --cuda-graph: the drafter step's kernels by time")
    parser.add_argument("--repeats", type=int, default=None, help="default 50 CUDA, 5 CPU")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    args.device = torch.device(args.device)
    on_gpu = args.device.type == "cuda"
    if on_gpu and args.device.index is None:
        # With an index, as the proposer's: the drafter's RoPE table is cached per device and
        # rebuilt on every call when "cuda" and "cuda:0" compare unequal.
        args.device = torch.device("cuda", torch.cuda.current_device())
    if args.cuda_graph and not on_gpu:
        parser.error("--cuda-graph needs a CUDA device")
    if args.profile and not args.cuda_graph:
        parser.error("--profile needs --cuda-graph")
    for name, value in (GPU_SHAPES if on_gpu else CPU_SHAPES).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    args.repeats = args.repeats or (50 if on_gpu else 5)
    return args


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    torch.manual_seed(0)
    config = {key: str(value) if isinstance(value, torch.device | torch.dtype) else value
              for key, value in vars(args).items()}
    print(f"device {device}, {args.dtype}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, intermediate "
          f"{args.intermediate}, {args.features} target features, vocab {args.vocab}, "
          f"context {args.context}, draft block {args.draft_block_size}, "
          f"cache block {args.cache_block_size}"
          + ("" if device.type == "cuda" else f", {torch.get_num_threads()} threads"))
    if device.type == "cuda" and not _compiled.cuda_available():
        print(f"CUDA extension not available ({_compiled.cuda_import_error}): no cuda path")
    drafter = random_drafter(drafter_config(args), device=device, dtype=args.dtype).eval()
    # The target's embedding and lm_head, which the drafter shares.
    weights = tuple(0.02 * torch.randn(args.vocab, args.hidden, dtype=args.dtype, device=device)
                    for _ in range(2))
    rows: list[Row] = []
    graphs_equal = True
    for batch in map(int, args.batches.split(",")):
        paged = paged_batch(args, batch, device)
        bench_kv_injection(args, drafter, paged, rows)
        bench_draft_attention(args, paged, rows)
        bench_verify(args, batch, device, rows)
        graphs_equal &= bench_drafter_step(args, drafter, weights, paged, rows)
        del paged  # the caches of the next batch size take its place
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "rows": rows}, f, indent=2)
    if not graphs_equal:
        print("FAIL: a CUDA graph's draft tokens differ from eager's")
    return 0 if graphs_equal else 1


if __name__ == "__main__":
    sys.exit(main())
