"""Mean acceptance length of a pair's drafter on its held-out chat prompts, per category.

Greedy, every step drafting K tokens (VLLM_DFLASH_DRAFT_LENGTH=fixed), through vllm.LLM();
each category's prompts run as one batch. Prints a markdown table.

    python scripts/pair_acceptance.py --pair runs/smollm2 [--max-tokens 256] [-k 7]
"""

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

os.environ["VLLM_DFLASH_DRAFT_LENGTH"] = "fixed"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def counters(llm) -> tuple[float, float]:
    m = {metric.name: metric for metric in llm.get_metrics()}
    return m["vllm:spec_decode_num_drafts"].value, m["vllm:spec_decode_num_accepted_tokens"].value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, required=True,
                        help="folder with target/, drafter/ and heldout.jsonl")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    records = [json.loads(line) for line in (args.pair / "heldout.jsonl").read_text().splitlines()]
    by_category = defaultdict(list)
    for record in records:
        by_category[record["category"]].append(record["prompt"])
    llm = LLM(model=str(args.pair / "target"), dtype="float32", enforce_eager=True,
              max_model_len=2048, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": str(args.pair / "drafter"),
                                  "num_speculative_tokens": args.num_speculative_tokens})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows, total = [], [0.0, 0.0, 0]
    for category, prompts in by_category.items():
        before = counters(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        drafts, accepted = (now - then for now, then in zip(counters(llm), before))
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append((category, len(prompts), tokens, 1 + accepted / drafts))
        total = [total[0] + drafts, total[1] + accepted, total[2] + tokens]
    rows.append(("all", len(records), total[2], 1 + total[1] / total[0]))
    print(f"K = {args.num_speculative_tokens}, greedy, at most {args.max_tokens} tokens\n")
    print("| category | prompts | tokens | mean acceptance length |\n| --- | --- | --- | --- |")
    for category, count, tokens, tau in rows:
        print(f"| {category} | {count} | {tokens} | {tau:.2f} |")


if __name__ == "__main__":
    main()
