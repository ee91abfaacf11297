"""The `vllm-dflash bench` subcommand: every method on the same prompts, interleaved.

For each concurrency C, each method runs in turn in a fresh engine of its own (a subprocess,
capped at max_num_seqs = C), with a warm-up, on the same requests (greedy unless
--temperature); then the report compares every method to no speculation at that C.
"""

import argparse
import json
import os
import platform
from pathlib import Path

from vllm_dflash.bench.methods import check_methods, default_num_speculative_tokens
from vllm_dflash.bench.prompts import load_prompts, requests_for
from vllm_dflash.bench.report import (
    compare_to_baseline,
    median_of_repeats,
    paired_ratios,
    write_report,
)
from vllm_dflash.bench.run import run_in_subprocess
from vllm_dflash.bench.runspec import RunSpec
from vllm_dflash.train.progress import progress_bar


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark speculative methods against no speculation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="target model dir or hub id")
    p.add_argument("--draft", required=True, help="DFlash drafter dir or hub id")
    p.add_argument("--prompts", required=True,
                   help='JSONL of {"prompt": "..."} lines, or of {"messages": [...]} with --chat')
    p.add_argument("--chat", action="store_true",
                   help="render each line's messages (or prompt, as one user turn) with the "
                        "target's chat template, as a chat client's requests reach the model")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64],
                   help="comma-separated concurrencies (default: 1,4,16,64)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy, and "
                   "outputs are compared with no speculation's)")
    p.add_argument("--speculative-config", type=json.loads, default={},
                   help="more --speculative-config keys for the DFlash methods, as JSON, e.g. "
                   "'{\"draft_sample_method\": \"probabilistic\"}' or "
                   "'{\"rejection_sample_method\": \"synthetic\", "
                   "\"synthetic_acceptance_length\": 6.5}'")
    p.add_argument("--methods", type=name_list,
                   default=["none", "vllm-dflash", "vllm-inproc-dflash", "ngram"],
                   help="comma-separated, from none,vllm-dflash,vllm-inproc-dflash,ngram and "
                   "vllm-dflash-kN (vllm-dflash with a fixed draft length N; vllm-dflash "
                   "itself chooses the length per request and step), each also with +lookup "
                   "(prompt-lookup drafts beside the drafter's)")
    p.add_argument("--server", action="store_true",
                   help="through the OpenAI server and streaming clients (default: LLM())")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft length (default: the drafter's block_size - 1)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N prompts (default: all)")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, auto on GPU")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for CPU, off on GPU")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every (method, concurrency), interleaved; the report keeps "
                   "each one's median run by tokens/s (default: 1)")
    p.add_argument("--out", default="bench_out", help="output dir (default: bench_out)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    check_methods(args.methods)
    gpu = gpu_name()
    prompts = load_prompts(args.prompts, args.num_prompts,
                           args.target if args.chat else None)
    base = {
        "mode": "server" if args.server else "offline",
        "target": args.target, "draft": args.draft, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "speculative_extra": args.speculative_config,
        "num_speculative_tokens": args.num_speculative_tokens
        or default_num_speculative_tokens(args.draft),
        "dtype": args.dtype or ("auto" if gpu else "float32"),
        "enforce_eager": gpu is None if args.enforce_eager is None else args.enforce_eager,
        "max_model_len": args.max_model_len,
    }
    out = Path(args.out)
    results = run_all(base, prompts, args.concurrency, args.methods, out, args.repeats)
    meta = base | {"prompts": args.prompts, "chat": args.chat, "num_prompts": len(prompts),
                   "concurrency": args.concurrency, "methods": args.methods, "gpu": gpu,
                   "repeats": args.repeats, "cpu_count": os.cpu_count(),
                   "machine": platform.platform()}
    rows = compare_to_baseline(median_of_repeats(results), greedy=args.temperature == 0)
    print(write_report(out, meta, rows, paired_ratios(results, args.methods)))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")


def run_all(base: dict, prompts: list[str], concurrencies: list[int], methods: list[str],
            out: Path, repeats: int = 1) -> list[dict]:
    """Concurrency-major, then repeat, then method: methods alternate, so load drift hits
    them all, in the order `method_order` gives each repeat."""
    bar = progress_bar(total=len(concurrencies) * repeats * len(methods), desc="bench")
    results = []
    for concurrency in concurrencies:
        for repeat in range(repeats):
            for method in method_order(methods, repeat):
                bar.set_postfix_str(f"{method} C={concurrency} #{repeat + 1}")
                spec = RunSpec(method=method, concurrency=concurrency,
                               prompts=requests_for(prompts, concurrency), **base)
                results.append(run_in_subprocess(spec, out, repeat))
                bar.update()
    bar.close()
    return results


def method_order(methods: list[str], repeat: int) -> list[str]:
    """The order of the methods in a repeat: row `repeat` of a Williams design. A run can
    slow down or speed up the next one (caches, the memory the last process gave back, the
    machine's other jobs); over len(methods) repeats (twice that for an odd count) every
    method runs first once and right after every other method once, so no method always
    follows the same one. (Shifting one order round does not do that: it keeps the
    neighbours.)"""
    n = len(methods)
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [methods[i] for i in rows[repeat % len(rows)]]


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None
