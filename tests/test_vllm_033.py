"""vLLM 0.33's changes that reach vllm-dflash, checked on 0.32: its rejection sampler passes
FLy's arguments to `rejection_sample` (they pass through to vllm-dflash's verification, which
ignores them), and `rejection_sample_method: "fly"` (lossy) fails a vllm-dflash engine's
start-up. 0.33's own sources are checked in CI (scripts/check_vllm_hooks.py --release 0.33.0)."""

from types import SimpleNamespace

import pytest

from vllm_dflash.vllm import config, register, sampler

FLY = {"fly_window_size": None, "fly_entropy_threshold": None, "fly_entropy_top_k": 3}


def test_fly_arguments_pass_through_to_the_verification(monkeypatch):
    from vllm.v1.sample import rejection_sampler

    from vllm_dflash.kernels import verify

    register()
    seen = {}

    def verification(*args, **kwargs):
        seen.update(kwargs)
        return "verified"

    monkeypatch.setattr(verify, "vllm_rejection_sample", verification)
    token = sampler._running.set(sampler.Verification(block=True))
    try:
        out = rejection_sampler.rejection_sample("args", synthetic_mode=False, **FLY)
    finally:
        sampler._running.reset(token)
    assert out == "verified"
    assert seen == {"synthetic_mode": False, "block_verification": True}


def test_fly_verification_fails_startup():
    spec = SimpleNamespace(rejection_sample_method="fly")
    with pytest.raises(config.DFlashSetupError, match='"fly" is lossy.*VLLM_DFLASH_IMPL=vllm'):
        config._check_dflash_config(spec, None, None)
