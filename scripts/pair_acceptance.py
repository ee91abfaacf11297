"""Mean acceptance length of a pair's drafter on its held-out chat prompts, per category.

Greedy, every step drafting K tokens (VLLM_DFLASH_DRAFT_LENGTH=fixed), through vllm.LLM();
each category's prompts run as one batch. Prints a markdown table.

    python scripts/pair_acceptance.py --pair runs/smollm2 [--max-tokens 256] [-k 7] \
        [--prompt-lookup]
"""

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

os.environ["VLLM_DFLASH_DRAFT_LENGTH"] = "fixed"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, required=True,
                        help="folder with target/, drafter/ and heldout.jsonl")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="prompt-lookup drafts beside the drafter's "
                        "(VLLM_DFLASH_PROMPT_LOOKUP=on)")
    args = parser.parse_args()
    os.environ["VLLM_DFLASH_PROMPT_LOOKUP"] = "on" if args.prompt_lookup else "off"

    from vllm import LLM, SamplingParams

    from vllm_dflash.bench.counters import SpecCounters, from_llm_metrics

    records = [json.loads(line) for line in (args.pair / "heldout.jsonl").read_text().splitlines()]
    by_category = defaultdict(list)
    for record in records:
        by_category[record["category"]].append(record["prompt"])
    llm = LLM(model=str(args.pair / "target"), dtype="float32", enforce_eager=True,
              max_model_len=2048, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": str(args.pair / "drafter"),
                                  "num_speculative_tokens": args.num_speculative_tokens})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows, total, total_tokens = [], SpecCounters(), 0
    for category, prompts in by_category.items():
        before = from_llm_metrics(llm.get_metrics())
        outputs = llm.generate(prompts, params, use_tqdm=False)
        spec = from_llm_metrics(llm.get_metrics()).minus(before)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append((category, len(prompts), tokens, 1 + spec.accepted / spec.drafts))
        total, total_tokens = total.plus(spec), total_tokens + tokens
    rows.append(("all", len(records), total_tokens, 1 + total.accepted / total.drafts))
    lookup = ", prompt lookup" if args.prompt_lookup else ""
    print(f"K = {args.num_speculative_tokens}, greedy, at most {args.max_tokens} tokens{lookup}\n")
    print("| category | prompts | tokens | mean acceptance length |\n| --- | --- | --- | --- |")
    for category, count, tokens, tau in rows:
        print(f"| {category} | {count} | {tokens} | {tau:.2f} |")


if __name__ == "__main__":
    main()
