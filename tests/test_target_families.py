"""Targets of other families than the trained pair's dense Qwen3 (whose lm_head is its
embedding, as in the small Qwen3 models: every other engine test runs that one). Each target is
built from the trained target, so that the trained drafter is accepted on it and a family whose
features, embedding or lm_head reached the drafter wrong would show in the acceptance length:
- qwen3_moe: every MLP as 4 identical experts, 2 routed per token with renormalised weights,
  which computes the dense MLP (up to rounding);
- llama and qwen2: Qwen3's RMS norm of each head's q and k (before RoPE) replaced by its mean
  scale on the held-out prompts, folded into q_proj and k_proj (Qwen2's q/k/v biases zero): a
  close relative of the trained target, not the same function;
- qwen3_vl: the trained decoder as Qwen3-VL's language model, with a random vision tower; on
  text its M-RoPE positions (time = height = width) are plain RoPE.
Per family: greedy output with speculation equals the output without, and the acceptance length
through vLLM is within 0.05 (test_vllm_e2e's tolerance) of this package's torch loop with the
same drafter on the same transformers model.

The engines run in a script of their own (this file): vLLM sets up a mixture-of-experts
model's expert-parallel group only in a process whose distributed state is still fresh. That
script sees a stub `torchvision` (written by the fixture): the CPU build runs without
torchvision, and transformers' Qwen2-VL image processor, which vLLM's Qwen3-VL imports, needs
the package to import; text prompts never call it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engines import TRAINED, Pair, heldout_ids, own_loop_acceptance

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen3_moe", "llama", "qwen2", "qwen3_vl")
K = 7
MAX_NEW_TOKENS = 40
TOLERANCE = 0.05
NUM_EXPERTS = 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# Enough of torchvision's names for transformers' image-processing modules to import.
TORCHVISION_STUB = {
    "__init__.py": '__version__ = "0.0"\n',
    "io/__init__.py": "ImageReadMode = decode_image = None\n",
    "transforms/__init__.py": (
        "import enum\n"
        "InterpolationMode = enum.Enum('InterpolationMode', ['NEAREST', 'NEAREST_EXACT', "
        "'BILINEAR', 'BICUBIC', 'BOX', 'HAMMING', 'LANCZOS'])\n"),
    "transforms/functional.py": "pil_to_tensor = None\n",
    "transforms/v2/__init__.py": "",
    "transforms/v2/functional.py": "",
}


def qk_norm_scales(model, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per q_norm and k_norm module: the mean RMS of each head's input over the prompts."""
    squares: dict[str, list[torch.Tensor]] = {}

    def record(name: str):
        def hook(module, inputs, output):  # inputs[0]: [batch, seq, heads, head_dim]
            x = inputs[0].float()
            rms = (x.pow(2).mean(-1) + module.variance_epsilon).sqrt()
            squares.setdefault(name, []).append(rms.reshape(-1, x.shape[-2]))
        return hook

    hooks = [module.register_forward_hook(record(name)) for name, module in model.named_modules()
             if name.endswith(("q_norm", "k_norm"))]
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return {name: torch.cat(values).mean(0) for name, values in squares.items()}


