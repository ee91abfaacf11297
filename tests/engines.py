"""Shared helpers for tests that run real vLLM engines on the CPU build."""

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# In-process, single-threaded engines start in seconds; must be set before vLLM reads them.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines draft the full K every step, so that verification runs on every step whatever the
# (random) drafter's acceptance; the adaptive policy has its own tests (test_draft_policy*.py).
os.environ.setdefault("VLLM_DFLASH_DRAFT_LENGTH", "fixed")

MAX_MODEL_LEN = 512
SUBPROCESS_TIMEOUT_S = 600


class LogLines(logging.Handler):
    """Collects log messages; attach it after `import vllm.logger`, whose set-up resets the
    handlers of vLLM's child loggers."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass
class Pair:
    target: Path
    drafter: Path
    block_size: int


TRAINED_DIR = Path(__file__).parent / "fixtures" / "pair"
# The committed pair built by examples/build_tiny_pair.py: its drafts are really accepted.
TRAINED = Pair(target=TRAINED_DIR / "target", drafter=TRAINED_DIR / "drafter", block_size=8)
# A DFlash2 drafter for the same target, trained on the same data (pair.json: drafter_dflash2).
TRAINED_DFLASH2 = Pair(target=TRAINED_DIR / "target",
                       drafter=TRAINED_DIR / "drafter-dflash2", block_size=8)
TRAINED_LILICORR = Pair(target=TRAINED_DIR / "target",
                        drafter=TRAINED_DIR / "drafter-lilicorr", block_size=8)


def heldout_texts(count: int | None = None) -> list[str]:
    """The trained pair's held-out prompts (Python source the target never trained on)."""
    import json

    lines = (TRAINED_DIR / "heldout_prompts.jsonl").read_text().splitlines()[:count]
    return [json.loads(line)["prompt"] for line in lines]


def heldout_ids(count: int | None = None) -> list[list[int]]:
    """heldout_texts as token ids of the trained target's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TRAINED.target)
    return [tokenizer(text)["input_ids"] for text in heldout_texts(count)]


def heldout_prompts(count: int | None = None) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in heldout_ids(count)]


def make_pair(root: Path, block_size: int = 8, num_layers: int = 2, seed: int = 0) -> Pair:
    """A random-weight Qwen3 target (4 layers, head_dim 64) and a matching random drafter."""
    from vllm_dflash.tiny import write_random_drafter, write_random_target

    target = write_random_target(root / "target", seed=seed)
    write_random_drafter(root / "drafter", target, block_size=block_size, num_layers=num_layers)
    return Pair(target=target, drafter=root / "drafter", block_size=block_size)


def _llm(model: Path, **kwargs):
    from vllm import LLM

    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("dtype", "float32")
    return LLM(model=str(model), enforce_eager=True, seed=0, disable_log_stats=False, **kwargs)


def plain_llm(target: Path, **kwargs):
    return _llm(target, **kwargs)


def dflash_llm(pair: Pair, num_speculative_tokens: int, speculative: dict | None = None,
               **kwargs):
    """An engine with method "dflash"; speculative: more --speculative-config keys."""
    spec = {"method": "dflash", "model": str(pair.drafter),
            "num_speculative_tokens": num_speculative_tokens, **(speculative or {})}
    return _llm(pair.target, speculative_config=spec, **kwargs)


def prompts_of_lengths(target: Path, lengths: tuple[int, ...], seed: int = 0) -> list[dict]:
    """Token-id prompts (no special tokens) of the given lengths."""
    import torch
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(target / "tokenizer.json")).get_vocab_size()
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(2, vocab, (n,), generator=g).tolist()}
        for n in lengths
    ]


def two_rank_cores() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for two ranks of vLLM's CPU build: a core each where there are
    two."""
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}|{cores[1 % len(cores)]}"


