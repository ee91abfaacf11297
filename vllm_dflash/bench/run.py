"""One benchmark run in its own subprocess: `python -m vllm_dflash.bench.run SPEC RESULT`.

The parent writes the RunSpec as JSON, the child builds the engine (offline or server), writes
its measurements as JSON and exits; its own process makes the peak RSS and vLLM's metrics
registry belong to this run alone.
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from vllm_dflash.bench.methods import method_env
from vllm_dflash.bench.runspec import RunSpec


def run_in_subprocess(spec: RunSpec, out_dir: Path) -> dict:
    """Run spec in a fresh Python process; a failed run returns its error instead of numbers."""
    name = f"{spec.mode}-{spec.method}-c{spec.concurrency}"
    runs, logs = out_dir / "runs", out_dir / "logs"
    runs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = runs / f"{name}.spec.json", runs / f"{name}.json"
    log_path = logs / f"{name}.log"
    spec_path.write_text(json.dumps(asdict(spec)))
    result_path.unlink(missing_ok=True)
    # Offline, the engine lives in the measured process; the server runs its engine core in a
    # child process of its own, as it does by default.
    multiprocessing = "0" if spec.mode == "offline" else "1"
    env = {**os.environ, **method_env(spec.method), "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    cmd = [sys.executable, "-m", "vllm_dflash.bench.run", str(spec_path), str(result_path)]
    with open(log_path, "w") as log:
        result = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, env=env)
    header = {"method": spec.method, "concurrency": spec.concurrency, "log": str(log_path)}
    if result.returncode != 0:
        return header | {"error": f"exit code {result.returncode}, see {log_path}"}
    return header | json.loads(result_path.read_text())


def main(spec_path: str, result_path: str) -> None:
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    if spec.mode == "server":
        from vllm_dflash.bench.server import run
    else:
        from vllm_dflash.bench.offline import run
    Path(result_path).write_text(json.dumps(run(spec)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
