"""Installed but not asked: an engine that does not ask for vllm-dflash runs exactly as vLLM
alone runs it, on vLLM's own version and on a release vllm-dflash was never checked on; a
vllm-dflash engine checks the vLLM hooks it relies on at start-up.

Each case runs in a fresh interpreter, since vLLM loads plugins once per process. The
"without" case excludes the plugin through VLLM_PLUGINS, vLLM's allowlist. The runner cases
make Model Runner V2 available on this CPU (Triton interpreted, a stand-in "cpu" backend), as
on a GPU where it is vLLM's default.
"""

import json
from importlib.metadata import entry_points

import pytest

from tests.engines import TRAINED, TRAINED_DFLASH2, run_python

UNKNOWN_VERSION = "0.99.0"
# Called by vLLM only with speculation: a plain engine in the same process does not need it.
MISSING_HOOK = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_input_fits_in_drafter")

CASE = """
import json, os, sys
case = json.loads(sys.argv[1])
if case.get("mrv2"):  # Model Runner V2 on this CPU: every Triton kernel interpreted
    from tests.mrv2_cpu import enable

    enable()
env_before = dict(os.environ)
import importlib
import logging
import vllm
import vllm.logger
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs

lines = []
make_record = logging.getLogRecordFactory()


def recording_factory(*args, **kwargs):  # vLLM's logging set-up resets handlers, not this
    record = make_record(*args, **kwargs)
    lines.append(record.getMessage())
    return record


logging.setLogRecordFactory(recording_factory)
if case.get("version"):
    vllm.__version__ = case["version"]
if case.get("drop_hook"):
    module, cls, name = case["drop_hook"]
    delattr(getattr(importlib.import_module(module), cls), name)
target, drafter = case["target"], case["drafter"]
dflash = {"method": "dflash", "model": drafter, "num_speculative_tokens": 3}


def runner(worker):
    cls = type(worker.model_runner)
    return f"{cls.__module__}.{cls.__name__}"


def error_of(make):
    try:
        make()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


sampled_dflash2 = dflash | {"model": case["dflash2"], "draft_sample_method": "probabilistic"}
configs = {"plain": {}, "dflash": {"speculative_config": dflash},
           "sampled_dflash2": {"speculative_config": sampled_dflash2},
           "lora_dflash": {"speculative_config": dflash, "enable_lora": True},
           "block_dflash": {"speculative_config": dflash | {
               "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}}}
result = {}
for name in case.get("configs", []):  # which runner each engine would get
    try:
        config = EngineArgs(model=target, max_model_len=256, enforce_eager=True,
                            **configs[name]).create_engine_config()
        result["v2_" + name] = config.use_v2_model_runner
    except Exception as err:
        result["v2_" + name] = f"{type(err).__name__}: {err}"
result["config_lines"] = [line for line in lines if "vllm-dflash" in line]
lines.clear()
prompts = [{"prompt_token_ids": [5, 17, 99, 3, 42, 8]}, {"prompt_token_ids": [7] * 12}]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
for name in case.get("engines", []):
    spec = None if name == "plain" else dflash
    make = lambda: LLM(model=target, speculative_config=spec, max_model_len=256,
                       enforce_eager=True, dtype="float32", seed=0)
    if name == "dflash_fails":
        result["error"] = error_of(make)
        continue
    llm = make()
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    result[name] = {"ids": [o.outputs[0].token_ids for o in outputs],
                    "runner": llm.collective_rpc(runner)[0]}
    del llm
result["env_added"] = sorted(set(os.environ) - set(env_before))
result["env_changed"] = sorted(k for k in env_before if os.environ.get(k) != env_before[k])
result["engine_lines"] = [line for line in lines if "vllm-dflash" in line]
print("RESULT " + json.dumps(result), flush=True)
"""


def without_plugin() -> str:
    """VLLM_PLUGINS allowing every installed general plugin but vllm-dflash's."""
    names = [e.name for e in entry_points(group="vllm.general_plugins") if e.name != "dflash"]
    assert len(names) < len(entry_points(group="vllm.general_plugins"))
    return ",".join(names) or "none"


def run_case(env: dict | None = None, **case) -> dict:
    case |= {"target": str(TRAINED.target), "drafter": str(TRAINED.drafter),
             "dflash2": str(TRAINED_DFLASH2.drafter)}
    return run_python(CASE, json.dumps(case), VLLM_DFLASH_DRAFT_LENGTH="fixed",
                      **(env or {}))[0]


