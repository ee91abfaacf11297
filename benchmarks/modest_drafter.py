"""A modest drafter for the tiny pair: the committed drafter with seeded Gaussian noise on its
weights, so that its acceptance length falls from ~6.7 to a chosen level (the adaptive policy's
hard case, where some draft lengths pay and others do not).

Under-training does not give one: the tiny target's greedy text repeats its most frequent
tokens, and a drafter that only learned those (4 training steps) already reaches ~4.1.

    python benchmarks/modest_drafter.py --out runs/modest-drafter --noise 1.0

Each weight tensor W becomes W + noise * std(W) * N(0, 1) (seed 0); norms and all else as
committed. Prints the acceptance length of the noised drafter (fp32, this package's greedy
loop, the pair's 16 held-out prompts x --tokens new tokens) for each --noise value given, and
writes the last one to --out.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from vllm_dflash.checkpoint import load_drafter, save_drafter
from vllm_dflash.model import DFlashDrafter
from vllm_dflash.train.evaluate import mean_acceptance_length
from vllm_dflash.train.features import load_target

PAIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "pair"


@torch.no_grad()
def noised(drafter: DFlashDrafter, noise: float, seed: int = 0) -> DFlashDrafter:
    generator = torch.Generator().manual_seed(seed)
    for name, weight in drafter.named_parameters():
        if weight.dim() >= 2:  # matrices only: norms keep their scale
            scale = noise * weight.float().std()
            weight.add_((torch.randn(weight.shape, generator=generator) * scale).to(weight.dtype))
    return drafter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--noise", default="1.0", help="comma-separated noise levels")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    torch.manual_seed(0)
    target = load_target(str(PAIR / "target"), torch.float32, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"]
               for line in (PAIR / "heldout_prompts.jsonl").read_text().splitlines()]
    for noise in (float(n) for n in args.noise.split(",")):
        drafter = noised(load_drafter(PAIR / "drafter", torch.float32), noise)
        tau = mean_acceptance_length(drafter, target, prompts, args.tokens)
        print(f"noise {noise}: acceptance length {tau:.2f}", flush=True)
    save_drafter(drafter.to(torch.bfloat16), args.out)


if __name__ == "__main__":
    main()
