"""The speculators schema of DFlash drafters (vllm-project/speculators), as vLLM reads it
(vllm/transformers_utils/configs/speculators/algos.py, update_dflash and update_dflash2).

A speculators config.json keeps the draft layers' shapes in `transformer_layer_config` and the
DFlash fields at its top level; its weights have the z-lab names (vLLM's DFlash loader reads
both alike), and it omits the verifier's embedding and, at full vocabulary, its lm_head.
"""

import json
from pathlib import Path
from typing import Any

from vllm_dflash.config import DFLASH2, DFLASH2_KEYS, LILICORR, DFlashConfig, DFlashConfigError

# speculators_model_type -> the architecture vLLM builds for it (and writes config.json's).
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": DFLASH2}
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "head_dim", "vocab_size")
# The z-lab fields the speculators schema has no place for, at their no-op values.
ZLAB_DEFAULTS = {"output_multiplier": 1.0, "final_logit_softcapping": None,
                 "input_embedding_scale": 1.0}


def is_speculators_config(d: dict[str, Any]) -> bool:
    """Whether a config.json dict is in the speculators schema (of any algorithm)."""
    return d.get("speculators_model_type") is not None or d.get("speculators_config") is not None


def is_dflash_config(d: dict[str, Any]) -> bool:
    """Whether a config.json dict is a drafter's that vllm-dflash serves: a z-lab DFlash, DFlash2
    or LiLiCorr architecture, or a speculators dflash or dflash2 drafter."""
    if is_speculators_config(d):
        return d.get("speculators_model_type") in ARCHITECTURES
    return bool(set(d.get("architectures") or ()) & {*ARCHITECTURES.values(), LILICORR})


def to_zlab(d: dict[str, Any]) -> dict[str, Any]:
    """A speculators DFlash or DFlash2 config.json as the z-lab config.json with the same
    meaning, for DFlashConfig.from_dict."""
    kind = d.get("speculators_model_type")
    if kind not in ARCHITECTURES:
        raise DFlashConfigError(
            f"config.json is a speculators config with speculators_model_type {kind!r}, not a "
            f"DFlash drafter (vllm-dflash serves {sorted(ARCHITECTURES)}); fix: point at a "
            "DFlash drafter checkpoint")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashConfigError(
            f"speculators config.json (speculators_model_type {kind!r}) has no "
            "transformer_layer_config section; fix: save the drafter with speculators, whose "
            "configs keep the draft layers' shapes there")
    missing = [key for key in LAYER_KEYS if layer.get(key) is None]
    missing += [key for key in ("aux_hidden_state_layer_ids", "mask_token_id")
                if d.get(key) in (None, [])]
    if missing:
        raise DFlashConfigError(
            f"speculators config.json is missing {missing} ({list(LAYER_KEYS)} in "
            "transformer_layer_config, the others at the top level); fix: add them from the "
            "drafter's training config")
    _check_supported(d, layer)
    layer_types = layer.get("layer_types") or ["full_attention"] * layer["num_hidden_layers"]
    sliding = "sliding_attention" in layer_types
    # vLLM reads sliding_window whether or not use_sliding_window is set.
    if sliding and layer.get("sliding_window") is None:
        raise DFlashConfigError(
            "transformer_layer_config.layer_types has sliding_attention layers but no "
            "sliding_window; fix: set transformer_layer_config.sliding_window to the window the "
            "drafter was trained with")
    target_layer_ids = [i - 1 for i in d["aux_hidden_state_layer_ids"]]  # aux id 0: embeddings
    dflash_config = {
        "mask_token_id": d["mask_token_id"],
        "target_layer_ids": target_layer_ids,
        "block_size": _block_size(d),
        # speculators trains full-attention layers bidirectional; sliding_window_non_causal
        # (absent: true, as vLLM reads it) sets the sliding layers' masks.
        "causal": False if sliding and d.get("sliding_window_non_causal", True) else None,
        **ZLAB_DEFAULTS,
        **({key: d.get(key) for key in DFLASH2_KEYS} if kind == "dflash2" else {}),
    }
    return {
        **layer,
        "architectures": [ARCHITECTURES[kind]],
        "layer_types": layer_types,
        "use_sliding_window": sliding,
        # The schema does not record the target's depth (DFlashConfig needs it only when
        # target_layer_ids are absent): the least depth the ids fit stands in.
        "num_target_layers": d.get("num_target_layers") or max(target_layer_ids) + 2,
        "dflash_config": dflash_config,
    }


