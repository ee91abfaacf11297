"""`vllm serve` with the plugin on 127.0.0.1, on the trained pair: the OpenAI endpoints give the
same greedy text as a server without speculation, streaming or not, and /metrics shows vLLM's
spec-decode counters, whose acceptance for held-out prompts is this package's torch loop's.
Under load (64 concurrent streaming clients, 3 rounds of mixed prompt lengths and sampling
settings) every request succeeds, every greedy output is the plain server's under the same load,
and memory returns to its idle level after each round."""

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import psutil
import pytest

from tests.engines import (
    MAX_MODEL_LEN,
    TRAINED,
    Pair,
    heldout_ids,
    own_loop_acceptance,
    prompts_of_lengths,
)

START_TIMEOUT_S = 600  # two servers start side by side on a 2-core machine
SETTLE_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, speculative_config: dict | None, log_path: str,
                 extra_args: tuple[str, ...] = (), extra_env: dict | None = None) -> None:
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
        ]
        if speculative_config:
            cmd += ["--speculative-config", json.dumps(speculative_config)]
        cmd += extra_args
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", **(extra_env or {})}
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(2)
        raise TimeoutError(f"server not ready in {START_TIMEOUT_S} s: {self.log.name}")

    def post(self, path: str, body: dict, headers: dict | None = None) -> bytes:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """Servers launched side by side: ready on entry, stopped on exit."""
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        yield servers
    finally:
        for server in servers:
            server.stop()


def plain_and_dflash_servers(root: Path, pair: Pair) -> AbstractContextManager[list[Server]]:
    """A server without speculation and one with the plugin (K=7), started side by side."""
    spec = {"method": "dflash", "model": str(pair.drafter), "num_speculative_tokens": 7}
    return running([Server(str(pair.target), None, str(root / "plain.log")),
                    Server(str(pair.target), spec, str(root / "dflash.log"))])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with plain_and_dflash_servers(tmp_path_factory.mktemp("serve"), TRAINED) as started:
        yield started


def completion_text(server: Server, stream: bool) -> str:
    body = {"model": server_model(server), "prompt": "def fibonacci(n):", "max_tokens": 40,
            "temperature": 0.0, "stream": stream}
    raw = server.post("/v1/completions", body)
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    return "".join(chunk["choices"][0]["text"] for chunk in sse_chunks(raw))


def chat_text(server: Server, stream: bool) -> str:
    body = {"model": server_model(server), "max_tokens": 40, "temperature": 0.0,
            "stream": stream, "messages": [{"role": "user", "content": "Write a loop."}]}
    raw = server.post("/v1/chat/completions", body)
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    return "".join(
        chunk["choices"][0]["delta"].get("content") or ""
        for chunk in sse_chunks(raw) if chunk["choices"]
    )


