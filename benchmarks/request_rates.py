"""How much requests differ: each request's conditional acceptance per draft position, from
its own drafts in one fixed-K greedy burst through `LLM()` (the tiny target by default).

    python benchmarks/request_rates.py --draft tests/fixtures/pair/drafter --name good
    python benchmarks/request_rates.py --draft runs/modest-drafter --name modest

Each call writes (or replaces) one drafter's rows of --out, which benchmarks/policy_sim.py
reads for its "per request" drafters. A request's rate at position i is
(accepted + 0.5) / (reached + 1) over its verified drafts, so that positions a request rarely
reached read near 0.5. Prints each request's mean accepted draft tokens per step, sorted.
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ABOUT = ("Per-request conditional acceptance per draft position (positions 1-K) of the tiny "
         "target's committed drafter ('good') and of benchmarks/modest_drafter.py --noise 7 "
         "('modest'): fixed K = 7, greedy, the first 32 prompts of tiny-heldout-64.jsonl x 128 "
         "tokens, one request each, through LLM() on the CPU build (fp32, eager); each rate "
         "(accepted + 0.5) / (reached + 1) over the request's verified drafts. Written by "
         "benchmarks/request_rates.py.")


def request_drafts(target: str, draft: str, prompts: list[str], max_tokens: int, k: int
                   ) -> list[list[tuple[int, int]]]:
    """Per request, in the order of their first drafts: (drafts verified, drafts accepted) of
    each of its steps."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    os.environ["VLLM_DFLASH_DRAFT_LENGTH"] = "fixed"
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dflash.vllm.scheduler import verified_drafts

    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024,
              max_num_seqs=len(prompts), seed=0,
              speculative_config={"method": "dflash", "model": draft,
                                  "num_speculative_tokens": k})
    steps, update = [], Scheduler.update_from_output

    def recording_update(self, scheduler_output, model_runner_output):
        steps.append(verified_drafts(scheduler_output, model_runner_output))
        return update(self, scheduler_output, model_runner_output)

    Scheduler.update_from_output = recording_update
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                     use_tqdm=False)
    finally:
        Scheduler.update_from_output = update
    drafts: dict[str, list[tuple[int, int]]] = {}
    for step in steps:
        for req_id, verified, accepted in step:
            drafts.setdefault(req_id, []).append((verified, accepted))
    return list(drafts.values())


def position_rates(drafts: list[tuple[int, int]], k: int) -> list[float]:
    verified = np.array([d[0] for d in drafts])
    accepted = np.array([d[1] for d in drafts])
    reached = np.array([(np.minimum(accepted + 1, verified) > i).sum() for i in range(k)])
    kept = np.array([(accepted > i).sum() for i in range(k)])
    return [round(float(r), 3) for r in (kept + 0.5) / (reached + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(REPO / "tests/fixtures/pair/target"))
    parser.add_argument("--draft", required=True)
    parser.add_argument("--name", required=True, help="the drafter's key in --out")
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/tiny-heldout-64.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "benchmarks/tiny-request-rates.json"))
    args = parser.parse_args()
    lines = Path(args.prompts).read_text().splitlines()[: args.num_prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    per_request = request_drafts(args.target, args.draft, prompts, args.max_tokens, args.k)
    means = sorted(float(np.mean([a for _, a in d])) for d in per_request if d)
    print(f"{args.name}: mean accepted draft tokens per step, per request:",
          " ".join(f"{m:.1f}" for m in means))
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.exists() else {}
    table["about"] = ABOUT
    table[args.name] = [position_rates(d, args.k) for d in per_request if d]
    rows = {key: value for key, value in table.items() if key != "about"}
    text = "{" + f'"about": {json.dumps(ABOUT)}'
    for key, value in rows.items():
        text += f',\n"{key}": [\n  ' + ",\n  ".join(json.dumps(r) for r in value) + "]"
    out.write_text(text + "}\n")


if __name__ == "__main__":
    main()
