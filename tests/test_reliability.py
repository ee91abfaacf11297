"""Reliability: bad configuration fails start-up clearly, per-request parameters, faults.

Bad drafters fail LLM() with a clear message before any engine process starts; every
per-request parameter vLLM accepts with speculation gives what the engine without speculation
gives (logprobs too); vLLM's own refusals are the same as for its in-tree DFlash; a client that
disconnects frees its KV blocks; a corrupted drafter never changes an output.

Per-request tests use the trained pair in tests/fixtures/pair, whose drafts are really
accepted (several tokens per step), so stops and limits fall inside verified blocks.
"""

import http.client
import json
import math
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.engines import (
    MAX_MODEL_LEN,
    TRAINED_DFLASH2,
    Pair,
    dflash_llm,
    generate_ids,
    heldout_prompts,
    plain_llm,
    run_python,
)

# ---- helpers ----------------------------------------------------------------------------------


def params(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def completions(llm, prompts: list, sampling) -> list[tuple]:
    """(token ids, text, finish reason, stop reason) of each prompt's first completion."""
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outputs]


def step_lengths(llm, prompt: dict, sampling) -> tuple[list[int], list[int]]:
    """Run one request alone, step by step: its output token ids and the number of tokens each
    engine step added (> 1 where the step accepted drafted tokens)."""
    engine = llm.llm_engine
    engine.add_request("steps", prompt, sampling)
    totals, token_ids = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids = list(output.outputs[0].token_ids)
            totals.append(len(token_ids))
    added = [b - a for a, b in zip([0, *totals[:-1]], totals, strict=True)]
    return token_ids, added


def corrupted_copy(drafter: Path, out: Path, edit) -> Path:
    """A copy of a drafter checkpoint whose tensors went through edit(dict)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(drafter, out)
    for file in out.glob("*.safetensors"):
        state = load_file(file)
        edit(state)
        save_file(state, file, metadata={"format": "pt"})
    return out


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(trained_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(trained_pair.target)


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return heldout_prompts(8)


@pytest.fixture(scope="module")
def baseline(trained_pair):
    llm = plain_llm(trained_pair.target)
    yield llm
    del llm


@pytest.fixture(scope="module")
def dflash(trained_pair, baseline):
    llm = dflash_llm(trained_pair, trained_pair.block_size - 1)
    yield llm
    del llm


# ---- bad configuration ------------------------------------------------------------------------

# LLM() with vLLM's default multiprocessing engine, as users run it: one start-up per case,
# then the exception chain and the child processes left behind.
BAD_CONFIG_SCRIPT = """
import json, os, sys
import psutil
from vllm import LLM

target, cases = sys.argv[1], json.loads(sys.argv[2])
for name, engine_args in cases.items():
    error = ""
    saved_env = dict(os.environ)
    os.environ.update(engine_args.pop("env", {}))  # this case's only
    try:
        defaults = {"model": target, "enforce_eager": True, "dtype": "float32",
                    "max_model_len": 512}
        LLM(**(defaults | engine_args))
    except Exception as err:
        texts = []
        while err is not None:
            texts.append(f"{type(err).__name__}: {err}")
            err = err.__cause__ or err.__context__
        error = "\\n".join(texts)
    os.environ.clear()
    os.environ.update(saved_env)
    children = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    children = [c for c in children if "resource_tracker" not in c]
    print("RESULT " + json.dumps({"case": name, "error": error, "children": children}), flush=True)
