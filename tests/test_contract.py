"""The vLLM hook contract (vllm_dflash/vllm/contract.py): the running vLLM has every hook, the
source check agrees with the runtime one, and each kind of change is named."""

import importlib.util
import shutil
from pathlib import Path

import pytest

from scripts.check_vllm_hooks import main as check_main
from vllm_dflash.vllm.contract import (
    HOOKS,
    MRV2_HOOKS,
    Hook,
    broken_hooks,
    broken_hooks_in_sources,
)


def vllm_root() -> Path:
    """The directory holding the installed vllm/ package."""
    return Path(importlib.util.find_spec("vllm").origin).parent.parent


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A copy of the installed vLLM's files that the hooks live in."""
    root = tmp_path_factory.mktemp("sources")
    for module in {hook.module for hook in HOOKS + MRV2_HOOKS}:
        base = Path(*module.split("."))
        for relative in (base.with_suffix(".py"), base / "__init__.py"):
            if (vllm_root() / relative).is_file():
                (root / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(vllm_root() / relative, root / relative)
    return root


def test_installed_vllm_has_every_hook():
    from vllm_dflash.vllm import register

    # Also with vllm-dflash's patches in place (a second register() changes nothing): each
    # wrapper keeps the signature of what it wraps.
    register()
    assert broken_hooks() == []
    assert broken_hooks(MRV2_HOOKS) == []


def test_source_check_agrees_with_the_installed_vllm(sources):
    assert broken_hooks_in_sources(vllm_root()) == []
    assert broken_hooks_in_sources(sources) == []
    assert check_main(["--source", str(sources)]) == 0


def edit(sources: Path, module: str, old: str, new: str) -> None:
    path = sources / Path(*module.split(".")).with_suffix(".py")
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_each_kind_of_change_is_named(sources, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(sources, changed)
    # A method renamed, a parameter renamed, a module-level function gone.
    edit(changed, "vllm.v1.core.sched.scheduler", "def _free_request(", "def _release_request(")
    edit(changed, "vllm.v1.worker.gpu_model_runner",
         "self, common_attn_metadata: CommonAttentionMetadata | None\n    ) -> bool:",
         "self, attn_metadata: CommonAttentionMetadata | None\n    ) -> bool:")
    edit(changed, "vllm.v1.sample.rejection_sampler", "def expand_batch_to_tokens(",
         "def expand_to_tokens(")
    problems = broken_hooks_in_sources(changed)
    gpu_model_runner, scheduler, sampler = (
        "vllm.v1.worker.gpu_model_runner", "vllm.v1.core.sched.scheduler",
        "vllm.v1.sample.rejection_sampler")
    assert problems == [
        f"{gpu_model_runner}.GPUModelRunner._input_fits_in_drafter: no parameter "
        + "common_attn_metadata",
        f"{scheduler}.Scheduler._free_request: missing (not defined in {scheduler})",
        f"{sampler}.expand_batch_to_tokens: missing (not defined in {sampler})",
    ], problems
    assert check_main(["--source", str(changed)]) == 1


def test_runtime_check_names_missing_modules_attributes_and_parameters():
    hooks = (Hook("vllm.no_such_module", "thing"),
             Hook("vllm.v1.core.sched.scheduler", "Scheduler.no_such_method"),
             Hook("vllm.v1.core.sched.scheduler", "Scheduler.add_request", ("request", "x")))
    problems = broken_hooks(hooks)
    assert [p.split(":")[0] for p in problems] == [str(h) for h in hooks]
    assert problems[2].endswith("no parameter x")
