"""One GPU check of vllm-dflash, meant for a single H200 run of under 8 minutes.

    bash scripts/gpu_check.sh [--out DIR] [--budget-s 460] [--only parity,bench]

Steps, each in a subprocess with its own time limit, in this order:

  versions  nvidia-smi, torch, triton, CUDA, nvcc, vLLM
  build     the CUDA extension vllm_dflash._C, in place (setup.py build_ext --inplace), when
            nvcc is present; skipped otherwise
  parity    every kernel path against its torch reference on the GPU (the pytest files below
            test the Triton kernels under the interpreter on the CPU only): draft attention
            (torch, triton) and KV injection (torch, triton, cuda) within dtype tolerance,
            verification (triton) bit for bit, greedy verification against a plain walk,
            RMSNorm and RoPE (triton)
  bench     benchmarks/kernels.py at Qwen3-8B / DFlash-b16 shapes, batches 1, 8, 64, with
            --cuda-graph --profile (fails when a graph's draft tokens differ from eager's);
            then the drafter step of a DFlash2 drafter of those shapes at batches 1 and 64
  pytest    tests/test_kernels.py tests/test_verify.py, but for their interpreted Triton checks
  e2e       only where `import vllm` works: a random-weight target of Qwen3-8B widths
            (--e2e-target-layers deep) and a DFlash-b16-shaped drafter, written locally;
            vllm.LLM with CUDA graphs, greedy output with `method: dflash` must equal the
            output without speculation at batch 1 and 16. Without vLLM it says so and is
            skipped.

A summary table ends the run; the exit status is 1 when any step failed or ran out of time.
Logs and JSON results go to --out. Subcommands `parity`, `write-pair` and `generate` are the
steps' own entry points.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout (and the extension built into it), installed or not

import torch

from vllm_dflash import layers
from vllm_dflash.checkpoint import save_drafter
from vllm_dflash.config import DFlashConfig
from vllm_dflash.kernels import _compiled, norm_rope
from vllm_dflash.kernels.draft_attention import (
    draft_attention_reference,
    draft_attention_torch,
    draft_attention_triton,
)
from vllm_dflash.kernels.inputs import (
    attention_batch,
    injection_batch,
    verify_batch,
    with_cache_copies,
)
from vllm_dflash.kernels.kv_injection import (
    kv_injection,
    kv_injection_reference,
    kv_injection_torch,
    kv_injection_triton,
)
from vllm_dflash.kernels.verify import verify_reference, verify_triton
from vllm_dflash.layers import rope_cos_sin_cache
from vllm_dflash.tiny import EOS_TOKEN, MASK_TOKEN, random_drafter, spread_layer_ids

TOLERANCES = {torch.float32: {"atol": 1e-4, "rtol": 1e-4},
              torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}
STEP_LIMITS_S = {"versions": 120, "build": 300, "parity": 180, "bench": 240, "pytest": 300,
                 "e2e": 600}
OK, FAILED, SKIPPED = "ok", "FAIL", "skipped"
E2E_BATCHES = (1, 16)
# conv_kernel_size, conv_group_size, selector_rank, selector_top_k of the DFlash2 step costs
# (assumed values: no trained DFlash2 checkpoint was at hand).
DFLASH2_BENCH = "4,128,64,8"


# ---------------------------------------------------------------------------- kernel parity


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor, tol: dict) -> str | None:
    """None when got matches want within tol, else a line naming the case and the error."""
    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError:
        err = (got.double() - want.double()).abs().max().item()
        return f"{name}: max abs error {err:.3g} beyond atol {tol['atol']} rtol {tol['rtol']}"
    return None


# (context_lens, query_lens): ragged queries with an empty context; the proposer's equal
# blocks. Contexts span many cache blocks.
ATTENTION_BATCHES = (([0, 17, 133, 1000], [3, 16, 1, 20]), ([1024, 5, 300], [16, 16, 16]))
# (heads, KV heads, head_dim): Qwen3-8B-DFlash's GQA 4, and GQA 1.
ATTENTION_HEADS = ((32, 8, 128), (4, 4, 64))
# (tokens, hidden, layers, KV heads, head_dim): a batch-64 step of the Qwen3-8B drafter, and
# a small odd one.
INJECTION_SHAPES = ((448, 4096, 5, 8, 128), (9, 40, 3, 3, 64))


def parity_draft_attention(device: torch.device, batches: tuple = ATTENTION_BATCHES,
                           head_shapes: tuple = ATTENTION_HEADS) -> list[str]:
    """Torch (and, on CUDA, Triton) == reference for every batch, head shape, four masks,
    fp32 and bf16."""
    paths: dict[str, Callable[..., torch.Tensor]] = {"torch": draft_attention_torch}
    if device.type == "cuda":
        paths["triton"] = draft_attention_triton
    masks = [(False, None), (True, None), (False, 7), (True, 40)]
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, head_dim in head_shapes:
            for b, (context_lens, query_lens) in enumerate(batches):
                for causal, window in masks:
                    inputs = attention_batch(context_lens, query_lens, heads, kv_heads,
                                             head_dim, dtype, "permuted", seed=b,
                                             block_size=16, device=device)
                    flags = {"scale": head_dim**-0.5, "causal": causal,
                             "sliding_window": window}
                    want = draft_attention_reference(**inputs, **flags)
                    for name, attention in paths.items():
                        case = (f"draft_attention {name} {dtype} heads {heads}/{kv_heads} "
                                f"batch {b} causal {causal} window {window}")
                        got = attention(**inputs, **flags)
                        failures.append(_mismatch(case, got, want, TOLERANCES[dtype]))
    return [f for f in failures if f]


def parity_kv_injection(device: torch.device,
                        shapes: tuple = INJECTION_SHAPES) -> list[str]:
    """Torch, Triton and the compiled CUDA op against the reference, cache by cache, every
    shape in fp32 and bf16."""
    paths: dict[str, Callable[..., None]] = {"torch": kv_injection_torch}
    if device.type == "cuda":
        paths["triton"] = kv_injection_triton
        if _compiled.cuda_available():
            paths["cuda"] = kv_injection  # the dispatcher picks the compiled op
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, hidden, num_layers, kv_heads, head_dim in shapes:
            inputs = injection_batch(tokens, hidden, num_layers, kv_heads, head_dim, dtype,
                                     ["permuted"], block_size=16, max_position=4096,
                                     rope_theta=1e6, device=device)
            want = with_cache_copies(inputs)
            kv_injection_reference(**want)
            for name, inject in paths.items():
                got = with_cache_copies(inputs)
                inject(**got)
                pairs = zip(got["kv_caches"], want["kv_caches"], strict=True)
                for layer, (cache, expected) in enumerate(pairs):
                    case = f"kv_injection {name} {dtype} kv_heads {kv_heads} layer {layer}"
                    failures.append(_mismatch(case, cache, expected, TOLERANCES[dtype]))
    return [f for f in failures if f]


def greedy_walk(inputs: dict) -> torch.Tensor:
    """The greedy verification result, request by request in plain Python: the oracle."""
    drafts = inputs["draft_token_ids"].tolist()
    argmax = inputs["target_probs"].argmax(dim=-1).tolist()
    ends = inputs["cu_num_draft_tokens"].tolist()
    out = torch.full((len(ends), inputs["max_spec_len"] + 1), -1, dtype=torch.int32)
    for r, end in enumerate(ends):
        start = ends[r - 1] if r else 0
        tokens = []
        for row in range(start, end):
            if drafts[row] != argmax[row]:
                tokens.append(argmax[row])
                break
            tokens.append(drafts[row])
        else:
            tokens.append(int(inputs["bonus_token_ids"][r]))
        out[r, :len(tokens)] = torch.tensor(tokens)
    return out


def parity_verify(device: torch.device, vocabs: tuple[int, ...] = (2500, 151936)) -> list[str]:
    """Greedy requests equal the plain walk (every path); on CUDA Triton equals the reference
    bit for bit, greedy and sampled rows, one-hot and probabilistic drafts (token rule and
    block verification), a seeded request."""
    paths = {"reference": verify_reference}
    if device.type == "cuda":
        paths["triton"] = verify_triton
    failures = []
    for vocab in vocabs:
        inputs = verify_batch(batch=16, max_spec_len=15, vocab=vocab, device=device)
        greedy = {**inputs, "is_greedy": torch.ones_like(inputs["is_greedy"])}
        want = greedy_walk(greedy)
        for name, verify in paths.items():
            got = verify(**{**greedy, "draft_probs": None}, generators={}).cpu()
            if not torch.equal(got, want):
                failures.append(f"verify {name} vocab {vocab}: greedy output is not the walk's")
        if "triton" not in paths:
            continue
        for draft_probs, block in ((None, False), (inputs["draft_probs"], False),
                                   (inputs["draft_probs"], True)):
            outs = []
            for verify in (verify_reference, verify_triton):
                torch.manual_seed(1)
                generators = {2: torch.Generator(device).manual_seed(5)}
                outs.append(verify(**{**inputs, "draft_probs": draft_probs},
                                   generators=generators, block=block))
            if not torch.equal(*outs):
                kind = "one-hot" if draft_probs is None else "draft-probs"
                kind += " block" if block else ""
                failures.append(f"verify triton vocab {vocab} {kind}: differs from reference")
    return failures


def parity_norm_rope(device: torch.device) -> list[str]:
    """RMSNorm and RoPE as the drafter calls them (Triton on CUDA, the compiled op or torch on
    CPU) against the references, at Qwen3-8B drafter widths, fp32 and bf16."""
    gen = torch.Generator().manual_seed(0)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((64, 4096), (64, 32, 128), (16, 40)):
            x = (3 * torch.randn(shape, generator=gen)).to(device, dtype)
            weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(device, dtype)
            got = norm_rope.rms_norm(x, weight, 1e-6)
            failures.append(_mismatch(f"rms_norm {dtype} {shape}", got,
                                      layers.rms_norm(x, weight, 1e-6), TOLERANCES[dtype]))
        x = torch.randn(64, 32, 128, generator=gen).to(device, dtype)
        tables = layers.rope_tables(torch.randint(0, 4096, (64,), generator=gen).to(device),
                                    rope_cos_sin_cache(128, 4096, 1e6, device))
        failures.append(_mismatch(f"rotate {dtype}", norm_rope.rotate(x, tables),
                                  layers.rotate(x, tables), TOLERANCES[dtype]))
    return [f for f in failures if f]


PARITY_CHECKS = {"draft_attention": parity_draft_attention,
                 "kv_injection": parity_kv_injection,
                 "norm_rope": parity_norm_rope,
                 "verify": parity_verify}


def run_parity(device: torch.device) -> int:
    """Every parity check on device; prints each failure, returns the exit status."""
    status = 0
    for name, check in PARITY_CHECKS.items():
        start = time.perf_counter()
        failures = check(device)
        took = time.perf_counter() - start
        print(f"parity {name:16s} {OK if not failures else FAILED} ({took:.1f} s)", flush=True)
        for failure in failures:
            print(f"  {failure}")
        status |= bool(failures)
    return status


# ---------------------------------------------------------------------------- end to end


@dataclass(frozen=True)
class PairShape:
    """A target (Qwen3) and its DFlash drafter."""

    hidden: int
    intermediate: int
    target_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_position: int
    draft_layers: int
    draft_block: int
    rope_theta: float = 1e6


SHAPES = {
    # Qwen3-8B widths and z-lab Qwen3-8B-DFlash-b16; --e2e-target-layers 36 for the full depth.
    "qwen3-8b": PairShape(hidden=4096, intermediate=12288, target_layers=36, heads=32,
                          kv_heads=8, head_dim=128, vocab=151936, max_position=40960,
                          draft_layers=5, draft_block=16),
    "tiny": PairShape(hidden=128, intermediate=256, target_layers=4, heads=4, kv_heads=2,
                      head_dim=64, vocab=512, max_position=2048, draft_layers=2,
                      draft_block=8),
}


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per model id ("t{id}"): random prompts and
    generated ids all decode, whatever the vocabulary size (a trained BPE on local text stops
    far short of 151936)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS_TOKEN: 0, MASK_TOKEN: 1} | {f"t{i}": i for i in range(2, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([EOS_TOKEN, MASK_TOKEN])
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
              "pad_token": EOS_TOKEN, "model_max_length": 1 << 30}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_target(out_dir: Path, shape: PairShape, device: torch.device,
                 dtype: torch.dtype, seed: int = 0) -> Path:
    """Random-weight Qwen3ForCausalLM (transformers' init, drawn on device) + tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    write_tokenizer(out_dir, shape.vocab)
    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.target_layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position, rope_theta=shape.rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


def write_drafter(out_dir: Path, shape: PairShape, dtype: torch.dtype,
                  seed: int = 0) -> DFlashConfig:
    """Random DFlash drafter (tiny.random_drafter's weights) for a target of this shape."""
    cfg = DFlashConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_layers=shape.draft_layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim, rms_norm_eps=1e-6, rope_theta=shape.rope_theta,
        max_position_embeddings=shape.max_position, vocab_size=shape.vocab,
        layer_types=["full_attention"] * shape.draft_layers, sliding_window=None,
        block_size=shape.draft_block, mask_token_id=1,
        target_layer_ids=spread_layer_ids(shape.target_layers, shape.draft_layers),
        num_target_layers=shape.target_layers,
    )
    save_drafter(random_drafter(cfg, seed).to(dtype), out_dir)
    return cfg


