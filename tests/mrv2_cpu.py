"""Model Runner V2 on vLLM's CPU build: vLLM enables MRV2 only where Triton has an active
backend, so a stand-in "cpu" backend is registered and every Triton kernel runs in Triton's
interpreter (correct, and far too slow to say anything of speed). Call enable() in a fresh
process before vLLM is imported."""

import os
import types


class _ActiveDriver:
    def is_active(self) -> bool:
        return True


def enable() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.language as tl
    from triton.backends import backends
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    backends.setdefault("cpu", types.SimpleNamespace(driver=_ActiveDriver(), compiler=None))

    # The interpreter's masked store takes bool masks only, but `mask & is_valid` of two int1
    # values comes out int32 there (vLLM's gumbel_sample caching draft logits does that).
    masked_store = interpreter.InterpreterBuilder.create_masked_store

    def bool_masked_store(self, ptrs, value, mask, cache_policy):
        mask = interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)
        return masked_store(self, ptrs, value, mask, cache_policy)

    interpreter.InterpreterBuilder.create_masked_store = bool_masked_store
    # libdevice functions have no interpreter implementation (they return None there); MRV2's
    # rejection sampler resamples with log1p when drafts carry their logits.
    libdevice.log1p = lambda x: tl.log(1.0 + x)