def speculative_config_stub(model: str, num_speculative_tokens: int, revision=None):
    """The fields of vLLM's SpeculativeConfig that validate_speculative_config reads, at
    vLLM's defaults, for checks without an engine."""
    from types import SimpleNamespace

    draft = SimpleNamespace(model=model, revision=revision, quantization=None)
    return SimpleNamespace(draft_model_config=draft, num_speculative_tokens=num_speculative_tokens,
                           draft_sample_method="greedy", rejection_sample_method="standard",
                           kv_cache_dtype=None, disable_padded_drafter_batch=False)


def seeded_and_greedy_twice(llm, prompts: list, max_tokens: int) -> list[list[list[int]]]:
    """The token ids of two identical generates of prompts: every other request samples at
    T = 1 with its index as seed, the rest are greedy."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i) if i % 2 else
              SamplingParams(max_tokens=max_tokens, temperature=0.0)
              for i in range(len(prompts))]
    return [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            for _ in range(2)]


def alone_batched_structured(llm, prompts: list[dict], max_tokens: int,
                             alone: int | None = None) -> dict[str, list[list[int]]]:
    """Greedy output of the first `alone` prompts one at a time (all by default), of all at
    once, and of all at once with every other request held to a grammar (printable ASCII:
    drafts pass it, and vLLM checks each against it)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    single = [generate_ids(llm, [p], max_tokens=max_tokens, ignore_eos=True)[0]
              for p in prompts[:alone]]
    batch = generate_ids(llm, prompts, max_tokens=max_tokens, ignore_eos=True)
    printable = StructuredOutputsParams(regex=r"[ -~\n]*")
    mixed = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=printable if i % 2 == 0 else None)
             for i in range(len(prompts))]
    structured = [list(o.outputs[0].token_ids)
                  for o in llm.generate(prompts, mixed, use_tqdm=False)]
    return {"alone": single, "batch": batch, "structured": structured}


def keep_cpu_async_scheduling() -> Callable[[], None]:
    """Keeps async_scheduling=True on vLLM's CPU platform for engines that ask for it (its
    set-up turns it off); returns the function that undoes this."""
    from vllm.platforms.cpu import CpuPlatform

    cpu_set_up = CpuPlatform.__dict__["check_and_update_config"]

    def keep_async_scheduling(cls, vllm_config) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        cpu_set_up.__func__(cls, vllm_config)
        if asked:
            vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(keep_async_scheduling)

    def undo() -> None:
        CpuPlatform.check_and_update_config = cpu_set_up

    return undo


def plain_run(target: Path, run: Callable, **engine):
    """run(llm) on an engine without speculation (engine: LLM arguments); the engine is freed
    before this returns."""
    llm = plain_llm(target, **engine)
    result = run(llm)
    del llm
    return result


def greedy_baseline(target: Path, prompts: list, max_tokens: int, **engine) -> list:
    """Greedy token ids of prompts (to max_tokens, past EOS) from an engine without
    speculation (engine: LLM arguments), then freed."""
    return plain_run(target, lambda llm: generate_ids(llm, prompts, max_tokens=max_tokens,
                                                      ignore_eos=True), **engine)


def assert_lossless_and_reproducible(llm, prompts: list, baseline: list, max_tokens: int,
                                     num_speculative_tokens: int) -> None:
    """Greedy output equals the baseline alone and batched, seeded sampling repeats itself,
    unseeded T = 1 requests run to max_tokens, and every verification had K drafts."""
    from vllm import SamplingParams

    alone = [generate_ids(llm, [p], max_tokens=max_tokens, ignore_eos=True)[0] for p in prompts]
    assert alone == baseline
    assert generate_ids(llm, prompts, max_tokens=max_tokens, ignore_eos=True) == baseline
    first, second = seeded_and_greedy_twice(llm, prompts, max_tokens=24)
    assert first == second
    unseeded = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24,
                                                    ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in unseeded] == [24] * len(prompts)
    metrics = spec_metrics(llm)
    assert metrics["drafts"] > 0
    assert metrics["draft_tokens"] == num_speculative_tokens * metrics["drafts"]