def with_depth(shape: PairShape, target_layers: int | None) -> PairShape:
    """shape with another target depth (the drafter's feature layers follow)."""
    if target_layers is None:
        return shape
    return PairShape(**{**shape.__dict__, "target_layers": target_layers})


def make_prompts(vocab: int, count: int, seed: int = 0) -> list[dict]:
    """Token-id prompts of 4 to ~300 tokens, ids past the two special tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [4 + (37 * i) % 300 for i in range(count)]
    return [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()}
            for n in lengths]


def compare_outputs(expected: list[list[int]], got: list[list[int]]) -> list[str]:
    """One line per request whose tokens differ: its index and the first differing position."""
    if len(expected) != len(got):
        return [f"{len(got)} outputs, expected {len(expected)}"]
    lines = []
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != have:
            pos = next((j for j, (a, b) in enumerate(zip(want, have, strict=False)) if a != b),
                       min(len(want), len(have)))
            lines.append(f"request {i}: first difference at token {pos} "
                         f"({want[pos:pos + 3]} expected, {have[pos:pos + 3]} with speculation; "
                         f"lengths {len(want)} and {len(have)})")
    return lines


def generate(target: Path, drafter: Path | None, shape: PairShape, dtype: str,
             max_tokens: int, max_model_len: int) -> dict:
    """Greedy outputs of one engine at each of E2E_BATCHES, plus vLLM's spec-decode counters.
    CUDA graphs (vLLM's default) on a GPU; eager on CPU."""
    from vllm import LLM, SamplingParams

    on_gpu = torch.cuda.is_available()
    spec = None if drafter is None else {"method": "dflash", "model": str(drafter),
                                         "num_speculative_tokens": shape.draft_block - 1}
    extra = {"gpu_memory_utilization": 0.85} if on_gpu else {}
    llm = LLM(model=str(target), dtype=dtype, seed=0, max_model_len=max_model_len,
              max_num_seqs=max(E2E_BATCHES), enforce_eager=not on_gpu,
              disable_log_stats=False, speculative_config=spec, **extra)
    prompts = make_prompts(shape.vocab, max(E2E_BATCHES))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    result: dict = {"cuda_graphs": on_gpu, "async_scheduling": scheduler.async_scheduling}
    for batch in E2E_BATCHES:
        outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
        result[f"batch_{batch}"] = [list(o.outputs[0].token_ids) for o in outputs]
    result["spec_decode"] = {m.name.removeprefix("vllm:spec_decode_"): m.value
                             for m in llm.get_metrics()
                             if m.name.startswith("vllm:spec_decode_") and hasattr(m, "value")}
    return result


# ---------------------------------------------------------------------------- orchestration


@dataclass
class Result:
    step: str
    status: str
    detail: str
    seconds: float


class Runner:
    """Runs the steps' subprocesses against one deadline, logging each to the out folder."""

    def __init__(self, out_dir: Path, budget_s: float) -> None:
        self.out_dir = out_dir
        self.deadline = time.monotonic() + budget_s
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false"}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], limit_s: float, env: dict | None = None,
            tail: int = 30) -> tuple[int | None, str]:
        """(exit status or None on time-out, output); prints the output's last `tail` lines.
        The command runs in its own session, so a time-out also ends its children."""
        timeout = min(limit_s, self.left())
        if timeout < 5:
            print(f"\n== {name}: not started, the time budget is spent", flush=True)
            return None, "not started: the time budget is spent"
        print(f"\n== {name}: {' '.join(cmd)}  (limit {timeout:.0f} s)", flush=True)
        proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **(env or {})}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, rc = proc.communicate(timeout=timeout)[0], proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, rc = proc.communicate()[0] + f"\n[killed after {timeout:.0f} s]", None
        (self.out_dir / f"{name}.log").write_text(output)
        print("\n".join(output.rstrip().splitlines()[-tail:]), flush=True)
        return rc, output


