"""`vllm serve` with the plugin on 127.0.0.1, on the trained pair: the OpenAI endpoints give the
same greedy text as a server without speculation, streaming or not, and /metrics shows vLLM's
spec-decode counters, whose acceptance for held-out prompts is this package's torch loop's."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from tests.engines import MAX_MODEL_LEN, TRAINED, Pair, heldout_ids, own_loop_acceptance

START_TIMEOUT_S = 600  # two servers start side by side on a 2-core machine


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