def without_qk_norm(model, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """The model's weights with each q_norm/k_norm folded into its projection as a constant
    scale: weight / mean RMS, per head and channel."""
    head_dim = model.config.head_dim
    scales = qk_norm_scales(model, prompts)
    state = {name: value.clone() for name, value in model.state_dict().items()
             if not name.endswith(("q_norm.weight", "k_norm.weight"))}
    for name, rms in scales.items():
        norm_weight = model.get_submodule(name).weight.detach()
        proj = name.replace("q_norm", "q_proj").replace("k_norm", "k_proj") + ".weight"
        weight = state[proj].reshape(len(rms), head_dim, -1)
        state[proj] = (weight * (norm_weight[None, :, None] / rms[:, None, None])).flatten(0, 1)
    return state


def as_experts(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Dense MLP weights as NUM_EXPERTS identical experts with a random router."""
    g = torch.Generator().manual_seed(0)
    state = dict(state)
    for layer in range(num_layers):
        mlp = f"model.layers.{layer}.mlp"
        gate, up, down = (state.pop(f"{mlp}.{p}.weight") for p in ("gate_proj", "up_proj",
                                                                      "down_proj"))
        state[f"{mlp}.experts.gate_up_proj"] = torch.cat([gate, up]).expand(NUM_EXPERTS, -1, -1)
        state[f"{mlp}.experts.down_proj"] = down.expand(NUM_EXPERTS, -1, -1)
        state[f"{mlp}.gate.weight"] = torch.randn(NUM_EXPERTS, gate.shape[1], generator=g)
    return state


def family_model(family: str, trained, prompts: list[list[int]]):
    """The transformers model of `family` built from the trained target (see the module doc)."""
    import transformers

    c = trained.config
    shape = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
             "num_attention_heads": c.num_attention_heads, "head_dim": c.head_dim,
             "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps,
             "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": True,
             "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
             "pad_token_id": c.pad_token_id, "rope_parameters": c.rope_parameters}
    state = {name: value.clone() for name, value in trained.state_dict().items()}
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **shape, num_experts=NUM_EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
            moe_intermediate_size=c.intermediate_size, decoder_sparse_step=1)
        model = transformers.Qwen3MoeForCausalLM(config)
        state = as_experts(state, c.num_hidden_layers)
    elif family in ("llama", "qwen2"):
        state = without_qk_norm(trained, prompts)
        if family == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
            state |= {name.replace("weight", "bias"): torch.zeros(len(value))
                      for name, value in state.items() if name.endswith(
                          ("q_proj.weight", "k_proj.weight", "v_proj.weight"))}
    else:
        # Qwen3-VL's image and video tokens above the text vocabulary: their (zero) embedding
        # rows give logit 0, below the trained target's top logit on these prompts.
        vocab = c.vocab_size
        rope = c.rope_parameters | {"mrope_section": [16, 8, 8], "mrope_interleaved": True}
        text = shape | {"vocab_size": vocab + 4, "rope_parameters": rope}
        vision = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                  "out_hidden_size": c.hidden_size, "deepstack_visual_indexes": [0],
                  "num_position_embeddings": 64}
        config = transformers.Qwen3VLConfig(
            text_config=text, vision_config=vision, image_token_id=vocab,
            video_token_id=vocab + 1, vision_start_token_id=vocab + 2,
            vision_end_token_id=vocab + 3, tie_word_embeddings=True,
            eos_token_id=c.eos_token_id)
        model = transformers.Qwen3VLForConditionalGeneration(config)
        embed = torch.cat([state.pop("model.embed_tokens.weight"), torch.zeros(4, c.hidden_size)])
        state = {name.replace("model.", "model.language_model.", 1): value
                 for name, value in state.items() if name != "lm_head.weight"}
        state |= {"model.language_model.embed_tokens.weight": embed, "lm_head.weight": embed}
        state |= {name: value for name, value in model.state_dict().items()
                  if name.startswith("model.visual.")}
    model.load_state_dict(state, strict=True)
    return model.eval()


def family_pair(root: Path, family: str) -> Pair:
    return Pair(target=root / family, drafter=root / f"{family}_drafter",
                block_size=TRAINED.block_size)


def write_family(root: Path, family: str) -> Pair:
    """The family's target from the trained one (safetensors and tokenizer), and the trained
    drafter with the target's vocabulary size in its config (Qwen3-VL's is 4 larger)."""
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(TRAINED.target, dtype=torch.float32).eval()
    pair = family_pair(root, family)
    model = family_model(family, trained, heldout_ids())
    model.save_pretrained(pair.target)
    for name in TOKENIZER_FILES:
        shutil.copy(TRAINED.target / name, pair.target / name)
    shutil.copytree(TRAINED.drafter, pair.drafter)
    config = json.loads((pair.drafter / "config.json").read_text())
    config["vocab_size"] = model.get_output_embeddings().weight.shape[0]
    (pair.drafter / "config.json").write_text(json.dumps(config, indent=2))
    return pair


def run_engines(root: Path) -> dict:
    """Script entry: per family, the greedy outputs without and with speculation, and the
    acceptance length of the latter."""
    from tests.engines import acceptance_of, dflash_llm, generate_ids, heldout_prompts, plain_llm

    text_only = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
    prompts = heldout_prompts()
    result = {}
    for family in FAMILIES:
        pair = write_family(root, family)
        engine = text_only if family == "qwen3_vl" else {}
        llm = plain_llm(pair.target, **engine)
        plain = generate_ids(llm, prompts, max_tokens=MAX_NEW_TOKENS)
        del llm
        llm = dflash_llm(pair, K, **engine)
        dflash, acceptance = acceptance_of(
            llm, lambda llm=llm: generate_ids(llm, prompts, max_tokens=MAX_NEW_TOKENS))
        del llm
        result[family] = {"plain": plain, "dflash": dflash, "acceptance": acceptance}
    return result


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("families")
    for name, text in TORCHVISION_STUB.items():
        path = root / "stub" / "torchvision" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    paths = [str(REPO), str(root / "stub"), os.environ.get("PYTHONPATH")]
    proc = subprocess.run([sys.executable, __file__, str(root)],
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths))),
                          cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    out = root / "result.json"
    assert proc.returncode == 0 and out.exists(), proc.stdout[-5000:] + proc.stderr[-5000:]
    return root, json.loads(out.read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_no_speculation(outputs, family):
    _, result = outputs
    assert result[family]["dflash"] == result[family]["plain"]


@pytest.mark.parametrize("family", FAMILIES)
def test_acceptance_equals_the_torch_loop(outputs, family):
    root, result = outputs
    reference = own_loop_acceptance(family_pair(root, family), heldout_ids(), MAX_NEW_TOKENS, K)
    assert reference > 3  # the premise: the trained drafter fits the family's target
    assert abs(result[family]["acceptance"] - reference) <= TOLERANCE, (
        result[family]["acceptance"], reference)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    (root / "result.json").write_text(json.dumps(run_engines(root)))