"""


def bad_configs(pair: Pair, root: Path) -> dict[str, dict]:
    """LLM() arguments of each bad configuration ("env": environment variables it sets), with
    its drafter directory built under root."""
    from vllm_dflash.vllm.config import DRAFT_HEAD_ENV, PROMPT_LOOKUP_ENV

    no_config = root / "no_config"
    shutil.copytree(pair.drafter, no_config)
    (no_config / "config.json").unlink()
    no_weights = root / "no_weights"
    shutil.copytree(pair.drafter, no_weights)
    for file in no_weights.glob("*.safetensors"):
        file.unlink()
    key_removed = corrupted_copy(
        pair.drafter, root / "key_removed", lambda s: s.pop("layers.1.mlp.down_proj.weight")
    )

    def shrink(state):
        state["layers.0.self_attn.q_proj.weight"] = state["layers.0.self_attn.q_proj.weight"][:-8]

    wrong_shape = corrupted_copy(pair.drafter, root / "wrong_shape", shrink)

    def spec(drafter, k=3):
        config = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}
        return {"speculative_config": config}

    return {
        "drafter dir missing": spec(root / "does_not_exist"),
        "no config.json": spec(no_config),
        "no safetensors": spec(no_weights),
        "weight key removed": spec(key_removed),
        "weight wrong shape": spec(wrong_shape),
        "num_speculative_tokens 0": spec(pair.drafter, 0),
        "num_speculative_tokens negative": spec(pair.drafter, -2),
        "dflash without model": {
            "speculative_config": {"method": "dflash", "num_speculative_tokens": 3}},
        "pipeline parallel": {**spec(pair.drafter), "pipeline_parallel_size": 2,
                              "distributed_executor_backend": "mp"},
        "dflash drafter as draft_model": {"speculative_config": {
            "method": "draft_model", "model": str(pair.drafter), "num_speculative_tokens": 3}},
        "draft head unknown": {**spec(pair.drafter), "env": {DRAFT_HEAD_ENV: "fp8"}},
        "prompt lookup unknown": {**spec(pair.drafter), "env": {PROMPT_LOOKUP_ENV: "yes"}},
        "bf16 draft head with tensor parallel": {
            **spec(pair.drafter), "tensor_parallel_size": 2, "distributed_executor_backend": "mp",
            "env": {DRAFT_HEAD_ENV: "bfloat16"}},
        "bf16 draft head of a DFlash2 drafter": {
            **spec(TRAINED_DFLASH2.drafter), "model": str(TRAINED_DFLASH2.target),
            "env": {DRAFT_HEAD_ENV: "bfloat16"}},
        # vLLM's CPU build runs linear attention in bf16 only.
        "hybrid target on CPU": {**spec(pair.drafter), "dtype": "bfloat16",
                                 "model": str(write_hybrid_target(root / "hybrid", pair))},
    }


def write_hybrid_target(out: Path, pair: Pair) -> Path:
    """A random Qwen3-Next (linear-attention and attention layers) of the pair's widths."""
    import transformers

    config = json.loads((pair.target / "config.json").read_text())
    widths = {key: config[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "bos_token_id",
        "eos_token_id")}
    hybrid = transformers.Qwen3NextConfig(
        **widths, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128)
    transformers.AutoModelForCausalLM.from_config(hybrid).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pair.target / name, out / name)
    return out


# Words the user must see, for each case.
BAD_CONFIG_WORDS = {
    # vLLM's own check, in the front-end: names the path and what it needs.
    "drafter dir missing": ["does_not_exist", "local directory", "config.json"],
    "no config.json": ["no_config", "local directory", "config.json"],
    # vllm-dflash's checks, run in the front-end at config time.
    "no safetensors": ["no *.safetensors files", "no_weights", "fix"],
    "weight key removed": ["layers.1.mlp.down_proj.weight", "missing", "fix"],
    "weight wrong shape": ["layers.0.self_attn.q_proj.weight", "[256, 256]", "[248, 256]", "fix"],
    # vLLM's pydantic check of SpeculativeConfig.
    "num_speculative_tokens 0": ["num_speculative_tokens", "greater than 0", "input_value=0"],
    "num_speculative_tokens negative": [
        "num_speculative_tokens", "greater than 0", "input_value=-2",
    ],
    "dflash without model": ['method "dflash"', 'no "model"', "drafter checkpoint"],
    "pipeline parallel": ["pipeline parallelism", "pipeline_parallel_size=2",
                          "--tensor-parallel-size"],
    "dflash drafter as draft_model": ["is a DFlash drafter, but",
                                      'method "draft_model"', 'set "method": "dflash"'],
    "hybrid target on CPU": ["Qwen3NextForCausalLM", "recurrent", "CPU build",
                             "without --speculative-config"],
    "draft head unknown": ["VLLM_DFLASH_DRAFT_HEAD='fp8'", "valid values: target, bfloat16"],
    "prompt lookup unknown": ["VLLM_DFLASH_PROMPT_LOOKUP='yes'", "valid values: off, on"],
    "bf16 draft head with tensor parallel": ["VLLM_DFLASH_DRAFT_HEAD=bfloat16",
                                             "tensor_parallel_size=2", "unset"],
    "bf16 draft head of a DFlash2 drafter": ["VLLM_DFLASH_DRAFT_HEAD=bfloat16", "DFlash2",
                                             "unset"],
}


