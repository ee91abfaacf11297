"""Checks vllm-dflash's vLLM hook contract (vllm_dflash/vllm/contract.py) against a vLLM
release's own sources, read from its wheel, not installed: how a new vLLM release is checked.

    python scripts/check_vllm_hooks.py --release 0.33.0      # downloads the wheel (pip)
    python scripts/check_vllm_hooks.py --wheel vllm-0.33.0-....whl
    python scripts/check_vllm_hooks.py --source DIR          # DIR holds vllm/

Prints every missing or changed hook and exits 1 if there is one.
"""

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_dflash.vllm.contract import HOOKS, MRV2_HOOKS, broken_hooks_in_sources


def download_wheel(release: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", f"vllm=={release}", "-d", str(into)], check=True)
    wheels = sorted(into.glob(f"vllm-{release}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip downloaded no wheel of vllm=={release} into {into}")
    return wheels[0]


def unpack_sources(wheel: Path, into: Path) -> Path:
    """The wheel's vllm/**/*.py under `into`; returns `into`."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into, [n for n in archive.namelist()
                                  if n.startswith("vllm/") and n.endswith(".py")])
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--release", help="a vLLM version on the package index, e.g. 0.33.0")
    where.add_argument("--wheel", type=Path, help="a downloaded vLLM wheel")
    where.add_argument("--source", type=Path, help="a directory holding vllm/")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.source is not None:
            root, name = args.source, str(args.source)
        else:
            wheel = args.wheel or download_wheel(args.release, tmp)
            root, name = unpack_sources(wheel, tmp / "src"), wheel.name
        problems = broken_hooks_in_sources(root)
    for problem in problems:
        print(f"MISSING {problem}")
    total = len(HOOKS) + len(MRV2_HOOKS)
    print(f"{name}: {total - len(problems)} of {total} hooks present")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
