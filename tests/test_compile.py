"""torch.compile mode (vLLM's default, no enforce_eager) on CPU: the drafter runs beside the
compiled target and greedy output still equals the compiled no-speculation output."""

from pathlib import Path

from tests.engines import MAX_MODEL_LEN, TRAINED, generate_ids

PROMPTS = ["def main():\n", "import os\n", "class Stack:\n    def push(self, item):\n"]


def compiled_llm(target: Path, **kwargs):
    from vllm import LLM

    return LLM(model=str(target), dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0,
               disable_log_stats=False, **kwargs)


def test_compiled_greedy_equals_no_speculation():
    pair = TRAINED
    plain = compiled_llm(pair.target)
    want = generate_ids(plain, PROMPTS, max_tokens=40)
    del plain
    spec = {"method": "dflash", "model": str(pair.drafter), "num_speculative_tokens": 7}
    dflash = compiled_llm(pair.target, speculative_config=spec)
    assert generate_ids(dflash, PROMPTS, max_tokens=40) == want