def generate_ids(llm, prompts: list, **params) -> list[list[int]]:
    from vllm import SamplingParams

    params.setdefault("temperature", 0.0)
    outputs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_metrics(llm) -> dict:
    """vLLM's own spec-decode counters, as Prometheus exports them."""
    values: dict = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            values[name] = metric.value
        elif name == "num_accepted_tokens_per_pos":
            values["accepted_per_pos"] = list(metric.values)
    return {
        "drafts": values.get("num_drafts", 0),
        "draft_tokens": values.get("num_draft_tokens", 0),
        "accepted": values.get("num_accepted_tokens", 0),
        "accepted_per_pos": values.get("accepted_per_pos", []),
    }


def write_random_lora(target: Path, out: Path, rank: int = 8, seed: int = 0,
                      std: float = 0.1) -> Path:
    """A PEFT LoRA adapter of random weights (A and B of standard deviation std) on the
    target's attention and MLP projections. On the trained pair std 0.1 changes some outputs
    and keeps the drafter accepted (4.7 and 5.8 tokens per block for seeds 0 and 1); 0.2
    changes more and leaves it at 1.4 and 2.1."""
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    shapes = {  # module -> (in, out)
        "q_proj": (hidden, config["num_attention_heads"] * head_dim),
        "v_proj": (hidden, config["num_key_value_heads"] * head_dim),
        "down_proj": (config["intermediate_size"], hidden),
    }
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            part = "mlp" if module == "down_proj" else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            weights[f"{prefix}.lora_A.weight"] = std * torch.randn(rank, fan_in, generator=g)
            weights[f"{prefix}.lora_B.weight"] = std * torch.randn(fan_out, rank, generator=g)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(shapes), "bias": "none", "base_model_name_or_path": str(target),
    }))
    return out


def two_random_loras(target: Path, root: Path) -> list[Path]:
    """Two adapters for LoRA tests; the second twice as strong, so that they differ on more
    prompts."""
    return [write_random_lora(target, root / str(i), seed=i, std=std)
            for i, std in enumerate((0.1, 0.2))]


def merge_lora(target: Path, adapter: Path, out: Path) -> Path:
    """The target with a write_random_lora adapter merged into its weights (W + alpha/r B A),
    and its tokenizer: what the adapter's requests run, as one model."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    weights = load_file(str(target / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for name, a in lora.items():
        if name.endswith("lora_A.weight"):
            b = lora[name.replace("lora_A", "lora_B")]
            base = name.removeprefix("base_model.model.").replace(".lora_A", "")
            merged = weights[base].float() + scale * (b.float() @ a.float())
            weights[base] = merged.to(weights[base].dtype)
    out.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, out / item.name)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def error_chain(err: BaseException | None) -> str:
    """The message and every cause in the chain (vLLM may wrap start-up errors)."""
    texts = []
    while err is not None:
        texts.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return "\n".join(texts)


def run_python(code: str, *args: str, **env: str) -> list[dict]:
    """Run code in a fresh interpreter; return the JSON objects it printed after 'RESULT '."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], check=False, env=full_env, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S, cwd=Path(__file__).parent.parent,
    )
    results = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert results, f"rc={done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return results


def budgets_of(max_new_tokens: int | list[int], count: int) -> list[int]:
    """One output budget per prompt: given per prompt, or one for all."""
    return max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * count


def counted_as_vllm(per_prompt: list[list[int]], max_new_tokens: int | list[int]) -> float:
    """Mean tokens per block as vLLM counts them: every verified block whole (vLLM truncates to
    max_tokens after counting), one block per step that starts before max_tokens output
    tokens (one budget for all prompts, or one per prompt)."""
    counted = []
    for lengths, budget in zip(per_prompt, budgets_of(max_new_tokens, len(per_prompt)),
                               strict=True):
        num_output = 1  # the token sampled at prefill
        for produced in lengths:
            if num_output >= budget:
                break
            counted.append(produced)
            num_output += produced
    return sum(counted) / len(counted)


