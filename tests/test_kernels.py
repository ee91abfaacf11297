"""Kernel tests.

- The torch references against naive dense computations (in this process).
- The Triton kernels against the references under TRITON_INTERPRET=1. Triton reads that variable
  when a kernel is decorated, so these checks run this file as a script in a fresh subprocess
  with the variable set: they work alone, in the full suite, and after anything imported
  vllm or Triton.
- The compiled CPU kernels (built by the README's install) against the references.
- The CUDA sources compile with nvcc (skipped without nvcc).

Batches are ragged (different query and context lengths, empty contexts), block tables are
shuffled and the caches are strided views, as vLLM builds them.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import traceback
from pathlib import Path

import pytest
import torch

from vllm_dflash import layers
from vllm_dflash.kernels import _compiled, norm_rope
from vllm_dflash.kernels.argmax import argmax_rows
from vllm_dflash.kernels.draft_attention import (
    draft_attention,
    draft_attention_cpu,
    draft_attention_reference,
    draft_attention_torch,
    draft_attention_triton,
)
from vllm_dflash.kernels.inputs import (
    EPS,
    THETA,
    attention_batch,
    injection_batch,
    with_cache_copies,
    with_padding,
)
from vllm_dflash.kernels.kv_injection import (
    kv_injection,
    kv_injection_reference,
    kv_injection_torch,
    kv_injection_triton,
)
from vllm_dflash.layers import rope_cos_sin_cache

REPO = Path(__file__).resolve().parents[1]
MASKS = [(False, None), (True, None), (False, 7), (True, 7), (False, 80), (True, 80)]
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


# ---------------------------------------------------------------------------- naive oracles


def naive_draft_attention(
    q, k, v, kv_cache, block_table, context_lens, query_start_loc, scale, causal, sliding_window
) -> torch.Tensor:
    """Token by token, head by head, in float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    block_size = kv_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(len(context_lens)):
        ctx_len = int(context_lens[r])
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        keys, values = [], []
        for pos in range(ctx_len):
            row = kv_cache[int(block_table[r, pos // block_size]), :, pos % block_size]
            keys.append(row[:, :head_dim])
            values.append(row[:, head_dim:])
        keys = torch.stack(keys + list(k[start:end])).double()
        values = torch.stack(values + list(v[start:end])).double()
        for i in range(end - start):
            q_pos = ctx_len + i
            visible = torch.tensor([
                (not causal or k_pos <= q_pos)
                and (sliding_window is None or abs(q_pos - k_pos) < sliding_window)
                for k_pos in range(len(keys))
            ])
            for h in range(num_heads):
                scores = keys[:, h // group] @ q[start + i, h].double() * scale
                scores[~visible] = float("-inf")
                out[start + i, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def naive_kv_injection(
    ctx, positions, slot_mapping, kv_weight, k_norm_weight, eps, cos_sin_cache, kv_caches
) -> None:
    """Per token and layer, separate k/v projections, float64, angles from THETA."""
    num_layers, head_dim = k_norm_weight.shape
    num_kv_heads, block_size = kv_caches[0].shape[1], kv_caches[0].shape[2]
    weight = kv_weight.double().view(num_layers, 2, num_kv_heads, head_dim, -1)
    inv_freq = THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    half = head_dim // 2
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        angle = float(positions[t]) * inv_freq
        cos, sin = angle.cos(), angle.sin()
        x = ctx[t].double()
        for layer, cache in enumerate(kv_caches):
            key = weight[layer, 0] @ x
            value = weight[layer, 1] @ x
            key = key / (key.pow(2).mean(-1, keepdim=True) + eps).sqrt()
            key = key * k_norm_weight[layer].double()
            x1, x2 = key[:, :half], key[:, half:]
            key = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
            cache[slot // block_size, :, slot % block_size] = torch.cat([key, value], -1).to(
                cache.dtype)


# ---------------------------------------------------------------------------- references


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("causal,sliding_window", MASKS)
def test_draft_attention_reference_matches_naive(group: int, causal: bool,
                                                 sliding_window: int | None) -> None:
    args = attention_batch([0, 5, 13, 70], [3, 1, 4, 6], 2 * group, 2, 16, torch.float32,
                           "permuted", seed=group)
    out = draft_attention_reference(**args, scale=0.25, causal=causal,
                                    sliding_window=sliding_window)
    expected = naive_draft_attention(**args, scale=0.25, causal=causal,
                                     sliding_window=sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_draft_attention_reference_bf16() -> None:
    args = attention_batch([9, 0], [4, 2], 4, 1, 16, torch.bfloat16, "padded")
    out = draft_attention_reference(**args, scale=0.25, causal=False, sliding_window=None)
    expected = naive_draft_attention(**args, scale=0.25, causal=False, sliding_window=None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


# (context_lens, query_lens): ragged with empty contexts; the proposer's equal blocks (no
# padding); contexts over several cache blocks; every context empty.
ATTENTION_BATCHES = [([0, 5, 13, 70], [3, 1, 4, 6]), ([40, 3, 0], [8, 8, 8]),
                     ([9, 33, 17], [1, 5, 2]), ([0, 0], [2, 3])]


@pytest.mark.parametrize("path", ["torch", "c++"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("causal,sliding_window", MASKS)
@pytest.mark.parametrize("context_lens,query_lens", ATTENTION_BATCHES)
def test_draft_attention_cpu_paths_match_reference(
    path: str, group: int, causal: bool, sliding_window: int | None, context_lens: list[int],
    query_lens: list[int],
) -> None:
    """The torch fallback and the C++ kernel; groups of 1, 3 and 4 heads (the kernel's row
    tiles full, ragged, or spanning two queries)."""
    attend = {"torch": draft_attention_torch, "c++": draft_attention_cpu}[path]
    args = attention_batch(context_lens, query_lens, 2 * group, 2, 16, torch.float32,
                           "permuted", seed=group)
    flags = {"scale": 0.25, "causal": causal, "sliding_window": sliding_window}
    torch.testing.assert_close(attend(**args, **flags),
                               draft_attention_reference(**args, **flags),
                               **TOLERANCES[torch.float32])


@pytest.mark.parametrize("layout", ["contiguous", "padded", "strided_dim"])
def test_draft_attention_torch_layouts_bf16_and_extra_rows(layout: str) -> None:
    """bf16, every cache layout, a max_query_len above the longest query, and q rows past
    query_start_loc[-1] (left undefined, the rest must match)."""
    args = attention_batch([6, 0, 21], [4, 4, 2], 4, 2, 16, torch.bfloat16, layout)
    flags = {"scale": 0.25, "causal": True, "sliding_window": 9}
    expected = draft_attention_reference(**args, **flags)
    torch.testing.assert_close(draft_attention_torch(**args, **flags, max_query_len=6),
                               expected, **TOLERANCES[torch.bfloat16])
    extra = {**args, **{name: torch.cat([args[name], args[name][:3]]) for name in "qkv"}}
    got = draft_attention_torch(**extra, **flags)
    torch.testing.assert_close(got[:10], expected, **TOLERANCES[torch.bfloat16])


def test_kv_injection_reference_matches_naive() -> None:
    args = injection_batch(11, 24, 3, 2, 16, torch.float32, ["permuted", "padded", "contiguous"])
    expected = with_cache_copies(args)
    kv_injection_reference(**args)
    naive_kv_injection(**expected)
    for got, want in zip(args["kv_caches"], expected["kv_caches"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", ["some", "none", "all"])
def test_kv_injection_torch_equals_reference(dtype: torch.dtype, padding: str) -> None:
    """Bit for bit, with padding slots or none or only, a different cache layout per layer."""
    args = with_padding(injection_batch(11, 24, 3, 2, 16, dtype,
                                        ["permuted", "padded", "strided_dim"]), padding)
    expected = with_cache_copies(args)
    kv_injection_torch(**args)
    kv_injection_reference(**expected)
    for got, want in zip(args["kv_caches"], expected["kv_caches"]):
        assert torch.equal(got, want)


def test_dispatch_on_cpu() -> None:
    """The compiled CPU ops where they apply; the torch fallback for a cache whose last dim is
    strided (draft attention reads rows in place)."""
    args = injection_batch(6, 24, 2, 2, 16, torch.float32, ["permuted"])
    expected = with_cache_copies(args)
    kv_injection(**args)
    num_layers = len(args["kv_caches"])
    _compiled.kv_injection_write(
        (expected["ctx"] @ expected["kv_weight"].t()).view(6, num_layers, 2, -1),
        *(expected[name] for name in ("positions", "slot_mapping", "k_norm_weight", "eps",
                                      "cos_sin_cache", "kv_caches")))
    for got, want in zip(args["kv_caches"], expected["kv_caches"]):
        assert torch.equal(got, want)
    flags = {"scale": 0.25, "causal": True, "sliding_window": None}
    for layout, path in (("permuted", draft_attention_cpu),
                         ("strided_dim", draft_attention_torch)):
        batch = attention_batch([3, 8], [2, 5], 4, 2, 16, torch.float32, layout)
        assert torch.equal(draft_attention(**batch, **flags), path(**batch, **flags))


# ---------------------------------------------------------------------------- compiled CPU kernels


def test_cpu_kernels_are_built() -> None:
    assert _compiled.cpu_available(), (
        f"vllm_dflash._C_cpu does not import ({_compiled.cpu_import_error}): install with "
        "`pip install --no-build-isolation -e .` and a C++ compiler (scripts/install_cpu.sh)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "padded"])
def test_draft_attention_cpu_kernel_dtypes_and_layouts(dtype: torch.dtype, layout: str) -> None:
    """Every dtype, padded cache rows, a head_dim that is no multiple of 4 (the kernel's
    unrolled loops) and q rows past query_start_loc[-1] (left undefined, the rest must match)."""
    args = attention_batch([6, 0, 21, 40], [4, 4, 2, 8], 8, 2, 18, dtype, layout)
    flags = {"scale": 0.25, "causal": False, "sliding_window": 9}
    expected = draft_attention_reference(**args, **flags)
    extra = {**args, **{name: torch.cat([args[name], args[name][:3]]) for name in "qkv"}}
    got = draft_attention_cpu(**extra, **flags)
    tolerance = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(got[:18], expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", ["some", "none", "all"])
def test_kv_injection_cpu_kernel_matches_reference(dtype: torch.dtype, padding: str) -> None:
    """A different cache layout per layer (a strided last dim included), padding slots or none
    or only, odd head counts."""
    layouts = ["permuted", "padded", "strided_dim", "contiguous"]
    for num_kv_heads, head_dim in ((2, 16), (3, 48)):
        args = with_padding(
            injection_batch(11, 40, 4, num_kv_heads, head_dim, dtype, layouts), padding)
        expected = with_cache_copies(args)
        kv_injection(**args)  # the dispatcher: the compiled op (test_dispatch_on_cpu)
        kv_injection_reference(**expected)
        for got, want in zip(args["kv_caches"], expected["kv_caches"]):
            torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_rope_cpu_kernels_match_references(dtype: torch.dtype) -> None:
    """RMSNorm over hidden states and heads; RoPE of a strided q view (a fused projection)."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((5, 48), (7, 3, 16), (0, 16)):
        x = torch.randn(shape, generator=gen).to(dtype)
        weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
        torch.testing.assert_close(torch.ops.vllm_dflash_cpu.rms_norm(x, weight, EPS),
                                   layers.rms_norm(x, weight, EPS), **TOLERANCES.get(
                                       dtype, TOLERANCES[torch.bfloat16]))
    qkv = torch.randn(9, 5 * 16, generator=gen).to(dtype)
    q = qkv[:, :48].view(9, 3, 16)
    tables = layers.rope_tables(torch.randint(0, 200, (9,), generator=gen),
                                rope_cos_sin_cache(16, 200, THETA))
    torch.testing.assert_close(torch.ops.vllm_dflash_cpu.rotate(q, *tables),
                               layers.rotate(q, tables),
                               **TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16]))


def test_norm_rope_dispatch() -> None:
    """The compiled ops at inference; the references where autograd records or x is strided."""
    x = torch.randn(4, 2, 16)
    weight = torch.nn.Parameter(torch.rand(16) + 0.5)
    tables = layers.rope_tables(torch.arange(4), rope_cos_sin_cache(16, 8, THETA))
    with torch.no_grad():
        assert torch.equal(norm_rope.rms_norm(x, weight, EPS),
                           torch.ops.vllm_dflash_cpu.rms_norm(x, weight, EPS))
        assert torch.equal(norm_rope.rotate(x, tables),
                           torch.ops.vllm_dflash_cpu.rotate(x, *tables))
        strided = x.transpose(0, 1)
        assert torch.equal(norm_rope.rms_norm(strided, weight, EPS),
                           layers.rms_norm(strided, weight, EPS))
    out = norm_rope.rms_norm(x, weight, EPS)
    assert out.requires_grad and torch.equal(out, layers.rms_norm(x, weight, EPS))
    x.requires_grad_()
    assert torch.equal(norm_rope.rotate(x, tables), layers.rotate(x, tables))


def test_draft_attention_cpu_kernel_far_scores() -> None:
    """Scores hundreds apart (exp underflows to 0 and must not wrap around), and a key far above
    the rest (the softmax is one-hot)."""
    args = attention_batch([30, 7], [4, 4], 4, 2, 16, torch.float32, "contiguous")
    args["q"] = args["q"] * 60.0
    for scale in (0.25, 4.0):
        flags = {"scale": scale, "causal": False, "sliding_window": None}
        torch.testing.assert_close(draft_attention_cpu(**args, **flags),
                                   draft_attention_reference(**args, **flags),
                                   **TOLERANCES[torch.float32])


def test_cpu_kernels_reject_bad_inputs() -> None:
    args = attention_batch([3, 8], [2, 5], 4, 2, 16, torch.float32, "strided_dim")
    flags = {"scale": 0.25, "causal": True, "sliding_window": None}
    with pytest.raises(RuntimeError, match="last dim .* must be contiguous"):
        draft_attention_cpu(**args, **flags)
    args = attention_batch([3, 8], [2, 5], 4, 2, 16, torch.float32, "contiguous")
    with pytest.raises(RuntimeError, match="int32"):
        draft_attention_cpu(**{**args, "context_lens": args["context_lens"].long()},
                                  **flags)
    args = injection_batch(6, 24, 2, 2, 16, torch.float32, ["permuted"])
    kv = torch.zeros(6, 2, 2, 32)
    with pytest.raises(RuntimeError, match="positions and slot_mapping must be contiguous int64"):
        _compiled.kv_injection_write(kv, args["positions"].int(), args["slot_mapping"],
                                     args["k_norm_weight"], EPS, args["cos_sin_cache"],
                                     args["kv_caches"])


# ---------------------------------------------------------------------------- Triton (interpreted)


def check_triton_draft_attention() -> None:
    """Triton == reference on a ragged batch: masks x GQA 1/4 in fp32, some in bf16, layouts."""
    context_lens, query_lens = [0, 5, 133], [3, 20, 16]  # 20 > one query tile at GQA 4
    layouts = ["permuted", "padded", "strided_dim"]
    cases = [(torch.float32, group, mask) for group in (1, 4) for mask in MASKS]
    cases += [(torch.bfloat16, 1, MASKS[0]), (torch.bfloat16, 4, MASKS[0]),
              (torch.bfloat16, 4, MASKS[3])]
    for i, (dtype, group, (causal, window)) in enumerate(cases):
        layout = layouts[i % len(layouts)]
        args = attention_batch(context_lens, query_lens, 2 * group, 2, 32, dtype, layout, seed=i)
        flags = {"scale": 32**-0.5, "causal": causal, "sliding_window": window}
        torch.testing.assert_close(draft_attention_triton(**args, **flags),
                                   draft_attention_reference(**args, **flags), **TOLERANCES[dtype])
    # head_dim 48 (padded to 64 in the kernel), 3 heads; max_query_len given by the caller
    args = attention_batch([10, 3], [5, 2], 3, 3, 48, torch.float32, "permuted")
    flags = {"scale": 0.1, "causal": False, "sliding_window": None}
    torch.testing.assert_close(draft_attention_triton(**args, **flags, max_query_len=5),
                               draft_attention_reference(**args, **flags),
                               **TOLERANCES[torch.float32])


def check_triton_kv_injection() -> None:
    """Triton == reference: a different cache layout per layer, padding slots, odd head counts."""
    layouts = ["permuted", "padded", "strided_dim", "contiguous"]
    for dtype, num_kv_heads, head_dim in ((torch.float32, 2, 32), (torch.float32, 3, 48),
                                          (torch.bfloat16, 2, 32)):
        args = injection_batch(9, 40, 4, num_kv_heads, head_dim, dtype, layouts)
        expected = with_cache_copies(args)
        kv_injection_triton(**args)
        kv_injection_reference(**expected)
        for got, want in zip(args["kv_caches"], expected["kv_caches"]):
            torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def check_triton_norm_rope() -> None:
    """Triton RMSNorm and RoPE == the torch references: hidden and per-head rows, a width
    that is no power of two, fp32 and bf16."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((7, 256), (5, 4, 64), (3, 48)):
            x = (3 * torch.randn(shape, generator=gen)).to(dtype)
            weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
            torch.testing.assert_close(norm_rope.rms_norm_triton(x, weight, EPS),
                                       layers.rms_norm(x, weight, EPS), **TOLERANCES[dtype])
        for tokens, heads, head_dim in ((6, 5, 64), (4, 3, 48)):
            x = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
            positions = torch.randint(0, 100, (tokens,), generator=gen)
            tables = layers.rope_tables(positions, rope_cos_sin_cache(head_dim, 100, 1e4))
            torch.testing.assert_close(norm_rope.rotate_triton(x, tables),
                                       layers.rotate(x, tables), **TOLERANCES[dtype])


INTERPRETED_CHECKS = {
    "draft_attention": check_triton_draft_attention,
    "kv_injection": check_triton_kv_injection,
    "norm_rope": check_triton_norm_rope,
}


def run_interpreted_checks(result_path: str) -> None:
    """Script entry (TRITON_INTERPRET=1 set by the caller): each check's "ok" or traceback."""
    results = {}
    for name, check in INTERPRETED_CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 (any failure is this check's result)
            results[name] = traceback.format_exc()
    Path(result_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Runs this file as a script in a fresh interpreter-mode process, once for all checks."""
    result_path = tmp_path_factory.mktemp("interpreted") / "results.json"
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    proc = subprocess.run([sys.executable, __file__, str(result_path)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and result_path.exists(), proc.stdout + proc.stderr
    return json.loads(result_path.read_text())


@pytest.mark.parametrize("kernel", list(INTERPRETED_CHECKS))
def test_triton_matches_reference_interpreted(kernel: str,
                                              interpreted_results: dict[str, str]) -> None:
    assert interpreted_results[kernel] == "ok", interpreted_results[kernel]


# ---------------------------------------------------------------------------- Triton (sm_90)


def _sm90_compile(kernel, signature: dict[str, str], constexprs: dict, num_stages: int = 3):
    """Compiles a Triton kernel for an H100/H200 target; needs no GPU, only the bundled ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_stages": num_stages})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1 swaps Triton's compiler for its interpreter; this "
                    "test checks the compiler, and runs in the default suite without it")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
def test_triton_kernels_compile_for_sm90() -> None:
    """The kernels at Qwen3-8B drafter shapes go through the whole GPU compiler (ptx, cubin):
    catches what the interpreter accepts but codegen does not, and tiles too large for an SM's
    shared memory (fp32 attention once asked for 256 KiB)."""
    import triton.language as tl

    from vllm_dflash.kernels.draft_attention import _draft_attention_kernel, tile_config
    from vllm_dflash.kernels.kv_injection import _kv_injection_kernel
    from vllm_dflash.kernels.norm_rope import _rms_norm_kernel, _rotate_kernel
    from vllm_dflash.kernels.verify import _verify_kernel

    _sm90_compile(_rms_norm_kernel,
                  {"x_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "dim": "i32",
                   "eps": "fp32"},
                  {"BLOCK": 4096})
    _sm90_compile(_rotate_kernel,
                  {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16",
                   "num_heads": "i32"},
                  {"HALF": 64, "BLOCK_H": 32, "BLOCK_HALF": 64})

    _sm90_compile(
        _kv_injection_kernel,
        {"kv_ptr": "*bf16", "positions_ptr": "*i64", "slot_mapping_ptr": "*i64",
         "k_norm_weight_ptr": "*bf16", "cos_sin_ptr": "*fp32", "table_ptr": "*i64",
         "eps": "fp32"},
        {"CACHE_DTYPE": tl.bfloat16, "NUM_LAYERS": 5, "NUM_KV_HEADS": 8, "HEAD_DIM": 128,
         "BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_HALF": 64},
    )
    verify_types = {"out_ptr": "*i32", "cu_num_draft_tokens_ptr": "*i32",
                    "draft_token_ids_ptr": "*i64", "draft_probs_ptr": "*fp32",
                    "target_probs_ptr": "*fp32", "target_argmax_ptr": "*i64",
                    "bonus_token_ids_ptr": "*i64", "is_greedy_ptr": "*i1", "uniform_ptr": "*fp64",
                    "inv_exp_ptr": "*fp32", "synthetic_rates_ptr": "*fp32", "vocab_size": "i32",
                    "max_spec_len": "i32"}
    for block in (False, True):
        _sm90_compile(_verify_kernel, verify_types,
                      {"HAS_DRAFT_PROBS": True, "ALL_GREEDY": False, "SYNTHETIC": False,
                       "BLOCK": block, "BLOCK_V": 1024})

    def arg_type(arg: str, tensor_type: str) -> str:
        if arg in ("q_ptr", "k_ptr", "v_ptr", "cache_ptr", "out_ptr"):
            return tensor_type
        if arg.endswith("_ptr"):
            return "*i32"
        return "fp32" if arg == "scale_log2" else "i32"

    for dtype, tensor_type in ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32")):
        for causal, sliding in ((False, False), (True, True)):
            tiles = tile_config(dtype, head_dim=128, group=4, max_query_len=16)
            num_stages = tiles.pop("num_stages")
            constexprs = {"HEAD_DIM": 128, "GROUP": 4, "BLOCK_SIZE": 16, "CAUSAL": causal,
                          "SLIDING": sliding, "WIDEN_DOT": False, **tiles}
            signature = {arg: arg_type(arg, tensor_type) for arg in _draft_attention_kernel.arg_names
                         if arg not in constexprs}
            compiled = _sm90_compile(_draft_attention_kernel, signature, constexprs, num_stages)
            assert compiled.metadata.shared <= 227 * 1024, (dtype, compiled.metadata.shared)


# ---------------------------------------------------------------------------- CUDA sources

# nvcc on PATH, or in a CUDA toolkit installed where NVIDIA's packages put it.
NVCC = shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda*/bin): the CUDA "
                    "sources cannot be compiled on this machine (scripts/gpu_check.sh builds them "
                    "on a GPU one); the CPU path does not use them")
def test_cuda_sources_compile(tmp_path: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"], str(REPO / "csrc")]
    if not Path(includes[0], "c10/cuda/impl/cuda_cmake_macros.h").exists():
        # A CPU build of torch ships the c10/cuda headers but not this generated one.
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        macros = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
        (stub / "cuda_cmake_macros.h").write_text(macros)
        includes.append(str(tmp_path / "stub"))
    flags = ["-std=c++20", "-DTORCH_EXTENSION_NAME=_C", *[f"-I{p}" for p in includes]]
    objects = {src: tmp_path / f"{src}.o" for src in ("kv_injection.cu", "torch_bindings.cpp")}
    procs = [subprocess.Popen([NVCC, "-c", str(REPO / "csrc" / src), "-o", str(obj), *flags],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for src, obj in objects.items()]
    for proc in procs:
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output
    nm = shutil.which("nm")
    if nm is not None:  # every launcher the bindings call is instantiated in the .cu
        def symbols(obj: Path, which: str) -> set[str]:
            out = subprocess.run([nm, "-C", which, str(obj)], capture_output=True, text=True,
                                 check=True)
            return {line[line.index("launch_kv_injection"):] for line in out.stdout.splitlines()
                    if "launch_kv_injection" in line}

        needed = symbols(objects["torch_bindings.cpp"], "--undefined-only")
        assert needed and needed <= symbols(objects["kv_injection.cu"], "--defined-only")


if __name__ == "__main__":
    run_interpreted_checks(sys.argv[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_argmax_rows_equals_torch_argmax_ties_and_nan_included(dtype):
    logits = torch.randn(37, 1000).to(dtype)
    logits[3, [5, 700]] = 50.0  # a tie: the first maximum wins
    logits[4, 9] = float("nan")  # a NaN counts as the maximum
    logits[5] = float("-inf")
    strided = torch.randn(1000, 37).to(dtype).t()  # a transposed view, as vLLM may pass
    for x in (logits, strided, logits.view(37, 10, 100)):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