@pytest.fixture(scope="module")
def bad_config_results(random_pair, tmp_path_factory) -> dict[str, dict]:
    cases = bad_configs(random_pair, tmp_path_factory.mktemp("bad"))
    assert sorted(cases) == sorted(BAD_CONFIG_WORDS)
    results = run_python(BAD_CONFIG_SCRIPT, str(random_pair.target), json.dumps(cases),
                         VLLM_ENABLE_V1_MULTIPROCESSING="1")
    return {result["case"]: result for result in results}


@pytest.mark.parametrize("case", sorted(BAD_CONFIG_WORDS))
def test_bad_config_fails_startup_clearly_with_no_engine_left(bad_config_results, case):
    result = bad_config_results[case]
    error = result["error"]
    assert error, f"{case}: LLM() started"
    for word in BAD_CONFIG_WORDS[case]:
        assert word in error, error
    # Raised in the caller's process at config time: no engine core was started, so none is
    # left running and the message is the exception itself, not "see root cause above".
    assert "Engine core initialization failed" not in error, error
    assert result["children"] == []


def test_a_dflash_drafter_without_method_runs_as_dflash(random_pair):
    # vLLM names the method by the drafter's path ("dflash" in it), else "draft_model".
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dflash import vllm as plugin

    plugin.register()
    spec = {"model": str(random_pair.drafter), "num_speculative_tokens": 3}
    assert "dflash" not in str(random_pair.drafter).lower()
    args = EngineArgs(model=str(random_pair.target), speculative_config=spec, max_model_len=512)
    assert args.create_engine_config().speculative_config.method == "dflash"


def test_selected_implementation(monkeypatch):
    from vllm_dflash.vllm.config import IMPL_ENV, DFlashSetupError, selected_implementation

    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert selected_implementation() == "vllm-dflash"
    for value, want in [("", "vllm-dflash"), (" vllm-dflash ", "vllm-dflash"), ("vllm", "vllm")]:
        monkeypatch.setenv(IMPL_ENV, value)
        assert selected_implementation() == want
    for value in ["bogus", "VLLM", "vllm_dflash"]:
        monkeypatch.setenv(IMPL_ENV, value)
        with pytest.raises(DFlashSetupError) as excinfo:
            selected_implementation()
        message = str(excinfo.value)
        assert f"{IMPL_ENV}={value!r}" in message and "vllm-dflash, vllm" in message


UNKNOWN_IMPL_SCRIPT = """
import json, sys
from vllm import LLM

target, spec = sys.argv[1], json.loads(sys.argv[2])
error = ""
try:
    LLM(model=target, speculative_config=spec, enforce_eager=True, max_model_len=512)
except Exception as err:
    error = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps({"error": error}), flush=True)
"""


def test_unknown_implementation_fails_llm_startup(random_pair):
    spec = {"method": "dflash", "model": str(random_pair.drafter), "num_speculative_tokens": 3}
    (result,) = run_python(UNKNOWN_IMPL_SCRIPT, str(random_pair.target), json.dumps(spec),
                           VLLM_DFLASH_IMPL="bogus")
    assert result["error"].startswith("DFlashSetupError: VLLM_DFLASH_IMPL='bogus'"), result
    assert "valid values: vllm-dflash, vllm" in result["error"]


