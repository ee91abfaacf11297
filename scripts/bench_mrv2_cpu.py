"""`vllm-dflash bench` on Model Runner V2 on this CPU, with every Triton kernel interpreted
(tests/mrv2_cpu.py): every run's process registers the stand-in Triton backend at start-up
(a sitecustomize module) and VLLM_USE_V2_MODEL_RUNNER=1 puts vllm-dflash and vLLM's in-tree
DFlash alike on MRV2. The interpreter dominates every step, so the numbers compare the work
each method adds on MRV2, not GPU speed.

    VLLM_CPU_KVCACHE_SPACE=1 python scripts/bench_mrv2_cpu.py --target T --draft D --methods none,vllm-dflash-k7,vllm-inproc-dflash ...

(the arguments are vllm-dflash bench's)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    with tempfile.TemporaryDirectory() as site:
        Path(site, "sitecustomize.py").write_text("from tests.mrv2_cpu import enable\n\nenable()\n")
        path = [site, str(REPO), os.environ.get("PYTHONPATH")]
        env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="1",
                   PYTHONPATH=os.pathsep.join(filter(None, path)))
        return subprocess.call([sys.executable, "-m", "vllm_dflash.cli", "bench", *sys.argv[1:]],
                               env=env)


if __name__ == "__main__":
    sys.exit(main())
