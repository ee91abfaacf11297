"""`vllm-dflash bench` on the tiny trained pair: it writes bench.json, bench.png and table.md
with sane numbers (not timings). Each run starts its own engine process, so runs are few."""

import itertools
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from tests.engines import MAX_MODEL_LEN
from vllm_dflash.bench.counters import SpecCounters, acceptance, from_prometheus
from vllm_dflash.bench.prompts import load_prompts, requests_for
from vllm_dflash.bench.report import compare_to_baseline, median_of_repeats, paired_ratios
from vllm_dflash.cli import main

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every engine process
PROMPTS = ["def fibonacci(n):", "import os\n"]
K = 7  # the drafter's block_size - 1: the bench's default


# Every run benches the trained pair, whose drafts are accepted: the adaptive length keeps
# drafting (a random drafter may be switched off within the few steps of a run, leaving no
# acceptance to report).
def bench(pair, out: Path, *args: str) -> dict:
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    main(["bench", "--target", str(pair.target), "--draft", str(pair.drafter),
          "--prompts", str(prompts), "--max-tokens", "8", "--max-model-len", str(MAX_MODEL_LEN),
          "--out", str(out), *args])
    return json.loads((out / "bench.json").read_text())


@pytest.fixture(scope="module")
def offline(trained_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_offline") / "out"
    return bench(trained_pair, out, "--concurrency", "1,2",
                 "--methods", "none,vllm-dflash,vllm-dflash-k7"), out


def test_offline_writes_json_png_and_table(offline):
    report, out = offline
    assert report["meta"]["mode"] == "offline"
    assert report["meta"]["num_speculative_tokens"] == K
    methods = ("none", "vllm-dflash", "vllm-dflash-k7")
    assert [(r["method"], r["concurrency"]) for r in report["runs"]] == [
        (method, c) for c in (1, 2) for method in methods]
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert "| vllm-dflash | 2 |" in (out / "table.md").read_text()
    assert "| vllm-dflash / none |" in (out / "table.md").read_text()
    pairs = [("vllm-dflash", "none"), ("vllm-dflash-k7", "none"),
             ("vllm-dflash", "vllm-dflash-k7")]
    assert [(r["numerator"], r["denominator"], r["concurrency"])
            for r in report["paired_ratios"]] == [(a, b, c) for c in (1, 2) for a, b in pairs]
    # Each run set its method's environment before building its engine: this is our proposer.
    log = (out / "logs" / "offline-vllm-dflash-c1.log").read_text()
    assert "implementation=vllm-dflash (vllm_dflash.vllm.spec_decode.DFlashProposer)" in log
    assert "vllm-dflash: adaptive draft length" in log


def test_offline_numbers_are_sane(offline):
    report, _ = offline
    for run in report["runs"]:
        assert "error" not in run, run
        assert "token_ids" not in run
        assert run["requests"] == len(PROMPTS) and run["output_tokens"] > 0
        assert run["output_tokens_per_s"] > 0 and run["speedup_vs_none"] > 0
        assert run["peak_rss_mib"] > 0
        assert run["greedy_equals_none"] is True
        assert run["ttft_ms"] is None  # offline mode measures no latencies
    for run in report["runs"]:
        if run["method"] == "none":
            assert run["speedup_vs_none"] == 1.0 and run["mean_acceptance_length"] is None
        elif run["method"] == "vllm-dflash" and run["mean_acceptance_length"] is None:
            # The adaptive length may keep drafting off for a run this short: its start-up
            # profile times the live engine, and a loaded machine makes drafting look dear.
            assert run["acceptance_per_position"] == []
        else:
            assert 1.0 <= run["mean_acceptance_length"] <= 1 + K
            assert len(run["acceptance_per_position"]) == K
            assert all(0.0 <= a <= 1.0 for a in run["acceptance_per_position"])


def test_sampling_and_extra_speculative_config_reach_the_dflash_methods(trained_pair, tmp_path):
    # Synthetic acceptance (vLLM's benchmark mode): length 4.0 at K = 7 accepts exactly 3
    # drafts per step. (vLLM's CPU build refuses it for its own drafters, the in-tree DFlash
    # included: "Synthetic acceptance not supported with CPU sampling".)
    extra = {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.0}
    report = bench(trained_pair, tmp_path / "out", "--concurrency", "1", "--temperature", "1.0",
                   "--methods", "none,vllm-dflash-k7", "--speculative-config", json.dumps(extra))
    assert report["meta"]["temperature"] == 1.0
    assert report["meta"]["speculative_extra"] == extra
    for run in report["runs"]:
        assert "error" not in run, run
        assert run["greedy_equals_none"] is None  # sampled outputs are not compared
        if run["method"] != "none":
            assert run["mean_acceptance_length"] == 4.0, run
            assert run["acceptance_per_position"] == [1.0] * 3 + [0.0] * (K - 3), run


def test_server_mode_reports_latencies(trained_pair, tmp_path):
    report = bench(trained_pair, tmp_path / "out", "--server", "--concurrency", "2",
                   "--methods", f"vllm-dflash,vllm-dflash-k{K}")
    # The server's engine-core process loads the plugin itself: the policy is on there too.
    log = (tmp_path / "out" / "logs" / "server-vllm-dflash-c2.log").read_text()
    assert "vllm-dflash: adaptive draft length" in log
    adaptive, fixed = report["runs"]
    for run in (adaptive, fixed):
        assert "error" not in run, run
        assert run["requests"] == len(PROMPTS) and run["output_tokens_per_s"] > 0
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
        assert 0 < run["itl_ms"]["p50"] <= run["itl_ms"]["p99"]
        assert run["speedup_vs_none"] is None and run["greedy_equals_none"] is None  # no baseline
    # Over 2 x 8 tokens the adaptive length may rightly draft nothing (its cost fit of a few
    # noisy steps decides): acceptance from the server's counters is checked at a fixed K.
    assert fixed["mean_acceptance_length"] >= 1.0


def test_prometheus_counters_and_acceptance():
    text = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 0.0
"""
    counters = from_prometheus(text)
    assert counters == SpecCounters(4.0, 12.0, 6.0, [4.0, 2.0, 0.0])
    assert acceptance(counters.minus(SpecCounters(2.0, 6.0, 4.0, [2.0, 2.0]))) == {
        "mean_acceptance_length": 2.0, "acceptance_per_position": [1.0, 0.0, 0.0]}
    assert acceptance(SpecCounters())["mean_acceptance_length"] is None


def test_chat_prompts_are_rendered_with_the_target_template(trained_pair, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "def add("}]}) + "\n"
                    + json.dumps({"prompt": "import os"}) + "\n")
    assert load_prompts(path, chat_target=str(trained_pair.target)) == [
        "system: Be brief.\nuser: def add(\nassistant: ", "user: import os\nassistant: "]
    assert load_prompts(path, limit=1, chat_target=str(trained_pair.target))[0].startswith(
        "system: ")


def test_requests_fill_the_concurrency():
    assert requests_for(["a", "b", "c"], 2) == ["a", "b", "c"]
    assert requests_for(["a", "b"], 5) == ["a", "b", "a", "b", "a"]


def test_failed_runs_and_missing_baseline_are_reported():
    ok = {"method": "none", "concurrency": 1, "output_tokens_per_s": 10.0, "token_ids": [[1]]}
    rows = compare_to_baseline([
        ok, {"method": "vllm-dflash", "concurrency": 1, "error": "exit code 1"},
        {**ok, "method": "vllm-dflash", "concurrency": 2},
    ])
    assert rows[0]["speedup_vs_none"] == 1.0 and rows[0]["greedy_equals_none"] is True
    assert rows[1]["speedup_vs_none"] is None and rows[1]["error"] == "exit code 1"
    assert rows[2]["greedy_equals_none"] is None
    assert all("token_ids" not in row for row in rows)


def test_repeats_keep_the_median_run():
    def run(method, tokens_per_s, repeat, **extra):
        return {"method": method, "concurrency": 4, "repeat": repeat,
                "output_tokens_per_s": tokens_per_s, "token_ids": [[repeat]], **extra}

    rows = median_of_repeats([
        run("none", 30.0, 0), run("vllm-dflash", 90.0, 0),
        run("none", 10.0, 1), run("vllm-dflash", 70.0, 1),
        run("none", 20.0, 2), run("vllm-dflash", 50.0, 2, error="exit code 1"),
    ])
    assert [(r["method"], r.get("repeat")) for r in rows] == [("none", 2), ("vllm-dflash", 2)]
    assert rows[0]["output_tokens_per_s"] == 20.0
    assert rows[0]["tokens_per_s_repeats"] == [10.0, 20.0, 30.0]
    assert rows[1]["error"] == "exit code 1"  # a failed repeat is not hidden by the others


def test_paired_ratios_pair_runs_of_the_same_repeat():
    def run(method, tokens_per_s, repeat):
        return {"method": method, "concurrency": 1, "repeat": repeat,
                "output_tokens_per_s": tokens_per_s}

    # The machine slows down between repeats; within a repeat a is 2x none and 1.25x b.
    results = [run("none", 10.0, 0), run("a", 20.0, 0), run("b", 16.0, 0),
               run("none", 5.0, 1), run("a", 10.0, 1), run("b", 8.0, 1),
               run("none", 20.0, 2), run("a", 40.0, 2),
               {"method": "b", "concurrency": 1, "repeat": 2, "error": "exit code 1"}]
    ratios = {(r["numerator"], r["denominator"]): r
              for r in paired_ratios(results, ["none", "a", "b"])}
    assert set(ratios) == {("a", "none"), ("b", "none"), ("a", "b")}
    assert ratios["a", "none"] == {"concurrency": 1, "numerator": "a", "denominator": "none",
                                   "median": 2.0, "min": 2.0, "max": 2.0, "repeats": 3}
    assert ratios["a", "b"]["median"] == 1.25 and ratios["a", "b"]["repeats"] == 2  # failed: out


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_method_order_balances_who_runs_after_whom(n):
    from vllm_dflash.bench.command import method_order

    methods = [f"m{i}" for i in range(n)]
    rows = [method_order(methods, r) for r in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(row) == methods for row in rows)
    firsts = Counter(row[0] for row in rows)
    follows = Counter(pair for row in rows for pair in itertools.pairwise(row))
    assert len(set(firsts.values())) == 1 and len(firsts) == n
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_lookup_methods_turn_prompt_lookup_on():
    from vllm_dflash.bench.methods import check_methods, fixed_draft_length, method_env
    from vllm_dflash.vllm.config import PROMPT_LOOKUP_ENV

    check_methods(["vllm-dflash+lookup", "vllm-dflash-k7+lookup"])
    assert method_env("vllm-dflash+lookup")[PROMPT_LOOKUP_ENV] == "on"
    assert method_env("vllm-dflash")[PROMPT_LOOKUP_ENV] == "off"
    assert fixed_draft_length("vllm-dflash-k7+lookup") == 7
    for bad in ("ngram+lookup", "none+lookup", "vllm-inproc-dflash+lookup"):
        with pytest.raises(ValueError, match="with prompt lookup"):
            check_methods([bad])