# ---- per-request parameters -------------------------------------------------------------------

REFUSED_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

target, spec = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=target, speculative_config=spec, enforce_eager=True, dtype="float32",
          max_model_len=512)
for name, kwargs in [("min_p", {"min_p": 0.1}), ("logit_bias", {"logit_bias": {5: 2.0}})]:
    error = ""
    try:
        llm.generate(["def f(x):"], SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    print("RESULT " + json.dumps({"param": name, "error": error}), flush=True)
"""


def test_min_p_and_logit_bias_run_where_vllm_in_tree_dflash_refuses_them(trained_pair, dflash):
    spec = {"method": "dflash", "model": str(trained_pair.drafter), "num_speculative_tokens": 7}
    in_tree = run_python(REFUSED_SCRIPT, str(trained_pair.target), json.dumps(spec),
                         VLLM_DFLASH_IMPL="vllm", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    for result in in_tree:
        assert "not yet supported with speculative decoding" in result["error"], result
    for kwargs in ({"min_p": 0.1}, {"logit_bias": {5: 2.0}}):
        assert dflash.generate(["def f(x):"], params(max_tokens=4, **kwargs), use_tqdm=False)


def test_logit_bias_greedy_equals_no_speculation(baseline, dflash, prompts):
    # Biases that change the greedy output: a ban on a frequent token, boosts of others.
    biased = [params(temperature=0.0, max_tokens=48, ignore_eos=True,
                     logit_bias={200: -100.0, 13: 3.0, (37 * i) % 4000 + 2: 4.0})
              for i in range(len(prompts))]
    unbiased = params(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [c[0] for c in completions(baseline, prompts, biased)]
    assert want != [c[0] for c in completions(baseline, prompts, unbiased)]
    assert [c[0] for c in completions(dflash, prompts, biased)] == want


def min_p_violations(llm, prompts, min_p: float, threshold: float) -> tuple[int, int]:
    """Sampled tokens (T = 1) whose probability is below threshold x the most likely token's,
    from the raw logprobs; and all sampled tokens."""
    sampling = params(temperature=1.0, min_p=min_p, max_tokens=64, ignore_eos=True,
                      logprobs=1, seed=3)
    violations = total = 0
    for output in llm.generate(prompts, sampling, use_tqdm=False):
        for token, logprobs in zip(output.outputs[0].token_ids, output.outputs[0].logprobs,
                                   strict=True):
            top = max(entry.logprob for entry in logprobs.values())
            violations += logprobs[token].logprob < top + math.log(threshold) - 1e-4
            total += 1
    return violations, total


def test_min_p_keeps_only_tokens_above_its_threshold(dflash, prompts):
    # Verified draft tokens and bonus tokens alike (drafts are accepted at T = 1 here).
    assert min_p_violations(dflash, prompts, min_p=0.3, threshold=0.3)[0] == 0
    violations, total = min_p_violations(dflash, prompts, min_p=0.0, threshold=0.3)
    assert violations > total // 10, (violations, total)  # the premise: without min_p


def test_drafts_are_accepted_on_the_trained_pair(dflash, prompts):
    # The premise of the tests below: steps verify several tokens at once.
    _, added = step_lengths(dflash, prompts[0], params(temperature=0.0, max_tokens=40))
    assert max(added) == 8, added


def test_logprobs_equal_no_speculation(baseline, dflash, prompts):
    sampling = params(temperature=0.0, max_tokens=24, logprobs=5, prompt_logprobs=3,
                      ignore_eos=True)
    want = baseline.generate(prompts, sampling, use_tqdm=False)
    got = dflash.generate(prompts, sampling, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        pairs = list(zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True))
        pairs += list(zip(w.prompt_logprobs, g.prompt_logprobs, strict=True))
        for w_pos, g_pos in pairs:
            if w_pos is None:  # the first prompt token has no logprob
                assert g_pos is None
                continue
            assert g_pos.keys() == w_pos.keys()
            for token, w_lp in w_pos.items():
                assert abs(g_pos[token].logprob - w_lp.logprob) <= 1e-4
                assert g_pos[token].rank == w_lp.rank


def test_n_with_seed(baseline, dflash, prompts):
    # vLLM refuses n > 1 with greedy sampling, with or without speculation.
    with pytest.raises(Exception, match="n must be 1 when using greedy sampling"):
        params(n=3, temperature=0.0)
    # Top-k 1: n identical completions, each the greedy output without speculation.
    greedy = generate_ids(baseline, prompts[:3], max_tokens=20)
    top1 = params(n=3, temperature=1.0, top_k=1, seed=5, max_tokens=20)
    for output, want in zip(dflash.generate(prompts[:3], top1, use_tqdm=False), greedy,
                            strict=True):
        assert [list(c.token_ids) for c in output.outputs] == [want] * 3
    # Sampling: completion i of n with seed s is the request with seed s + i, reproducibly,
    # whatever else is in the batch (vLLM's contract, kept with speculation).
    group = params(n=3, temperature=0.8, seed=11, max_tokens=20)
    first = [[list(c.token_ids) for c in o.outputs]
             for o in dflash.generate(prompts[:3], group, use_tqdm=False)]
    assert first == [[list(c.token_ids) for c in o.outputs]
                     for o in dflash.generate(prompts[:3], group, use_tqdm=False)]
    for i in range(3):
        alone = [params(temperature=0.8, seed=11 + i, max_tokens=20)] * 3
        alone += [params(temperature=0.0, max_tokens=20)] * 5
        outputs = dflash.generate(prompts[:3] + prompts[3:], alone, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs[:3]] == [f[i] for f in first]
    assert all(len({tuple(c) for c in f}) > 1 for f in first), first


def test_penalties_bad_words_allowed_tokens_min_tokens_equal_no_speculation(
    baseline, dflash, prompts
):
    for extra in [{"repetition_penalty": 1.3}, {"presence_penalty": 1.0},
                  {"frequency_penalty": 0.8}, {"bad_words": ["self", " return"]},
                  {"allowed_token_ids": list(range(2, 300))},
                  {"min_tokens": 10, "stop_token_ids": [0]}]:
        sampling = params(temperature=0.0, max_tokens=24, **extra)
        assert completions(dflash, prompts, sampling) == completions(baseline, prompts, sampling)


def test_structured_outputs_equal_no_speculation(baseline, dflash, prompts):
    # vLLM checks each draft against the request's grammar; constrained requests share the
    # batch with unconstrained ones.
    from vllm.sampling_params import StructuredOutputsParams

    choices = ["alpha", "beta", "gamma delta"]
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"]}
    cases = [StructuredOutputsParams(choice=choices),
             StructuredOutputsParams(regex=r"(def|class) [a-z_]+\([a-z_, ]*\):\n    [^\n]+"),
             StructuredOutputsParams(json=schema)]
    free = params(temperature=0.0, max_tokens=32)
    for constraint in cases:
        constrained = params(temperature=0.0, max_tokens=32, structured_outputs=constraint)
        sampling = [constrained if i % 2 == 0 else free for i in range(len(prompts))]
        got = completions(dflash, prompts, sampling)
        assert got == completions(baseline, prompts, sampling), constraint
        if constraint.choice:
            assert all(text in choices for _, text, *_ in got[::2]), got


def test_a_grammar_the_output_meets_keeps_every_accepted_draft(dflash, prompts):
    # A grammar that admits all the target says here (printable ASCII) can only cut drafts the
    # target rejects anyway: exactly the same tokens are accepted as without it.
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_dflash.bench.counters import from_llm_metrics

    printable = StructuredOutputsParams(regex=r"[ -~\n]*")
    runs = {}
    for name, constraint in (("free", None), ("printable", printable)):
        before = from_llm_metrics(dflash.get_metrics())
        got = completions(dflash, prompts, params(temperature=0.0, max_tokens=32,
                                                  structured_outputs=constraint))
        runs[name] = got, from_llm_metrics(dflash.get_metrics()).minus(before)
    assert runs["printable"][0] == runs["free"][0]  # the premise: the grammar cut nothing
    assert runs["printable"][1].accepted == runs["free"][1].accepted
    assert runs["free"][1].accepted > 2 * runs["free"][1].drafts  # drafts really accepted


def block_stop_strings(dflash, prompt: dict, tokenizer) -> dict[str, str]:
    """Two-token pieces of a request's speculative output, each first seen where it straddles
    the boundary between two verified blocks ("across") or lies inside one ("inside")."""
    out, added = step_lengths(dflash, prompt, params(temperature=0.0, max_tokens=40,
                                                     ignore_eos=True))
    text = tokenizer.decode(out)
    starts = [sum(added[:i]) for i in range(1, len(added))]  # first token of each later step
    inside = [p for s, n in zip(starts, added[1:], strict=True) for p in range(s + 1, s + n)]
    stops: dict[str, str] = {}
    for where, positions in [("across", starts), ("inside", inside)]:
        for start in positions:
            piece = tokenizer.decode(out[start - 1:start + 1])
            if piece.strip() and text.find(piece) == len(tokenizer.decode(out[:start - 1])):
                stops.setdefault(where, piece)
    return stops


def test_stop_strings_across_and_inside_a_block(baseline, dflash, prompts, tokenizer):
    found = []
    for prompt in prompts:
        stops = block_stop_strings(dflash, prompt, tokenizer)
        found += list(stops)
        for piece in stops.values():
            for include in (False, True):
                stop = params(temperature=0.0, max_tokens=40, stop=[piece],
                              include_stop_str_in_output=include)
                got = completions(dflash, [prompt], stop)
                assert got == completions(baseline, [prompt], stop)
                assert got[0][2] == "stop" and got[0][3] == piece
    assert found.count("across") >= 2 and found.count("inside") >= 2, found


def test_max_tokens_1(baseline, dflash, prompts):
    sampling = params(temperature=0.0, max_tokens=1)
    got = completions(dflash, prompts, sampling)
    assert got == completions(baseline, prompts, sampling)
    assert all(len(ids) == 1 for ids, *_ in got)


def test_empty_output(baseline, dflash, prompts, tokenizer):
    first = [ids[0] for ids in generate_ids(baseline, prompts, max_tokens=1)]
    one = prompts[:1]
    cases = [
        # Stop string = the first generated token's text: an empty text.
        params(temperature=0.0, max_tokens=20, stop=[tokenizer.decode(first[:1])]),
        # Stop token = the first generated token: only that token, no text.
        params(temperature=0.0, max_tokens=20, stop_token_ids=[first[0]]),
        # min_tokens holds the stop token back.
        params(temperature=0.0, max_tokens=20, stop_token_ids=[first[0]], min_tokens=3),
    ]
    for sampling in cases:
        assert completions(dflash, one, sampling) == completions(baseline, one, sampling)
    assert completions(dflash, one, cases[0])[0][1] == ""
    assert completions(dflash, one, cases[1])[0][:2] == ([first[0]], "")


def long_prompts(prompts: list[dict], lengths: list[int]) -> list[dict]:
    ids = [t for p in prompts for t in p["prompt_token_ids"]] * 4
    assert len(ids) >= max(lengths)
    return [{"prompt_token_ids": ids[:n]} for n in lengths]


def test_prompt_filling_max_model_len_minus_1(baseline, dflash, prompts):
    batch = long_prompts(prompts, [MAX_MODEL_LEN - 1]) + prompts[:3]
    short = [params(temperature=0.0, max_tokens=16)] * 3
    for max_tokens in (None, 16):
        sampling = [params(temperature=0.0, max_tokens=max_tokens), *short]
        got = completions(dflash, batch, sampling)
        assert got == completions(baseline, batch, sampling)
        assert len(got[0][0]) == 1 and got[0][2] == "length"


def test_request_reaching_max_model_len_stops_where_no_speculation_stops(
    baseline, dflash, prompts
):
    # No max_tokens: each long request runs into max_model_len a few tokens after its prompt,
    # alone and batched with short requests that run on. (vLLM stops drafting once
    # seq_len + K + 1 would pass max_model_len, so the last tokens come one per step.)
    lengths = [MAX_MODEL_LEN - 9, MAX_MODEL_LEN - 5, MAX_MODEL_LEN - 2]
    batch = long_prompts(prompts, lengths)
    unbounded = [params(temperature=0.0, max_tokens=None)] * len(lengths)
    short = [params(temperature=0.0, max_tokens=30)] * 3
    for requests, sampling in [(batch, unbounded), (batch + prompts[:3], unbounded + short)]:
        got = completions(dflash, requests, sampling)
        assert got == completions(baseline, requests, sampling)
        for n, (ids, _, reason, _) in zip(lengths, got, strict=False):
            assert n + len(ids) == MAX_MODEL_LEN and reason == "length"


# ---- faults -----------------------------------------------------------------------------------


def randomize(state: dict) -> None:
    generator = torch.Generator().manual_seed(0)
    for key, value in state.items():
        state[key] = torch.randn(value.shape, generator=generator, dtype=value.dtype) * 3.0


def nan_layer_0(state: dict) -> None:
    for key, value in state.items():
        if key.startswith("layers.0."):
            state[key] = torch.full_like(value, float("nan"))


@pytest.mark.parametrize("corrupt", [randomize, nan_layer_0], ids=["random", "nan-layer-0"])
def test_corrupted_drafter_weights_keep_output(trained_pair, baseline, prompts, tmp_path,
                                               corrupt):
    drafter = corrupted_copy(trained_pair.drafter, tmp_path / "drafter", corrupt)
    k = trained_pair.block_size - 1
    llm = dflash_llm(Pair(trained_pair.target, drafter, trained_pair.block_size), k)
    try:
        want = generate_ids(baseline, prompts, max_tokens=32)
        assert generate_ids(llm, prompts, max_tokens=32) == want
        for seed in (1, 2):  # seeded sampling is still reproducible
            sampling = params(temperature=1.0, top_p=0.9, seed=seed, max_tokens=16)
            assert completions(llm, prompts, sampling) == completions(llm, prompts, sampling)
    finally:
        del llm


@pytest.fixture(scope="module")
def server(random_pair, tmp_path_factory):
    from tests.test_serve import START_TIMEOUT_S, Server

    spec = {"method": "dflash", "model": str(random_pair.drafter), "num_speculative_tokens": 7}
    log = tmp_path_factory.mktemp("serve") / "dflash.log"
    started = Server(str(random_pair.target), spec, str(log))
    try:
        started.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield started
    finally:
        started.stop()


def test_disconnected_streaming_clients_free_their_requests(server, random_pair):
    from tests.engines import prompts_of_lengths
    from tests.test_serve import metric, server_model, wait_idle

    model = server_model(server)
    check = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0.0}
    before = json.loads(server.post("/v1/completions", check))["choices"][0]["text"]
    wait_idle(server)
    idle_usage = metric(server, "vllm:kv_cache_usage_perc")
    generated = metric(server, "vllm:generation_tokens_total")
    prompts = prompts_of_lengths(random_pair.target, (30, 100, 200, 300), seed=3)
    max_tokens = 200
    clients = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt["prompt_token_ids"], "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        clients.append((conn, response))
    for _, response in clients:  # every request is generating
        for _ in range(3):
            assert response.readline().startswith(b"data: ")
            response.readline()
    assert metric(server, "vllm:kv_cache_usage_perc") > idle_usage
    for conn, _ in clients:  # the clients go away mid-generation
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    wait_idle(server)
    # The requests were stopped, not run to the end, and their KV blocks are free again.
    assert metric(server, "vllm:generation_tokens_total") - generated < len(clients) * max_tokens
    assert metric(server, "vllm:kv_cache_usage_perc") == idle_usage
    after = json.loads(server.post("/v1/completions", check))["choices"][0]["text"]
    assert after == before
