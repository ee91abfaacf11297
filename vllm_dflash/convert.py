"""The `vllm-dflash convert` subcommand: a drafter checkpoint rewritten in the z-lab or the
speculators schema, with the same weights (names, values and dtype)."""

import argparse
from pathlib import Path

from vllm_dflash.checkpoint import load_drafter, save_drafter
from vllm_dflash.config import DFlashConfigError

SCHEMAS = ("z-lab", "speculators")


def convert(src: str | Path, dst: str | Path, schema: str,
            verifier: str | Path | None = None) -> None:
    """Write the drafter at src (a directory or hub id, in either schema) to dst in schema;
    verifier: the target's hub id or directory, which a speculators config names."""
    check_no_checkpoint(Path(dst))
    save_drafter(load_drafter(src), dst, schema=schema, verifier=verifier)


def check_no_checkpoint(path: Path) -> None:
    """Refuse a dst with a checkpoint in it: its other *.safetensors would load with ours."""
    held = sorted(p.name for p in (path.glob("*.safetensors") if path.is_dir() else ()))
    if held or (path / "config.json").exists():
        raise DFlashConfigError(
            f"{str(path)!r} already holds a checkpoint ({', '.join(held) or 'config.json'}); "
            "fix: pass a new or empty directory as DST"
        )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `convert` with the CLI's subparsers."""
    p = subparsers.add_parser(
        "convert",
        help="rewrite a drafter checkpoint in the z-lab or the speculators schema",
        description=__doc__,
    )
    p.add_argument("src", help="drafter directory or hub id, in either schema")
    p.add_argument("dst", help="new directory for the converted drafter")
    p.add_argument("--to", required=True, choices=SCHEMAS, help="the schema to write")
    p.add_argument(
        "--verifier",
        help="the target's hub id or directory, which a speculators config.json names "
        "(speculators_config.verifier); default: none named",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Convert; a checkpoint that cannot be converted exits with the error naming the fix."""
    try:
        convert(args.src, args.dst, args.to, args.verifier)
    except DFlashConfigError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {args.dst} ({args.to})")