def _check_supported(d: dict[str, Any], layer: dict[str, Any]) -> None:
    if d.get("sample_from_anchor"):
        raise DFlashConfigError(
            "sample_from_anchor is true: the drafter predicts the anchor position too, which "
            "DFlash serving (vllm-dflash and vLLM alike) does not run; fix: use a drafter "
            "trained with sample_from_anchor false")
    draft_vocab = d.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != layer["vocab_size"]:
        raise DFlashConfigError(
            f"draft_vocab_size {draft_vocab} differs from transformer_layer_config.vocab_size "
            f"{layer['vocab_size']}: a reduced draft vocabulary (d2t/t2d) is not supported; "
            "fix: train the drafter on the verifier's full vocabulary")
    target_hidden = d.get("target_hidden_size")
    if target_hidden is not None and target_hidden != layer["hidden_size"]:
        raise DFlashConfigError(
            f"target_hidden_size {target_hidden} differs from the drafter's hidden_size "
            f"{layer['hidden_size']}, which vllm-dflash does not support; fix: use a drafter "
            "as wide as its target")
    if d.get("projector_type", "dflash") != "dflash" or d.get("shift_label"):
        raise DFlashConfigError(
            f"projector_type {d.get('projector_type')!r} (shift_label "
            f"{d.get('shift_label')!r}): only the plain DFlash projector is served; fix: use a "
            "drafter trained with projector_type 'dflash'")


def _block_size(d: dict[str, Any]) -> int:
    if d.get("block_size") is not None:
        return int(d["block_size"])
    methods = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    if tokens is None:
        raise DFlashConfigError(
            "speculators config.json has neither block_size nor "
            "speculators_config.proposal_methods[0].speculative_tokens; fix: add block_size, "
            "the block size the drafter was trained with")
    return int(tokens) + 1  # the anchor and its drafts


def from_dflash_config(cfg: DFlashConfig, verifier: str | Path | None = None) -> dict[str, Any]:
    """cfg as a speculators config.json, which vLLM and speculators read as cfg; verifier: the
    target's hub id or directory (speculators_config.verifier, with the architectures of a
    directory's config.json). Raises for what the schema cannot hold: a LiLiCorr head and the
    z-lab output scalings."""
    if cfg.lilicorr is not None:
        raise DFlashConfigError(
            "a LiLiCorr drafter has no speculators form; fix: save it in the z-lab schema")
    changed = {key: getattr(cfg, key) for key, value in ZLAB_DEFAULTS.items()
               if getattr(cfg, key) != value}
    if changed:
        raise DFlashConfigError(
            f"{changed} has no speculators form (it holds only {ZLAB_DEFAULTS}); fix: save "
            "this drafter in the z-lab schema")
    kind = "dflash2" if cfg.is_dflash2 else "dflash"
    layer = cfg.to_dict()
    for key in ("architectures", "block_size", "num_target_layers", "dflash_config"):
        del layer[key]  # is_causal (where causal is set) stays: vLLM reads it first
    sliding = "sliding_attention" in cfg.layer_types
    verifier_config = Path(verifier or "") / "config.json"
    verifier_architectures = (json.loads(verifier_config.read_text()).get("architectures")
                              if verifier and verifier_config.is_file() else None)
    return {
        "architectures": [cfg.architecture],
        "speculators_model_type": kind,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": cfg.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None if verifier is None else str(verifier),
                         "architectures": verifier_architectures or []},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": None,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        # Without sliding layers true, so that vLLM (which applies the flag to every layer)
        # keeps the full-attention layers bidirectional.
        "sliding_window_non_causal": not cfg.causal if cfg.causal is not None else not sliding,
        "sample_from_anchor": False,
        "num_target_layers": cfg.num_target_layers,
        **({key: getattr(cfg, key) for key in DFLASH2_KEYS} if cfg.is_dflash2 else {}),
    }