def _status(rc: int | None, what: str) -> tuple[str, str]:
    if rc is None:
        return FAILED, f"{what}: time limit reached"
    return (OK, what) if rc == 0 else (FAILED, f"{what}: exit status {rc}")


VERSIONS = """
import importlib.util, torch, triton
print("torch", torch.__version__, "CUDA", torch.version.cuda,
      "available", torch.cuda.is_available())
print("triton", triton.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("vllm", "present" if importlib.util.find_spec("vllm") else "not installed")
raise SystemExit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")
"""


def nvcc_path() -> str | None:
    """nvcc where torch's extension builder looks: $CUDA_HOME, PATH, /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME")
    candidates = [home and str(Path(home, "bin", "nvcc")), shutil.which("nvcc"),
                  "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and Path(c).exists()), None)


def step_versions(runner: Runner, args: argparse.Namespace) -> Result:
    start = time.monotonic()
    if shutil.which("nvidia-smi"):
        runner.run("nvidia-smi", ["nvidia-smi"], 30, tail=25)
    else:
        print("nvidia-smi not found")
    nvcc = nvcc_path()
    if nvcc:
        runner.run("nvcc", [nvcc, "--version"], 30, tail=2)
    else:
        print("nvcc not found")
    rc, _ = runner.run("versions", [sys.executable, "-c", VERSIONS], STEP_LIMITS_S["versions"])
    status, detail = _status(rc, "a CUDA device, torch and triton")
    return Result("versions", status, detail, time.monotonic() - start)


def step_build(runner: Runner, args: argparse.Namespace) -> Result:
    start = time.monotonic()
    nvcc = nvcc_path()
    if nvcc is None:
        return Result("build", SKIPPED, "nvcc not found: no CUDA extension, Triton paths only",
                      0.0)
    env = {"VLLM_DFLASH_BUILD_CUDA": "1", "MAX_JOBS": str(os.cpu_count() or 4),
           "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
           "CUDA_HOME": os.environ.get("CUDA_HOME", str(Path(nvcc).parents[1]))}
    rc, _ = runner.run("build", [sys.executable, "setup.py", "build_ext", "--inplace"],
                       STEP_LIMITS_S["build"], env=env, tail=15)
    if rc == 0:
        check = ("from vllm_dflash.kernels import _compiled; "
                 "assert _compiled.cuda_available(), _compiled.cuda_import_error")
        rc, _ = runner.run("build-import", [sys.executable, "-c", check], 60)
    status, detail = _status(rc, "vllm_dflash._C built and importable")
    return Result("build", status, detail, time.monotonic() - start)


def step_parity(runner: Runner, args: argparse.Namespace) -> Result:
    start = time.monotonic()
    rc, _ = runner.run("parity", [sys.executable, __file__, "parity"], STEP_LIMITS_S["parity"])
    status, detail = _status(rc, "kernels match their references on the GPU")
    return Result("parity", status, detail, time.monotonic() - start)


def step_bench(runner: Runner, args: argparse.Namespace) -> Result:
    start = time.monotonic()
    cmd = [sys.executable, "benchmarks/kernels.py", "--batches", "1,8,64", "--cuda-graph",
           "--profile", "--json", str(runner.out_dir / "kernels.json")]
    rc, _ = runner.run("bench", cmd, STEP_LIMITS_S["bench"], tail=150)
    if rc == 0:  # the drafter step of a DFlash2 drafter, its selector inside the graph too
        cmd = [sys.executable, "benchmarks/kernels.py", "--batches", "1,64", "--cuda-graph",
               "--dflash2", DFLASH2_BENCH, "--json", str(runner.out_dir / "kernels-dflash2.json")]
        rc, _ = runner.run("bench-dflash2", cmd, STEP_LIMITS_S["bench"], tail=8)
    status, detail = _status(rc, f"step costs in {runner.out_dir / 'kernels*.json'}")
    return Result("bench", status, detail, time.monotonic() - start)


def step_pytest(runner: Runner, args: argparse.Namespace) -> Result:
    start = time.monotonic()
    # The interpreted Triton checks are the CPU's stand-in for `parity`; Triton 3.6's
    # interpreter (an H200 image's) fails them on a scalar loop bound.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_kernels.py", "tests/test_verify.py", "-k", "not interpreted"]
    rc, output = runner.run("pytest", cmd, STEP_LIMITS_S["pytest"], tail=15)
    if rc is not None and "No module named pytest" in output:
        return Result("pytest", FAILED, "pytest is not installed", time.monotonic() - start)
    status, detail = _status(rc, "tests/test_kernels.py tests/test_verify.py")
    return Result("pytest", status, detail, time.monotonic() - start)


PLUGIN_REGISTERED = """
from importlib.metadata import entry_points
names = [e.name for e in entry_points(group="vllm.general_plugins")]
raise SystemExit(0 if "dflash" in names else "the vllm-dflash plugin is not registered")
"""


def step_e2e(runner: Runner, args: argparse.Namespace) -> Result:
    start = time.monotonic()

    def result(status: str, detail: str) -> Result:
        return Result("e2e", status, detail, time.monotonic() - start)

    rc, _ = runner.run("e2e-import-vllm", [sys.executable, "-c", "import vllm"], 180)
    if rc != 0:
        print("\nvLLM end-to-end part NOT run: vLLM is not installed (import vllm failed).")
        return result(SKIPPED, "NOT run: vLLM is not installed")
    # vLLM finds plugins through entry points: only an installed package registers one.
    rc, _ = runner.run("e2e-plugin", [sys.executable, "-c", PLUGIN_REGISTERED], 60)
    if rc != 0:
        install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                   "-e", str(REPO)]
        rc, _ = runner.run("e2e-install", install, 180, env={"VLLM_DFLASH_BUILD_CUDA": "0"})
        if rc != 0:
            return result(FAILED, "pip install -e . failed: the plugin cannot be registered")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_pair_"))
    pair = [sys.executable, __file__, "write-pair", str(work), "--shape", args.e2e_shape]
    if args.e2e_target_layers:
        pair += ["--target-layers", str(args.e2e_target_layers)]
    rc, _ = runner.run("e2e-write-pair", pair, 300)
    if rc != 0:
        return result(*_status(rc, "writing the random pair"))
    outputs, logs = {}, {}
    with_drafter = ["--drafter", str(work / "drafter")]
    # The V1 runner (vllm-dflash's default) and Model Runner V2 (vLLM's default on GPUs).
    engines = (("plain", [], {}), ("dflash", with_drafter, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
               ("dflash-mrv2", with_drafter, {"VLLM_USE_V2_MODEL_RUNNER": "1"}))
    for name, drafter, runner_env in engines:
        out_json = runner.out_dir / f"e2e-{name}.json"
        cmd = [sys.executable, __file__, "generate", str(work / "target"), str(out_json),
               "--shape", args.e2e_shape, "--dtype", args.e2e_dtype, *drafter]
        if args.e2e_target_layers:
            cmd += ["--target-layers", str(args.e2e_target_layers)]
        # Fixed draft length: every step verifies K drafts, whatever the random drafter's
        # acceptance (the adaptive policy would switch drafting off).
        rc, logs[name] = runner.run(f"e2e-{name}", cmd, STEP_LIMITS_S["e2e"],
                                    env={"VLLM_DFLASH_DRAFT_LENGTH": "fixed", **runner_env})
        if rc != 0:
            return result(*_status(rc, f"the {name} engine"))
        outputs[name] = json.loads(out_json.read_text())
    if "implementation=vllm-dflash" not in logs["dflash"]:
        return result(FAILED, "the dflash engine did not log vllm-dflash's proposer")
    if "runner=Model Runner V2" not in logs["dflash-mrv2"]:
        return result(FAILED, "the MRV2 engine did not log vllm-dflash's speculator")
    failures = []
    for name in ("dflash", "dflash-mrv2"):
        for batch in E2E_BATCHES:
            key = f"batch_{batch}"
            for line in compare_outputs(outputs["plain"][key], outputs[name][key]):
                failures.append(f"{name}, batch {batch}: {line}")
    print("\n".join(["", f"spec decode counters (V1): {outputs['dflash']['spec_decode']}",
                     f"spec decode counters (MRV2): {outputs['dflash-mrv2']['spec_decode']}",
                     *failures]))
    if failures:
        return result(FAILED, f"{len(failures)} requests differ from no speculation")
    on_gpu = outputs["dflash"]["cuda_graphs"]
    captured = next((line for line in logs["dflash"].splitlines()
                     if "drafter CUDA graphs captured" in line), None)
    if on_gpu and captured is None:
        return result(FAILED, "greedy output equal, but the drafter ran without CUDA graphs")
    graphs = f"CUDA graphs on ({captured.split('vllm-dflash: ')[-1]})" if on_gpu else \
        "eager (no GPU)"
    scheduling = "async" if outputs["dflash"]["async_scheduling"] else "sync"
    return result(OK, f"greedy with DFlash == without, V1 runner and Model Runner V2, batch 1 "
                      f"and 16, {graphs}, {scheduling} scheduling")


STEPS: dict[str, Callable[[Runner, argparse.Namespace], Result]] = {
    "versions": step_versions, "build": step_build, "parity": step_parity,
    "bench": step_bench, "pytest": step_pytest, "e2e": step_e2e,
}


def check_all(args: argparse.Namespace) -> int:
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(out_dir, args.budget_s)
    steps = args.only.split(",") if args.only else list(STEPS)
    results = [STEPS[name](runner, args) for name in steps]
    print("\n== summary")
    for r in results:
        print(f"{r.step:9s} {r.status:8s} {r.seconds:6.0f} s  {r.detail}")
    (out_dir / "summary.json").write_text(json.dumps([r.__dict__ for r in results], indent=2))
    print(f"logs and results: {out_dir}")
    return 1 if any(r.status == FAILED for r in results) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="logs and results (default: a temp dir)")
    parser.add_argument("--budget-s", type=float, default=460,
                        help="wall-clock budget for all steps; steps past it fail")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {list(STEPS)}")
    parser.add_argument("--e2e-shape", choices=list(SHAPES), default="qwen3-8b")
    parser.add_argument("--e2e-target-layers", type=int, default=8,
                        help="target depth at --e2e-shape's widths (Qwen3-8B: 36; default 8 "
                             "keeps the run within the budget)")
    parser.add_argument("--e2e-dtype", default="float32",
                        help="engine dtype: float32 keeps greedy ties rare enough to compare "
                             "token for token (weights are stored in bfloat16)")
    parser.add_argument("--work-dir", default=None, help="where the e2e models are written")
    sub = parser.add_subparsers(dest="command")
    parity = sub.add_parser("parity", help="the kernel parity checks only")
    parity.add_argument("--device", default="cuda")
    pair = sub.add_parser("write-pair", help="write a random target/ and drafter/")
    pair.add_argument("dir", type=Path)
    gen = sub.add_parser("generate", help="greedy outputs of one engine, as JSON")
    gen.add_argument("target", type=Path)
    gen.add_argument("out_json", type=Path)
    gen.add_argument("--drafter", type=Path, default=None)
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--max-model-len", type=int, default=1024)
    for command in (pair, gen):
        command.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
        command.add_argument("--target-layers", type=int, default=None)
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(STEPS) if args.only else set()
    if unknown:
        parser.error(f"--only: unknown steps {sorted(unknown)}; steps: {list(STEPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "parity":
        return run_parity(torch.device(args.device))
    if args.command is None:
        return check_all(args)
    shape = with_depth(SHAPES[args.shape], args.target_layers)
    if args.command == "write-pair":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        write_target(args.dir / "target", shape, device, torch.bfloat16)
        write_drafter(args.dir / "drafter", shape, torch.bfloat16)
        return 0
    result = generate(args.target, args.drafter, shape, args.dtype, args.max_tokens,
                      args.max_model_len)
    args.out_json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
