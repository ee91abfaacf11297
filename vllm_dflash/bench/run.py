"""One benchmark run in a process of its own, so its peak RSS and vLLM's metrics registry
belong to it alone.

Runs are forked from a fork server that has imported vLLM once (importing it takes tens of
seconds on a small CPU machine); nothing engine-related exists before the fork, and each run
sets its method's environment before it builds its engine. The process writes its numbers
to runs/NAME.json and its output to logs/NAME.log.
"""

import json
import multiprocessing
import os
import sys
from dataclasses import asdict
from pathlib import Path

from vllm_dflash.bench.methods import method_env
from vllm_dflash.bench.runspec import RunSpec

PRELOAD = ["vllm", "vllm.entrypoints.llm"]


def run_in_subprocess(spec: RunSpec, out_dir: Path, repeat: int = 0) -> dict:
    """Run spec in a fresh process; a failed run returns its error instead of numbers."""
    name = f"{spec.mode}-{spec.method}-c{spec.concurrency}" + (f"-r{repeat}" if repeat else "")
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    result_path, log_path = out_dir / "runs" / f"{name}.json", out_dir / "logs" / f"{name}.log"
    result_path.unlink(missing_ok=True)
    # Offline, the engine lives in the measured process; the server runs its engine core in a
    # child process of its own, as it does by default.
    env = method_env(spec.method) | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if spec.mode == "offline" else "1"}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=child, args=(asdict(spec), env, log_path, result_path))
    process.start()
    process.join()
    header = {"method": spec.method, "concurrency": spec.concurrency, "repeat": repeat,
              "log": str(log_path)}
    if process.exitcode != 0:
        return header | {"error": f"exit code {process.exitcode}, see {log_path}"}
    return header | json.loads(result_path.read_text())


def child(spec: dict, env: dict[str, str], log_path: Path, result_path: Path) -> None:
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    os.environ.update(env)  # this run's own process (forked for it), before its engine exists
    run_spec = RunSpec(**spec)
    if run_spec.mode == "server":
        from vllm_dflash.bench.server import run
    else:
        from vllm_dflash.bench.offline import run
    result_path.write_text(json.dumps(run(run_spec)))
