"""One run through the OpenAI server on 127.0.0.1: C streaming clients keep C requests in
flight (closed loop) until every prompt is done; TTFT and inter-token latency per chunk."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from vllm_dflash.bench.counters import from_prometheus, peak_rss_mib
from vllm_dflash.bench.runspec import RunSpec, measured

MODEL_NAME = "bench"
READY_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 1800


@dataclass
class Stream:
    """One streamed completion: when it was sent, when each token chunk arrived, the tokens."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def run(spec: RunSpec) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(server_command(spec, port))  # logs go to this run's log
    try:
        wait_ready(server, url)
        stream_all(url, spec.warmup_prompts(), spec.warmup_tokens(), 0.0, spec.concurrency)
        before = from_prometheus(get(url + "/metrics"))
        start = time.perf_counter()
        streams = stream_all(url, spec.prompts, spec.max_tokens, spec.temperature,
                             spec.concurrency)
        seconds = time.perf_counter() - start
        counters = from_prometheus(get(url + "/metrics")).minus(before)
        rss = peak_rss_mib(server.pid)
    finally:
        stop(server)
    token_ids = [s.token_ids for s in streams]
    return measured(token_ids, seconds, counters, rss) | latencies(streams)


def server_command(spec: RunSpec, port: int) -> list[str]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.target,
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", spec.dtype, "--max-num-seqs", str(spec.concurrency), "--seed", "0",
    ]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.max_model_len:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    config = spec.speculative_config()
    if config:
        cmd += ["--speculative-config", json.dumps(config)]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode} before it was ready")
        try:
            get(url + "/health")
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"server not ready in {READY_TIMEOUT_S} s")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def stream_all(url: str, prompts: list[str], max_tokens: int, temperature: float,
               concurrency: int) -> list[Stream]:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: stream_completion(url, p, max_tokens, temperature),
                              prompts))


def stream_completion(url: str, prompt: str, max_tokens: int, temperature: float) -> Stream:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    stream = Stream(start=time.perf_counter())
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
            if ids:
                stream.chunk_times.append(time.perf_counter())
                stream.token_ids.extend(ids)
    return stream


def latencies(streams: list[Stream]) -> dict:
    """TTFT per request; inter-token latency = gap between token chunks (a chunk holds every
    token of one engine step, so with speculation it can hold several)."""
    ttft = [s.chunk_times[0] - s.start for s in streams if s.chunk_times]
    itl = [b - a for s in streams for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    return {"ttft_ms": percentiles_ms(ttft), "itl_ms": percentiles_ms(itl)}


def percentiles_ms(seconds: list[float]) -> dict | None:
    if not seconds:
        return None
    p50, p99 = np.percentile(np.array(seconds) * 1000.0, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}
