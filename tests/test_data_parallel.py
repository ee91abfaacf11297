"""Data parallelism: `vllm serve --data-parallel-size 2` with the plugin runs two engines, each
with its own proposer and drafter KV cache (an idle engine runs vLLM's dummy batches in lockstep
with the busy one). Greedy text equals a server's without speculation, both engines draft and
accept, and seeded sampling gives the same text whichever engine serves it."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.engines import TRAINED, heldout_texts, two_rank_cores
from tests.test_serve import Server, running, server_model

MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_parallel")
    spec = {"method": "dflash", "model": str(TRAINED.drafter), "num_speculative_tokens": 7}
    servers = [
        Server(str(TRAINED.target), None, str(root / "plain.log")),
        Server(str(TRAINED.target), spec, str(root / "dflash.log"),
               extra_args=("--data-parallel-size", "2"),
               extra_env={"VLLM_CPU_OMP_THREADS_BIND": two_rank_cores()}),
    ]
    with running(servers):
        yield servers


def completion(server: Server, prompt: str, **sampling) -> str:
    body = {"model": server_model(server), "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
            "ignore_eos": True, "temperature": 0.0, **sampling}
    return json.loads(server.post("/v1/completions", body))["choices"][0]["text"]


def concurrent_completions(server: Server, texts: list[str], **sampling) -> list[str]:
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(lambda prompt: completion(server, prompt, **sampling), texts))


def engine_counters(server: Server, name: str) -> dict[str, float]:
    """vllm:spec_decode_<name>_total per engine (label engine="0", "1")."""
    counters = {}
    for line in server.get("/metrics").splitlines():
        if line.startswith(f"vllm:spec_decode_{name}_total{{"):
            engine = line.split('engine="')[1].split('"')[0]
            counters[engine] = float(line.split()[-1])
    return counters


def test_greedy_equals_no_speculation_with_two_engines(servers):
    plain, dflash = servers
    texts = heldout_texts()
    expected = concurrent_completions(plain, texts)
    assert concurrent_completions(dflash, texts) == expected
    assert [completion(dflash, prompt) for prompt in texts[:3]] == expected[:3]


def test_both_engines_draft_and_accept(servers):
    _, dflash = servers
    concurrent_completions(dflash, heldout_texts())
    drafts = engine_counters(dflash, "num_drafts")
    draft_tokens = engine_counters(dflash, "num_draft_tokens")
    accepted = engine_counters(dflash, "num_accepted_tokens")
    assert set(drafts) == {"0", "1"}, drafts
    for engine in drafts:
        assert drafts[engine] > 0 and draft_tokens[engine] == 7 * drafts[engine], draft_tokens
        assert 1 + accepted[engine] / drafts[engine] >= 2.5, (accepted, drafts)
    log = Path(dflash.log.name).read_text()
    assert log.count("vllm-dflash: implementation=vllm-dflash") == 2, log[-3000:]


def test_seeded_sampling_does_not_depend_on_the_engine(servers):
    _, dflash = servers
    texts = heldout_texts(8)
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
    first = concurrent_completions(dflash, texts, **sampling)
    again = concurrent_completions(dflash, texts[::-1], **sampling)[::-1]
    assert first == again
    assert first != concurrent_completions(dflash, texts)
