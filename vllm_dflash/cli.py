"""`vllm-dflash` command line: one subcommand per module (`train`, `bench`, `pair`, `convert`)."""

import argparse

from vllm_dflash import convert as convert_command
from vllm_dflash.bench import command as bench_command
from vllm_dflash.pairs import command as pair_command
from vllm_dflash.train import command as train_command

SUBCOMMANDS = (train_command, bench_command, pair_command, convert_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-dflash", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
