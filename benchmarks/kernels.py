"""Per-step time of every kernel path available here: KV injection and draft attention.

On CUDA: Qwen3-8B drafter shapes (hidden 4096, 5 layers, 32 heads, 8 KV heads, head_dim 128,
cache block 16, draft block 16, context ~1k), bf16; paths torch reference, Triton and, when
vllm_dflash._C is built, CUDA. On CPU: smaller shapes, fp32, the torch reference only.

    python benchmarks/kernels.py                      # defaults for the device found
    python benchmarks/kernels.py --batches 1,8 --context 4096 --repeats 100

KV injection writes `--new-tokens` tokens per request (the accepted ones plus the bonus) into all
layers: one call per step. Draft attention runs once per layer: per step = layers x per call.
Times are medians over --repeats calls, each timed with a device synchronisation.
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_dflash.kernels import _cuda
from vllm_dflash.kernels.draft_attention import draft_attention_reference, draft_attention_triton
from vllm_dflash.kernels.kv_injection import (
    kv_injection,
    kv_injection_reference,
    kv_injection_triton,
)
from vllm_dflash.layers import rope_cos_sin_cache

GPU_SHAPES = {"hidden": 4096, "layers": 5, "heads": 32, "kv_heads": 8, "head_dim": 128,
              "context": 1024}
CPU_SHAPES = {"hidden": 1024, "layers": 2, "heads": 8, "kv_heads": 2, "head_dim": 64,
              "context": 256}


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
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


def make_caches(args: argparse.Namespace, batch: int, device: torch.device) -> tuple:
    """Per-layer paged caches (vLLM-style strided views) and a shuffled block table."""
    tokens_per_request = args.context + args.draft_block_size
    blocks_per_request = -(-tokens_per_request // args.cache_block_size)
    num_blocks = batch * blocks_per_request
    caches = [
        torch.randn(num_blocks, args.cache_block_size, args.kv_heads, 2 * args.head_dim,
                    dtype=args.dtype, device=device).permute(0, 2, 1, 3)
        for _ in range(args.layers)
    ]
    block_table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_request)
    return caches, block_table.int()


def bench_kv_injection(args: argparse.Namespace, batch: int, device: torch.device) -> None:
    caches, block_table = make_caches(args, batch, device)
    n = args.new_tokens
    positions = (args.context + torch.arange(n, device=device)).repeat(batch)
    rows = torch.arange(batch, device=device).repeat_interleave(n)
    blocks = block_table[rows, positions // args.cache_block_size].long()
    slot_mapping = blocks * args.cache_block_size + positions % args.cache_block_size
    weight_rows = args.layers * 2 * args.kv_heads * args.head_dim
    inputs = (
        torch.randn(batch * n, args.hidden, dtype=args.dtype, device=device),
        positions,
        slot_mapping,
        torch.randn(weight_rows, args.hidden, dtype=args.dtype, device=device) / args.hidden**0.5,
        torch.ones(args.layers, args.head_dim, dtype=args.dtype, device=device),
        1e-6,
        rope_cos_sin_cache(args.head_dim, args.context + n, 1e6, device=device),
        caches,
    )
    paths = {"torch-reference": kv_injection_reference}
    if device.type == "cuda":
        paths["triton"] = kv_injection_triton
        if _cuda.available():
            paths["cuda"] = kv_injection  # the dispatcher picks the compiled op
    for name, fn in paths.items():
        ms = median_ms(lambda fn=fn: fn(*inputs), device, args.repeats, args.warmup)
        print(f"kv_injection     {name:16s} batch {batch:4d}  tokens {batch * n:6d}  "
              f"{ms:9.3f} ms/step")


def bench_draft_attention(args: argparse.Namespace, batch: int, device: torch.device) -> None:
    caches, block_table = make_caches(args, batch, device)
    b = args.draft_block_size
    tokens = batch * b
    inputs = (
        torch.randn(tokens, args.heads, args.head_dim, dtype=args.dtype, device=device),
        torch.randn(tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device=device),
        torch.randn(tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device=device),
        caches[0],
        block_table,
        torch.full((batch,), args.context, dtype=torch.int32, device=device),
        torch.arange(0, tokens + 1, b, dtype=torch.int32, device=device),
        args.head_dim**-0.5,
        args.causal,
        args.sliding_window,
    )
    paths = {"torch-reference": draft_attention_reference}
    if device.type == "cuda":
        paths["triton"] = lambda *a: draft_attention_triton(*a, max_query_len=b)
    for name, fn in paths.items():
        ms = median_ms(lambda fn=fn: fn(*inputs), device, args.repeats, args.warmup)
        print(f"draft_attention  {name:16s} batch {batch:4d}  tokens {tokens:6d}  "
              f"{ms:9.3f} ms/call  {ms * args.layers:9.3f} ms/step ({args.layers} layers)")


def main() -> None:
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
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="default 50 CUDA, 5 CPU")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    for name, value in (GPU_SHAPES if on_gpu else CPU_SHAPES).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    args.repeats = args.repeats or (50 if on_gpu else 5)
    torch.manual_seed(0)

    print(f"device {device}, {args.dtype}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, "
          f"context {args.context}, draft block {args.draft_block_size}, "
          f"cache block {args.cache_block_size}")
    if on_gpu and not _cuda.available():
        print(f"CUDA extension not available ({_cuda.import_error}): no cuda path")
    for batch in map(int, args.batches.split(",")):
        bench_kv_injection(args, batch, device)
        bench_draft_attention(args, batch, device)


if __name__ == "__main__":
    main()