def hf_target(path: Path):
    """The target as transformers runs it in fp32: a causal LM, or the text path of a
    vision-language model (which transformers does not list as a causal LM)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(path), "vision_config")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def own_loop_acceptance(pair: Pair, prompt_ids: list[list[int]],
                        max_new_tokens: int | list[int], num_speculative_tokens: int) -> float:
    """Mean acceptance length of this package's pure-torch loop (train/evaluate.py) with blocks
    of num_speculative_tokens + 1, as vLLM drafts them, counted as vLLM counts (budgets: one
    for all prompts or one per prompt)."""
    from dataclasses import replace

    import torch

    from vllm_dflash.checkpoint import load_drafter
    from vllm_dflash.train.evaluate import speculative_greedy

    target = hf_target(pair.target)
    drafter = load_drafter(pair.drafter, torch.float32).eval()
    drafter.cfg = replace(drafter.cfg, block_size=num_speculative_tokens + 1)
    budgets = budgets_of(max_new_tokens, len(prompt_ids))
    with torch.no_grad():
        per_prompt = [speculative_greedy(drafter, target, ids, budget + pair.block_size)[1]
                      for ids, budget in zip(prompt_ids, budgets, strict=True)]
    return counted_as_vllm(per_prompt, budgets)


def acceptance_of(llm, run: Callable):
    """run() on llm, and the mean acceptance length of the drafts it verified (from vLLM's
    counters before and after: the engine must be the one built last)."""
    from vllm_dflash.bench.counters import from_llm_metrics

    before = from_llm_metrics(llm.get_metrics())
    result = run()
    counters = from_llm_metrics(llm.get_metrics()).minus(before)
    assert counters.drafts > 0, "no drafts were verified"
    return result, 1 + counters.accepted / counters.drafts


def engine_counter(llm, name: str) -> float:
    """A vLLM counter's value (e.g. "vllm:num_preemptions"), from the engine built last."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def reference_acceptance(pair: Pair, prompt_ids: list[list[int]], max_new_tokens: int) -> float:
    """Mean acceptance length of dflash==0.1.0's own generate loop, on the same prompts, or for
    a LiLiCorr drafter (which it does not have) of this package's pure-torch loop
    (train/evaluate.py). A budget one block longer, so that no block vLLM verifies is cut
    short here."""
    import time

    import torch

    from vllm_dflash.checkpoint import load_config

    budget = max_new_tokens + pair.block_size
    target = hf_target(pair.target)
    architecture = load_config(pair.drafter).architecture
    if architecture == "LiLiCorrDraftModel":
        from vllm_dflash.checkpoint import load_drafter
        from vllm_dflash.train.evaluate import speculative_greedy

        drafter = load_drafter(pair.drafter, torch.float32).eval()
        with torch.no_grad():
            return counted_as_vllm([speculative_greedy(drafter, target, ids, budget)[1]
                                    for ids in prompt_ids], max_new_tokens)
    import dflash.model as ref

    drafter = getattr(ref, architecture).from_pretrained(pair.drafter, dtype=torch.float32)
    # return_stats=True times with torch.cuda.synchronize(); on CPU a plain clock does.
    ref._cuda_time = time.perf_counter
    return counted_as_vllm([
        ref.dflash_generate(drafter.eval(), target, torch.tensor([ids]), budget, None,
                            block_size=pair.block_size, return_stats=True).acceptance_lengths
        for ids in prompt_ids], max_new_tokens)


def count_calls(owner, name: str, counts, key: str, amount=None) -> None:
    """Replaces owner.<name> with a wrapper that adds 1 (or amount(*args) of the call) to
    counts.<key> per call (an engine's worker objects, read back later through
    collective_rpc)."""
    method = getattr(owner, name)
    setattr(counts, key, 0)

    def counting(*args, **kwargs):
        setattr(counts, key, getattr(counts, key) + (1 if amount is None else amount(*args)))
        return method(*args, **kwargs)

    setattr(owner, name, counting)
