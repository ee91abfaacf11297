"""What vllm-dflash costs while it drafts nothing, in steady state: one process holds a plain
engine and a vllm-dflash engine (adaptive draft length) on the same target, warms both up on
the measured traffic, then alternates their generates of 2C prompts (ignore_eos) and prints
each pair's tokens/s ratio and the median. At T = 1 the tiny pair's drafter is accepted almost
never, so the policy keeps drafting off and the ratio is that of a drafting-off step to a
plain one. Alternating the two in one process keeps the machine's drift out of each ratio.

    python benchmarks/drafting_off_overhead.py --concurrency 4 --repeats 7 --max-tokens 384
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(REPO / "tests/fixtures/pair/target"))
    parser.add_argument("--draft", default=str(REPO / "tests/fixtures/pair/drafter"))
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/tiny-heldout-64.jsonl"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both engines in this process
    from vllm import LLM, SamplingParams

    from vllm_dflash.bench.methods import default_num_speculative_tokens

    c = args.concurrency
    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines][: 2 * c]
    common = {"model": args.target, "dtype": "float32", "enforce_eager": True,
              "max_model_len": 1024, "max_num_seqs": c, "seed": 0}
    engines = {
        "none": LLM(**common),
        "vllm-dflash": LLM(**common, speculative_config={
            "method": "dflash", "model": args.draft,
            "num_speculative_tokens": default_num_speculative_tokens(args.draft)}),
    }
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts, params, use_tqdm=False)
    ratios = []
    for repeat in range(args.repeats):
        tokens_per_s = {}
        for name, llm in engines.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            tokens_per_s[name] = tokens / (time.perf_counter() - start)
        ratios.append(tokens_per_s["vllm-dflash"] / tokens_per_s["none"])
        print(f"C={c} repeat {repeat}: none {tokens_per_s['none']:.0f} tokens/s, vllm-dflash "
              f"{tokens_per_s['vllm-dflash']:.0f} tokens/s, ratio {ratios[-1]:.3f}", flush=True)
    print(f"C={c}: vllm-dflash / none, median of {args.repeats} paired repeats: "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
