"""The `vllm-dflash train` subcommand: arguments -> TrainConfig -> train().

The same command runs under `torchrun --nproc-per-node N -m vllm_dflash.cli train ...`: one
drafter trained data-parallel over the N processes (see trainer.py).
"""

import argparse
import json

from vllm_dflash.config import DFLASH2_METAVAR, LILICORR_METAVAR, dflash2_option, lilicorr_option
from vllm_dflash.convert import SCHEMAS
from vllm_dflash.train.trainer import (
    AUTOCAST,
    TrainConfig,
    config_from_args,
    regenerate_only,
    train,
)

DEFAULTS = TrainConfig(target="", data="", out="")


def layer_ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a DFlash drafter for a target model",
        description="Train a DFlash drafter (z-lab or speculators format) on the target's own "
        "responses.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = DEFAULTS
    p.add_argument("--target", required=True, help="target model dir (HF format, with tokenizer)")
    p.add_argument(
        "--data",
        required=True,
        help='JSONL of {"prompt"[, "response"]}, {"messages"} or ShareGPT {"conversations"} '
        "records (read streaming; every assistant turn of a chat is trained), a local Hugging "
        "Face dataset (save_to_disk folder, .parquet/.arrow files; needs `datasets`), or a "
        "folder of text files",
    )
    p.add_argument("--out", required=True, help="output dir: drafter checkpoint + trainer state")
    p.add_argument("--block-size", type=int, default=d.block_size, help="B: anchor + B-1 drafts")
    p.add_argument("--layers", type=int, default=d.layers, help="drafter decoder layers")
    p.add_argument(
        "--target-layer-ids",
        type=layer_ids,
        default=d.target_layer_ids,
        help="comma-separated target layers to read; None: spread over the target",
    )
    p.add_argument(
        "--dflash2",
        type=dflash2_option,
        default=d.dflash2,
        metavar=DFLASH2_METAVAR,
        help="a DFlash2 drafter: conv_kernel_size, conv_group_size, selector_rank, "
        "selector_top_k (its selector trains teacher-forced beside the block loss)",
    )
    p.add_argument(
        "--lilicorr",
        type=lilicorr_option,
        default=d.lilicorr,
        metavar=LILICORR_METAVAR,
        help="a LiLiCorr drafter: lilicorr_candidate_topk, lilicorr_num_layers, "
        "lilicorr_num_heads, lilicorr_factor_dim (its head trains teacher-forced beside the "
        "block loss)",
    )
    p.add_argument(
        "--init-from-target",
        action="store_true",
        help="start the drafter's layers as the target's layers after its deepest feature, fc "
        "passing that feature through (the drafter then needs the target's layer shapes)",
    )
    p.add_argument(
        "--from-drafter",
        metavar="DIR",
        default=d.from_drafter,
        help="start from this saved drafter's weights (train it further, with a new schedule); "
        "it must have the shapes the other options give",
    )
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=d.mask_token_id,
        help="None: the tokenizer's <|mask|> token",
    )
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes over the sequences")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW peak learning rate")
    p.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="sequences per batch over all ranks (a multiple of the world size)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=d.grad_accum,
        help="batches whose gradients one optimizer step sums (one all-reduce per step); with "
        "--online-features a rank's share of a batch is one target forward, so this trades "
        "that memory for steps",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="max prompt+response tokens")
    p.add_argument(
        "--anchors-per-seq", type=int, default=d.anchors_per_seq, help="blocks per sequence"
    )
    p.add_argument(
        "--gamma",
        type=float,
        default=d.gamma,
        help="loss decay; None: 7 for B=16, 5 for B=10, 4 for B=8, else B/2-1",
    )
    p.add_argument("--warmup", type=float, default=d.warmup, help="warmup fraction of steps")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=d.prompt_tokens,
        help="prompt length when --data is a folder of text files",
    )
    p.add_argument(
        "--max-response-tokens",
        type=int,
        default=d.max_response_tokens,
        help="response tokens regenerated (or kept) per prompt",
    )
    p.add_argument(
        "--regenerate",
        action=argparse.BooleanOptionalAction,
        default=d.regenerate,
        help="regenerate responses with the target (vLLM) instead of the data's text",
    )
    p.add_argument(
        "--regenerate-batch-size",
        type=int,
        default=d.regenerate_batch_size,
        help="prompts per vLLM batch; each finished batch is saved to the responses file "
        "under --cache-dir, which a rerun resumes from",
    )
    p.add_argument(
        "--regen-tp",
        type=int,
        default=d.regen_tp,
        help="GPUs per regeneration engine (vLLM tensor_parallel_size)",
    )
    p.add_argument(
        "--regen-dp",
        type=int,
        default=d.regen_dp,
        help="regeneration engines at once, each on its own --regen-tp GPUs with its share of "
        "the prompts",
    )
    p.add_argument(
        "--regenerate-only",
        action="store_true",
        help="only regenerate the responses into --cache-dir (resumable), then stop; a later "
        "run with the same --cache-dir and data trains on them without starting vLLM",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="regeneration temperature (0: greedy)",
    )
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N] (cuda: under torchrun, "
                   "each rank's cuda:LOCAL_RANK)")
    p.add_argument("--dtype", default=d.dtype, help="target dtype (the drafter trains in fp32)")
    p.add_argument(
        "--autocast",
        choices=AUTOCAST,
        default=d.autocast,
        help="bf16: the drafter's forward in bf16 autocast, its weights and AdamW state fp32",
    )
    p.add_argument(
        "--online-features",
        action="store_true",
        help="compute the target's features of each batch as it trains (no grad) instead of "
        "all of them up front; no feature cache (for large targets, whose features would not "
        "fit in memory or on disk)",
    )
    p.add_argument(
        "--fsdp-target",
        action="store_true",
        help="with --online-features under torchrun: shard the target's weights over the ranks "
        "(FSDP), each rank gathering one decoder layer at a time, for a target that does not "
        "fit one device; the drafter stays data-parallel (DDP)",
    )
    p.add_argument("--save-dtype", default=d.save_dtype, help="dtype of the saved drafter")
    p.add_argument(
        "--save-format",
        choices=SCHEMAS,
        default=d.save_format,
        help="schema of the saved drafter's config.json (speculators: names --target as the "
        "verifier; `vllm-dflash convert` rewrites a drafter in the other)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=d.tensorboard,
        help="write scalars to a tensorboard event file in DIR every step: loss, lr, block "
        "tokens/s, greedy accuracy per mask position, and the eval acceptance length per epoch "
        "(needs `pip install tensorboard`)",
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt")
    p.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help="also save the trainer state every N steps (0: at epoch ends)",
    )
    p.add_argument(
        "--cache-dir",
        default=d.cache_dir,
        help="disk cache of responses and target features; None: in memory",
    )
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=d.eval_prompts,
        help="held-out prompts for the per-epoch acceptance length (0: no eval)",
    )
    p.add_argument(
        "--eval-data",
        default=d.eval_data,
        help="file/folder of eval prompts; None: the last --eval-prompts of --data",
    )
    p.add_argument(
        "--eval-max-new-tokens",
        type=int,
        default=d.eval_max_new_tokens,
        help="tokens decoded per eval prompt",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="init, data order and anchors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    if args.regenerate_only:
        print(json.dumps(regenerate_only(config_from_args(args)), indent=2))
        return
    stats = train(config_from_args(args))
    if stats is not None:  # rank 0
        print(json.dumps({k: v for k, v in stats.items() if k != "history"}, indent=2))
