"""Data parallelism: `vllm serve --data-parallel-size 2` with the plugin runs two engines, each
with its own proposer and drafter KV cache (an idle engine runs vLLM's dummy batches in lockstep
with the busy one). Greedy text equals a server's without speculation; requests routed to each
engine (vLLM's X-data-parallel-rank header) are accepted there as the package's torch loop
accepts them on the same prompts (within 0.05 tokens per block, as tests/test_vllm_e2e.py
argues); seeded sampling gives the same text whichever engine serves it."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.engines import TRAINED, heldout_ids, heldout_texts, own_loop_acceptance, two_rank_cores
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


def completion(server: Server, prompt: str, rank: int | None = None, **sampling) -> str:
    """Greedy text (or sampled, per sampling) of prompt; on DP rank `rank` if given."""
    body = {"model": server_model(server), "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
            "ignore_eos": True, "temperature": 0.0, **sampling}
    headers = None if rank is None else {"X-data-parallel-rank": str(rank)}
    return json.loads(server.post("/v1/completions", body, headers))["choices"][0]["text"]


def concurrent_completions(server: Server, texts: list[str], ranks: list[int] | None = None,
                           **sampling) -> list[str]:
    ranks = ranks or [None] * len(texts)
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(lambda args: completion(server, *args, **sampling),
                             zip(texts, ranks)))


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


def test_each_engine_accepts_its_requests_as_the_reference(servers):
    # The first half of the prompts to engine 0, the rest to engine 1: each engine's counters
    # (their difference over this test) are its own requests' acceptance.
    _, dflash = servers
    texts, ids = heldout_texts(), heldout_ids()
    ranks = [0 if i < len(texts) // 2 else 1 for i in range(len(texts))]
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    before = {name: engine_counters(dflash, name) for name in names}
    concurrent_completions(dflash, texts, ranks)
    drafts, draft_tokens, accepted = (
        {engine: value - before[name].get(engine, 0.0)
         for engine, value in engine_counters(dflash, name).items()} for name in names)
    assert set(drafts) == {"0", "1"}, drafts
    for engine in drafts:
        assert drafts[engine] > 0 and draft_tokens[engine] == 7 * drafts[engine], draft_tokens
        served = [prompt for prompt, rank in zip(ids, ranks) if str(rank) == engine]
        reference = own_loop_acceptance(TRAINED, served, MAX_NEW_TOKENS, 7)
        acceptance = 1 + accepted[engine] / drafts[engine]
        assert abs(acceptance - reference) <= 0.05, (engine, acceptance, reference)
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
