"""Generate with DFlash through vllm.LLM() on a tiny local model pair; nothing is downloaded.

Uses the small trained pair in tests/fixtures/pair when present (real acceptance), otherwise
builds a random-weight target and drafter (correct output, near-zero acceptance).

    python examples/quickstart.py [--num-speculative-tokens 7] [--max-tokens 96]
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM misreads memory on some VMs
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "pair"


def model_pair(workdir: Path) -> tuple[Path, Path, list[str]]:
    if (PAIR / "drafter" / "config.json").exists():
        lines = (PAIR / "heldout_prompts.jsonl").read_text().splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines]
        return PAIR / "target", PAIR / "drafter", prompts[:8]
    from vllm_dflash.tiny import write_random_drafter, write_random_target

    target = write_random_target(workdir / "target")
    write_random_drafter(workdir / "drafter", target, block_size=8)
    return target, workdir / "drafter", ["def fibonacci(n):", "import os\n", "class Stack:"]


def spec_counters(llm) -> tuple[float, float, list[float]]:
    """vLLM's spec-decode counters: drafts, accepted tokens, accepted tokens per position."""
    m = {metric.name: metric for metric in llm.get_metrics()}
    return (
        m["vllm:spec_decode_num_drafts"].value,
        m["vllm:spec_decode_num_accepted_tokens"].value,
        list(m["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        target, drafter, prompts = model_pair(Path(tmp))
        llm = LLM(
            model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024,
            disable_log_stats=False,
            speculative_config={"method": "dflash", "model": str(drafter),
                                "num_speculative_tokens": args.num_speculative_tokens},
        )
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        drafts0, accepted0, per_pos0 = spec_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    for out in outputs[:3]:
        print(f"--- {out.prompt!r}\n{out.outputs[0].text}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts, accepted, per_pos = spec_counters(llm)
    drafts = max(drafts - drafts0, 1)
    print(f"\n{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s")
    print(f"mean acceptance length: {1 + (accepted - accepted0) / drafts:.2f}")
    rates = [(a - a0) / drafts for a, a0 in zip(per_pos, per_pos0)]
    print("acceptance per position: " + " ".join(f"{r:.2f}" for r in rates))


if __name__ == "__main__":
    main()
