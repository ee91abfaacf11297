"""The CUDA path's Python and Triton code inside a real vLLM engine, on CPU.

On a GPU the proposer runs the Triton draft attention, KV injection, RMSNorm and RoPE, vLLM's
rejection sampler runs the Triton verification walk, and the draft step replays from
DraftGraphs. Here
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported, so in a subprocess)
runs those kernels on CPU tensors, fed by vLLM's own block tables, slot mappings, KV cache
pages and sampling metadata, and DraftGraphs runs its static buffers and padding eagerly. What
only a GPU checks is the compiled code and the capture itself (scripts/gpu_check.sh).
"""

import json
import os
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_NEW_TOKENS = 32
# Sampled requests accept few drafts, so each token is an interpreted step: fewer, shorter ones.
NUM_SAMPLED, SAMPLED_TOKENS = 4, 16
# Prompts also run alone, the one-token prompt among them (interpreted steps are slow).
NUM_ALONE = 3
MAX_NUM_SEQS = 8  # DraftGraphs pads every step up to a captured size; keep the largest small


class KernelRoutes:
    """Switches the proposer's and the verifier's kernels: "triton" dispatches as on CUDA (the
    Triton kernels, counted), "cpu" as on CPU, "reference" drafts with Triton and walks with
    the torch reference."""

    def __init__(self) -> None:
        from vllm_dflash import model
        from vllm_dflash.kernels import draft_attention, kv_injection, norm_rope, verify
        from vllm_dflash.vllm import drafting

        self.calls: Counter = Counter()
        self.drafting, self.model, self.verify = drafting, model, verify
        self.cpu = (drafting.draft_attention, drafting.kv_injection, verify._walk_for)
        walk = self._counted("verify", verify.rejection_walk_triton)
        self.triton = (self._counted("draft_attention", draft_attention.draft_attention_triton),
                       self._counted("kv_injection", kv_injection.kv_injection_triton),
                       lambda device: walk)
        self.cpu_norm_rope = (model.rms_norm, model.rotate)
        self.triton_norm_rope = (self._counted("rms_norm", norm_rope.rms_norm_triton),
                                 self._counted("rotate", norm_rope.rotate_triton))

    def _counted(self, name: str, fn):
        def run(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return run

    def use(self, route: str, norm_rope: bool = False) -> None:
        """norm_rope: the drafter's RMSNorm and RoPE in Triton too (slow when interpreted:
        one program per row)."""
        attend, inject, walk_for = self.cpu if route == "cpu" else self.triton
        if route == "reference":
            walk_for = lambda device: self.verify.rejection_walk_reference
        self.drafting.draft_attention, self.drafting.kv_injection = attend, inject
        self.model.rms_norm, self.model.rotate = (self.triton_norm_rope if norm_rope
                                                  else self.cpu_norm_rope)
        self.verify._walk_for = walk_for


def _eager_draft_graphs(worker) -> list[int]:
    """In the engine's worker: DraftGraphs for the drafter, run eagerly, each step's greedy
    tokens compared with the plain drafter pass's; returns the graphs' batch sizes."""
    drafter = worker.model_runner.drafter.draft_runner
    drafter.capture_draft_graphs(use_cuda_graph=False)
    graphs = drafter.draft_graphs
    run = graphs.run
    graphs.stats = Counter()

    def compared_run(anchors, batch):
        hidden = run(anchors, batch)
        tokens, _ = drafter.choose_tokens(hidden, anchors)
        expected, _ = drafter.choose_tokens(drafter.draft_hidden(anchors, batch), anchors)
        graphs.stats["padded_steps"] += anchors.shape[0] not in graphs.sizes
        graphs.stats["tokens"] += expected.numel()
        graphs.stats["different"] += int((tokens != expected).sum())
        return hidden

    graphs.run = compared_run
    return graphs.sizes


def _draft_graph_stats(worker) -> Counter:
    return worker.model_runner.drafter.draft_runner.draft_graphs.stats


def run_checks(result_path: str) -> None:
    """Script entry (TRITON_INTERPRET=1 set by the caller): each check's "ok" or traceback."""
    from tests.engines import (
        TRAINED,
        dflash_llm,
        generate_ids,
        heldout_prompts,
        plain_llm,
        spec_metrics,
    )

    routes = KernelRoutes()
    pair = TRAINED
    prompts = heldout_prompts(6)
    prompts.append({"prompt_token_ids": prompts[0]["prompt_token_ids"][:1]})  # one token
    greedy = {"max_tokens": MAX_NEW_TOKENS, "ignore_eos": True}

    baseline = plain_llm(pair.target, max_num_seqs=MAX_NUM_SEQS)
    want = generate_ids(baseline, prompts, **greedy)
    del baseline
    llm = dflash_llm(pair, pair.block_size - 1, max_num_seqs=MAX_NUM_SEQS)

    def greedy_together_and_alone() -> None:
        assert generate_ids(llm, prompts, **greedy) == want
        for prompt, expected in list(zip(prompts, want))[-NUM_ALONE:]:
            assert generate_ids(llm, [prompt], **greedy) == [expected]

    def accepted_greedy() -> int:
        """Runs greedy_together_and_alone; the draft tokens accepted meanwhile."""
        before = spec_metrics(llm)["accepted"]
        greedy_together_and_alone()
        return spec_metrics(llm)["accepted"] - before

    def greedy_triton() -> None:
        # Triton first, while the prefix cache is cold: it injects every prompt token.
        routes.use("triton", norm_rope=True)
        accepted = accepted_greedy()
        for kernel in ("draft_attention", "kv_injection", "verify", "rms_norm", "rotate"):
            assert routes.calls[kernel] > 0, routes.calls
        routes.use("cpu")
        accepted_cpu = accepted_greedy()
        routes.use("triton")
        print(f"accepted draft tokens: triton {accepted}, cpu kernels {accepted_cpu}")
        # Lossless either way: wrong drafts (attention, injected context) show as lower
        # acceptance. Rounding may flip a near-tie draft.
        assert accepted > 0 and abs(accepted - accepted_cpu) <= 0.01 * accepted_cpu

    def greedy_draft_graphs() -> None:
        sizes = llm.collective_rpc(_eager_draft_graphs)[0]
        assert sizes[-1] == MAX_NUM_SEQS, sizes
        greedy_together_and_alone()
        stats = llm.collective_rpc(_draft_graph_stats)[0]
        print("draft graphs:", dict(stats))
        assert stats["padded_steps"] > 0, stats  # batches of 1..7 requests ran padded
        # The padded batch runs the GEMMs at another M; the CPU BLAS may round a near-tie
        # differently, but the tokens are the plain step's.
        assert stats["different"] <= 0.01 * stats["tokens"], stats

    def seeded_sampling_walks_agree() -> None:
        # Same drafts (Triton attention either way), same random numbers: the Triton walk and
        # the torch reference accept and recover the same tokens.
        from vllm import SamplingParams

        sampled = prompts[-NUM_SAMPLED:]  # the one-token prompt among them
        params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed,
                                 max_tokens=SAMPLED_TOKENS, ignore_eos=True)
                  for seed in range(len(sampled))]
        outputs = {}
        for walk in ("triton", "reference", "triton"):
            routes.use(walk)
            results = llm.generate(sampled, params, use_tqdm=False)
            outputs.setdefault(walk, []).append([list(r.outputs[0].token_ids) for r in results])
        routes.use("triton")
        first, again = outputs["triton"]
        assert first == again, "seeded sampling is not reproducible"
        assert first == outputs["reference"][0], "Triton walk != torch reference walk"
        greedy_start = [tokens[:SAMPLED_TOKENS] for tokens in want[-NUM_SAMPLED:]]
        assert first != greedy_start, "sampling returned the greedy output"

    results = {}
    for check in (greedy_triton, greedy_draft_graphs, seeded_sampling_walks_agree):
        try:
            check()
            results[check.__name__] = "ok"
        except Exception:  # noqa: BLE001 (any failure is this check's result)
            results[check.__name__] = traceback.format_exc()
    Path(result_path).write_text(json.dumps(results))


CHECKS = ("greedy_triton", "greedy_draft_graphs", "seeded_sampling_walks_agree")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    result_path = tmp_path_factory.mktemp("triton_engine") / "results.json"
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath)
    proc = subprocess.run([sys.executable, __file__, str(result_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0 and result_path.exists(), proc.stdout[-5000:] + proc.stderr[-5000:]
    return json.loads(result_path.read_text())


@pytest.mark.parametrize("check", CHECKS)
def test_cuda_path_in_engine_interpreted(check: str, results: dict[str, str]) -> None:
    assert results[check] == "ok", results[check]


if __name__ == "__main__":
    run_checks(sys.argv[1])
