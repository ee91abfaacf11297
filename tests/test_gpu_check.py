"""The GPU check's CPU-testable parts: benchmarks/kernels.py's rows at tiny shapes, and the
helpers of scripts/gpu_check.py (kernel parity, model writing, output comparison). No vLLM."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_dflash.kernels.inputs import verify_batch

REPO = Path(__file__).resolve().parents[1]
TINY_BENCH = ["--batches", "3", "--repeats", "2", "--warmup", "1", "--hidden", "64",
              "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
              "--intermediate", "128", "--features", "2", "--context", "40", "--vocab", "300"]
# The c++ rows: the compiled CPU kernels, which the README's install builds.
CPU_ROWS = {("kv_injection", "reference"), ("kv_injection", "torch"), ("kv_injection", "c++"),
            ("draft_attention", "reference"), ("draft_attention", "torch"),
            ("draft_attention", "c++"), ("verify_greedy", "reference"),
            ("verify_sampled", "reference"), ("drafter_step", "torch"), ("drafter_step", "c++")}


def _run_bench(*args: str) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "kernels.py"), "--device", "cpu", *args],
        # One thread: two spinning threads on a busy 2-core machine take seconds per row.
        env={**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True,
        timeout=120, check=False)


@pytest.fixture(scope="module")
def gpu_check():
    """scripts/gpu_check.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("drafter", [[], ["--dflash2", "2,16,8,4"], ["--lilicorr", "4,1,2,8"]],
                         ids=["dflash", "dflash2", "lilicorr"])
def test_kernels_benchmark_rows_on_cpu(drafter: list[str], tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = _run_bench(*TINY_BENCH, *drafter, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["what"], r["path"]) for r in rows} == CPU_ROWS
    assert len(rows) == len(CPU_ROWS)
    printed = [line.split()[:2] for line in proc.stdout.splitlines()[1:]]
    assert sorted(map(tuple, printed)) == sorted(CPU_ROWS)
    for row in rows:
        assert row["batch"] == 3 and row["tokens"] > 0
        assert math.isfinite(row["ms_per_step"]) and row["ms_per_step"] > 0, row
    for row in rows:
        if row["what"] == "draft_attention":
            assert row["ms_per_step"] == pytest.approx(2 * row["ms_per_layer"])


def test_kernels_benchmark_cuda_graph_needs_cuda() -> None:
    proc = _run_bench("--cuda-graph", *TINY_BENCH)
    assert proc.returncode == 2 and "--cuda-graph needs a CUDA device" in proc.stderr


def test_kernels_benchmark_dflash2_takes_four_numbers() -> None:
    proc = _run_bench("--dflash2", "2,16", *TINY_BENCH)
    assert proc.returncode == 2 and "argument --dflash2: takes 4 integers" in proc.stderr


def test_parity_checks_pass_on_cpu(gpu_check) -> None:
    cpu = torch.device("cpu")
    assert gpu_check.parity_draft_attention(cpu, batches=(([0, 21], [3, 8]), ([40], [8])),
                                            head_shapes=((4, 2, 32),)) == []
    assert gpu_check.parity_kv_injection(cpu, shapes=((9, 40, 3, 3, 64),)) == []
    assert gpu_check.parity_verify(cpu, vocabs=(300,)) == []
    assert gpu_check.parity_norm_rope(cpu) == []


def test_parity_reports_a_mismatch(gpu_check) -> None:
    want = torch.zeros(4)
    tol = gpu_check.TOLERANCES[torch.float32]
    assert gpu_check._mismatch("case", want.clone(), want, tol) is None
    message = gpu_check._mismatch("case", want + 0.5, want, tol)
    assert message.startswith("case: max abs error 0.5")


def test_greedy_walk_oracle(gpu_check) -> None:
    inputs = verify_batch(batch=6, max_spec_len=4, vocab=50)
    inputs["draft_token_ids"] = inputs["target_probs"].argmax(dim=-1)  # every draft accepted
    out = gpu_check.greedy_walk(inputs)
    ends = inputs["cu_num_draft_tokens"].tolist()
    for r, end in enumerate(ends):
        count = end - (ends[r - 1] if r else 0)
        assert out[r, count] == inputs["bonus_token_ids"][r]  # the bonus after all drafts
        assert (out[r, count + 1:] == -1).all()


def test_tiny_pair_is_a_valid_target_and_drafter(gpu_check, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from vllm_dflash.checkpoint import load_drafter
    from vllm_dflash.config import validate_against_target

    shape = gpu_check.with_depth(gpu_check.SHAPES["tiny"], 3)
    target = gpu_check.write_target(tmp_path / "target", shape, torch.device("cpu"),
                                    torch.bfloat16)
    cfg = gpu_check.write_drafter(tmp_path / "drafter", shape, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.num_hidden_layers == 3 and model.config.vocab_size == shape.vocab
    drafter = load_drafter(tmp_path / "drafter")
    assert drafter.fc.weight.dtype == torch.bfloat16
    validate_against_target(cfg, target_hidden_size=model.config.hidden_size,
                            target_num_layers=3, target_vocab_size=model.config.vocab_size,
                            num_speculative_tokens=shape.draft_block - 1,
                            fc_in_features=drafter.fc.in_features)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == shape.vocab
    assert tokenizer.token_to_id("<|mask|>") == cfg.mask_token_id
    prompts = gpu_check.make_prompts(shape.vocab, 16)
    ids = [i for p in prompts for i in p["prompt_token_ids"]]
    assert len(prompts) == 16 and 2 <= min(ids) and max(ids) < shape.vocab
    assert tokenizer.encode(tokenizer.decode(ids[:20])).ids == ids[:20]


def test_compare_outputs(gpu_check) -> None:
    base = [[5, 6, 7, 8], [1, 2]]
    assert gpu_check.compare_outputs(base, [[5, 6, 7, 8], [1, 2]]) == []
    lines = gpu_check.compare_outputs(base, [[5, 6, 9, 8], [1, 2, 3]])
    assert len(lines) == 2
    assert lines[0].startswith("request 0: first difference at token 2 ([7, 8] expected, [9, 8]")
    assert lines[1].startswith("request 1: first difference at token 2 ([] expected, [3]")
    assert gpu_check.compare_outputs(base, base[:1]) == ["1 outputs, expected 2"]
