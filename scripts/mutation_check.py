"""Deliberate drafter-side bugs, and the engine tests that must catch them.

Greedy output equals no speculation whatever the drafter proposes, so a drafter that reads the
wrong context, position, layer or window is still lossless: only tests that measure acceptance
against a reference can see it. Each mutation below is applied to a copy of the tree; the
listed tests run against it and must fail. The unmutated tree runs them first and must pass.

    python scripts/mutation_check.py [--only NAME ...]

Prints a markdown table (the README's testing section keeps the last one) and exits non-zero
if a test fails unmutated or a mutation goes uncaught.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIR_ACCEPTANCE = "tests/test_pair_acceptance.py::test_acceptance_is_real_and_equals_reference"
E2E_ACCEPTANCE = ("tests/test_vllm_e2e.py::"
                  "test_greedy_batch_equals_no_speculation_and_acceptance_equals_reference")
E2E_SMALLER_K = ("tests/test_vllm_e2e.py::"
                 "test_smaller_k_equals_no_speculation_and_acceptance_equals_reference")
SLIDING = "tests/test_sliding_drafter.py"
DFLASH_TESTS = [PAIR_ACCEPTANCE, E2E_ACCEPTANCE, E2E_SMALLER_K]


@dataclass
class Mutation:
    name: str
    path: str
    old: str  # must occur exactly once in path
    new: str
    tests: list[str]


MUTATIONS = [
    Mutation(
        "context-token-missing",  # the drafter attends to one context token fewer
        "vllm_dflash/vllm/spec_decode.py",
        "context_lens=context_lens.to(torch.int32),",
        "context_lens=(context_lens - 1).to(torch.int32),",
        DFLASH_TESTS,
    ),
    Mutation(
        "positions-off-by-one",  # the block's RoPE positions start one past the anchor's
        "vllm_dflash/vllm/spec_decode.py",
        "anchor_positions=(target_positions[last_valid.long()] + 1).to(torch.int32),",
        "anchor_positions=(target_positions[last_valid.long()] + 2).to(torch.int32),",
        DFLASH_TESTS,
    ),
    Mutation(
        "wrong-target-layer",  # vLLM captures the layer below each one the drafter reads
        "vllm_dflash/vllm/drafting.py",
        '"target_layer_ids": list(cfg.target_layer_ids),',
        '"target_layer_ids": [max(i - 1, 0) for i in cfg.target_layer_ids],',
        DFLASH_TESTS,
    ),
    Mutation(
        "window-off-by-one",  # sliding-window layers see one key more than their window
        "vllm_dflash/vllm/drafting.py",
        "causal=cfg.layer_is_causal(layer), sliding_window=cfg.layer_window(layer),",
        "causal=cfg.layer_is_causal(layer),\n"
        "                sliding_window=cfg.layer_window(layer) and cfg.layer_window(layer) + 1,",
        [SLIDING],
    ),
    Mutation(
        "stale-anchor",  # the block starts from the last verified input, not the new token
        "vllm_dflash/vllm/spec_decode.py",
        "tokens = self.draft_runner.draft_tokens(next_token_ids, batch,",
        "tokens = self.draft_runner.draft_tokens(target_token_ids[last_valid.long()], batch,",
        DFLASH_TESTS,
    ),
]


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "runs", "bench_out", "__pycache__", "*.egg-info",
                                    "build", ".pytest_cache")
    shutil.copytree(ROOT, dest, ignore=ignore)


def mutate(tree: Path, mutation: Mutation) -> None:
    path = tree / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"{mutation.name}: {mutation.old!r} occurs {count} times in "
                         f"{mutation.path}; fix: update the mutation to the current source")
    path.write_text(text.replace(mutation.old, mutation.new))


def run_tests(tree: Path, tests: list[str]) -> tuple[list[str], float]:
    """The ids of the tests that fail on the tree (its vllm_dflash shadows the installed one),
    and the seconds they took."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                            check=False)
    failed = [line.removeprefix("FAILED ").split(" - ")[0] for line in result.stdout.splitlines()
              if line.startswith("FAILED ")]
    if result.returncode != 0 and not failed:  # collection or fixture errors
        failed = [result.stdout.strip().splitlines()[-1][:160]]
    return failed, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    args = parser.parse_args()
    mutations = [m for m in MUTATIONS if not args.only or m.name in args.only]
    failures = []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clean = Path(tmp) / "clean"
        copy_tree(clean)
        for tests in sorted({tuple(m.tests) for m in mutations}):
            failed, seconds = run_tests(clean, list(tests))
            rows.append(("(none)", "; ".join(failed) or "none fails", seconds))
            if failed:
                failures.append(f"unmutated tree fails {'; '.join(failed)}")
        for mutation in mutations:
            tree = Path(tmp) / mutation.name
            copy_tree(tree)
            mutate(tree, mutation)
            failed, seconds = run_tests(tree, mutation.tests)
            rows.append((mutation.name, "<br>".join(failed) or "NOT CAUGHT", seconds))
            if not failed:
                failures.append(f"{mutation.name} not caught")
            shutil.rmtree(tree)
    print("| mutation | failing tests | seconds |\n| --- | --- | --- |")
    for name, failed, seconds in rows:
        print(f"| {name} | {failed} | {seconds:.0f} |")
    if failures:
        raise SystemExit("; ".join(failures))


if __name__ == "__main__":
    main()