def sse_chunks(raw: bytes) -> list[dict]:
    lines = [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def server_model(server: Server) -> str:
    return json.loads(server.get("/v1/models"))["data"][0]["id"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_no_speculation(servers, stream):
    plain, dflash = servers
    assert completion_text(dflash, stream) == completion_text(plain, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_no_speculation(servers, stream):
    plain, dflash = servers
    assert chat_text(dflash, stream) == chat_text(plain, stream)


def test_metrics_show_spec_decode_counters(servers):
    _, dflash = servers
    completion_text(dflash, stream=False)
    metrics = dflash.get("/metrics")
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "num_accepted_tokens_per_pos"):
        assert f"vllm:spec_decode_{name}" in metrics
    drafts = [line for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0


def settled_counters(server: Server):
    """The server's spec-decode counters once two reads a second apart agree (the API server
    records a step's stats as it handles the step's outputs)."""
    from vllm_dflash.bench.counters import from_prometheus

    counters = from_prometheus(server.get("/metrics"))
    for _ in range(10):
        time.sleep(1)
        again = from_prometheus(server.get("/metrics"))
        if again == counters:
            break
        counters = again
    return counters


def test_served_drafts_are_accepted_as_in_the_torch_loop(servers):
    # Held-out prompts one at a time: the acceptance the server counts for them is the torch
    # loop's on the same tokens, within test_vllm_e2e's tolerance (0.05).
    _, dflash = servers
    prompt_ids, max_tokens = heldout_ids(4), 40
    before = settled_counters(dflash)
    for ids in prompt_ids:
        dflash.post("/v1/completions", {"model": server_model(dflash), "prompt": ids,
                                        "max_tokens": max_tokens, "temperature": 0.0,
                                        "ignore_eos": True})
    counters = settled_counters(dflash).minus(before)
    acceptance = 1 + counters.accepted / counters.drafts
    reference = own_loop_acceptance(TRAINED, prompt_ids, max_tokens, 7)
    assert reference > 3 and abs(acceptance - reference) <= 0.05, (acceptance, reference)


def test_logit_bias_and_min_p_are_accepted_by_the_server(servers):
    # vLLM's API server refuses both for every speculative method; with the plugin the greedy
    # text under a bias equals the plain server's, and min_p is accepted.
    plain, dflash = servers
    body = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0.0,
            "logit_bias": {"13": 5.0, "200": -100.0}}
    texts = [json.loads(s.post("/v1/completions", {**body, "model": server_model(s)}))
             ["choices"][0]["text"] for s in (plain, dflash)]
    assert texts[1] == texts[0]
    sampled = {"model": server_model(dflash), "prompt": "def f(x):", "max_tokens": 8,
               "temperature": 1.0, "min_p": 0.2}
    assert json.loads(dflash.post("/v1/completions", sampled))["choices"][0]["text"] is not None


def metric(server, name: str) -> float:
    """A vLLM gauge or counter from the server's /metrics (label sets summed)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in server.get("/metrics").splitlines()
              if line.startswith((name + "{", name + " "))]
    assert values, name
    return sum(values)


def wait_idle(server) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while (metric(server, "vllm:num_requests_running")
           or metric(server, "vllm:num_requests_waiting")):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.2)


# ---- under load ---------------------------------------------------------------------------

NUM_CLIENTS = 64
ROUNDS = 3
PROMPT_LENGTHS = (1, 6, 23, 57, 120, 260)
REQUEST_TIMEOUT_S = 300
# How much more the engine process with the plugin may grow than the one without, from the end
# of the first round to the end of the last (measured here: 0 to 55 MiB from cache warm-up).
RSS_MARGIN_MIB = 96


def request_bodies(target: Path, model: str) -> list[dict]:
    """NUM_CLIENTS requests: prompt lengths and sampling settings cycle independently.

    Sampled requests carry seeds: under load their prompts are prefilled in chunks, which vLLM
    0.32's CPU build does for seeded requests only with the plugin's fix."""
    prompts = prompts_of_lengths(target, PROMPT_LENGTHS * 11, seed=1)
    settings = [
        {"temperature": 0.0},
        {"temperature": 0.0, "stop": ["e"]},
        {"temperature": 0.8},
        {"temperature": 1.0, "top_k": 20},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0.0, "presence_penalty": 0.5},
        {"temperature": 1.0, "top_k": 5, "top_p": 0.8},
    ]
    bodies = []
    for i in range(NUM_CLIENTS):
        body = {"model": model, "prompt": prompts[i]["prompt_token_ids"],
                "max_tokens": 16 + i % 9, "stream": True,
                "stream_options": {"include_usage": True}, **settings[i % len(settings)]}
        if body["temperature"] > 0:
            body["seed"] = i
        bodies.append(body)
    return bodies


def stream_completion(server: Server, body: dict) -> tuple[str, str, int]:
    """Stream one completion; return (text, finish reason, completion tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        text, finish, tokens, done = "", None, None, False
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            if "choices" not in chunk:  # vLLM streams an error as a data chunk
                raise RuntimeError(f"error in stream: {chunk}")
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        if not done or finish is None or tokens is None:
            raise RuntimeError(f"incomplete stream: done={done} finish={finish} usage={tokens}")
        return text, finish, tokens
    finally:
        conn.close()


def run_round(server: Server, bodies: list[dict], order_seed: int) -> list:
    """All bodies at once from NUM_CLIENTS threads, in a shuffled order; results in body order
    (an exception instead of a result where a request failed)."""
    order = list(range(len(bodies)))
    random.Random(order_seed).shuffle(order)
    results: list = [None] * len(bodies)
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool:
        futures = {i: pool.submit(stream_completion, server, bodies[i]) for i in order}
        for i, future in futures.items():
            try:
                results[i] = future.result()
            except Exception as err:  # noqa: BLE001 (every failure is collected, asserted on)
                results[i] = err
    return results


def engine_rss_mib(server: Server) -> float:
    """Resident memory of the server's engine core process."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    engines = [c for c in children if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    assert len(engines) == 1, [(c.pid, c.name()) for c in children]
    return engines[0].memory_info().rss / 2**20


def greedy_twin(body: dict) -> dict:
    """The same request without sampling: what the server without speculation runs."""
    kept = {k: v for k, v in body.items() if k not in ("top_k", "top_p")}
    return {**kept, "temperature": 0.0}


def check_round(bodies: list[dict], results: list) -> None:
    failed = [(i, r) for i, r in enumerate(results) if not isinstance(r, tuple)]
    assert failed == [], failed
    for body, (_, finish, tokens) in zip(bodies, results, strict=True):
        assert finish in ("stop", "length")
        assert 0 < tokens <= body["max_tokens"]


def test_concurrent_streaming_load(servers):
    plain, dflash = servers
    bodies = request_bodies(TRAINED.target, server_model(dflash))
    plain_bodies = [greedy_twin(body) for body in bodies]
    greedy = [i for i, body in enumerate(bodies) if body == plain_bodies[i]]
    assert 0 < len(greedy) < NUM_CLIENTS
    idle_usage = {server: metric(server, "vllm:kv_cache_usage_perc") for server in (plain, dflash)}
    drafts_before = metric(dflash, "vllm:spec_decode_num_drafts_total")

    rss = {plain: [], dflash: []}
    for round_index in range(ROUNDS):
        # The same load on both servers, one after the other, in a new order each round.
        want = run_round(plain, plain_bodies, order_seed=round_index)
        check_round(plain_bodies, want)
        results = run_round(dflash, bodies, order_seed=round_index)
        check_round(bodies, results)
        assert [results[i] for i in greedy] == [want[i] for i in greedy]
        for server in (plain, dflash):
            wait_idle(server)
            assert metric(server, "vllm:kv_cache_usage_perc") == idle_usage[server]
            rss[server].append(engine_rss_mib(server))

    assert metric(dflash, "vllm:spec_decode_num_drafts_total") > drafts_before
    assert metric(dflash, "vllm:request_success_total") >= ROUNDS * NUM_CLIENTS
    # Both engines' RSS creeps up over the first rounds of a new workload as shape-keyed
    # caches (oneDNN primitives, ...) fill, more with the drafter's extra GEMM shapes; it levels
    # off after ~8 varied rounds. A leak would add to the plugin's growth round after round.
    growth = {server: values[-1] - values[0] for server, values in rss.items()}
    print(f"engine RSS MiB after each round: plain {rss[plain]}, dflash {rss[dflash]}")
    assert growth[dflash] - growth[plain] <= RSS_MARGIN_MIB, rss