@pytest.fixture(scope="module")
def on_mrv2_cpu():
    """Plain engines and runner choices with and without the plugin, Model Runner V2 usable."""
    case = {"mrv2": True, "engines": ["plain"],
            "configs": ["plain", "dflash", "sampled_dflash2", "lora_dflash", "block_dflash"]}
    return {
        "with": run_case(**case),
        "without": run_case(env={"VLLM_PLUGINS": without_plugin()}, **case),
        "v2_forced": run_case(env={"VLLM_USE_V2_MODEL_RUNNER": "1"}, mrv2=True,
                              configs=["plain", "dflash"]),
    }


def test_plain_engine_is_untouched_by_the_plugin(on_mrv2_cpu):
    with_plugin, alone = on_mrv2_cpu["with"], on_mrv2_cpu["without"]
    # Same runner (Model Runner V2, vLLM's default where Triton runs), same tokens, and no
    # environment variable written.
    assert with_plugin["plain"]["runner"] == alone["plain"]["runner"]
    assert with_plugin["plain"]["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    assert with_plugin["plain"]["ids"] == alone["plain"]["ids"]
    assert with_plugin["v2_plain"] is True and alone["v2_plain"] is True
    assert with_plugin["env_added"] == alone["env_added"]
    assert with_plugin["env_changed"] == alone["env_changed"]
    assert not any("VLLM_USE_V2_MODEL_RUNNER" in k for k in with_plugin["env_added"])
    assert with_plugin["engine_lines"] == []


def test_dflash_engine_takes_the_runner_vllm_would(on_mrv2_cpu):
    # Where vLLM alone runs its in-tree DFlash on Model Runner V2 (its default where Triton
    # runs), vllm-dflash's engine runs there too.
    assert on_mrv2_cpu["without"]["v2_dflash"] is True
    assert on_mrv2_cpu["with"]["v2_dflash"] is True


def test_what_mrv2_lacks_takes_the_v1_runner_saying_why(on_mrv2_cpu):
    # Sampled drafts of a DFlash2 drafter, LoRA with speculation and vllm-dflash's block
    # verification run on V1 only: vLLM's own runner choice says so.
    result = on_mrv2_cpu["with"]
    assert result["v2_sampled_dflash2"] is False and result["v2_lora_dflash"] is False
    assert result["v2_block_dflash"] is False
    lines = result["config_lines"]
    assert any("Model Runner V2 does not yet support vllm-dflash's sampled drafts" in line
               for line in lines), lines
    assert any("Model Runner V2 does not yet support LoRA with vllm-dflash" in line
               for line in lines), lines
    assert any("Model Runner V2 does not yet support vllm-dflash's block verification" in line
               for line in lines), lines


def test_vllm_use_v2_model_runner_is_respected(on_mrv2_cpu):
    # Asked for, Model Runner V2 runs vllm-dflash's speculator (test_model_runner_v2).
    forced = on_mrv2_cpu["v2_forced"]
    assert forced["v2_plain"] is True and forced["v2_dflash"] is True, forced


@pytest.fixture(scope="module")
def unknown_release():
    """vLLM reporting a release vllm-dflash was never checked on, its hooks all there."""
    return run_case(version=UNKNOWN_VERSION, engines=["plain", "dflash"])


def test_unknown_release_runs_plain_and_dflash_engines(unknown_release, on_mrv2_cpu):
    assert unknown_release["plain"]["runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    # The V1 runner's tokens are vLLM alone's (on Model Runner V2, fp32).
    assert unknown_release["plain"]["ids"] == on_mrv2_cpu["without"]["plain"]["ids"]
    # Lossless on the trained pair: the DFlash engine's greedy tokens are the plain engine's.
    assert unknown_release["dflash"]["ids"] == unknown_release["plain"]["ids"]
    lines = unknown_release["engine_lines"]
    warnings = [line for line in lines if "was not checked" in line]
    assert len(warnings) == 1 and UNKNOWN_VERSION in warnings[0], lines
    assert any("runner=CPUModelRunner" in line for line in lines), lines
    assert "VLLM_USE_V2_MODEL_RUNNER" not in unknown_release["env_added"]


def test_missing_hook_fails_a_dflash_engine_naming_it():
    result = run_case(version=UNKNOWN_VERSION, drop_hook=MISSING_HOOK,
                      engines=["plain", "dflash_fails"])
    error = result["error"]
    hook = f"{MISSING_HOOK[0]}.{MISSING_HOOK[1]}.{MISSING_HOOK[2]}"
    assert f"cannot run on vLLM {UNKNOWN_VERSION}" in error and hook in error, error
    assert "0.32.0, 0.33.0" in error and "VLLM_DFLASH_IMPL=vllm" in error, error
    # A plain engine in the same process runs as usual.
    assert [len(ids) for ids in result["plain"]["ids"]] == [12, 12]
