"""DFlash drafter config: parse and write z-lab `config.json`, check a drafter against its target."""

from dataclasses import dataclass, fields
from typing import Any

import torch

# Head sizes vLLM's CPU attention backend accepts.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
LAYER_TYPES = ("full_attention", "sliding_attention")


class DFlashConfigError(ValueError):
    """A drafter config or checkpoint that cannot work; the message names the field and the fix."""


DFLASH2 = "DFlash2DraftModel"
# The keys a DFlash2 drafter adds (dflash_config or top level): its grouped convolutions and its
# candidate selector.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CONV_KEYS, SELECTOR_KEYS = DFLASH2_KEYS[:2], DFLASH2_KEYS[2:]
LILICORR = "LiLiCorrDraftModel"


@dataclass(frozen=True)
class LiLiCorrConfig:
    """A LiLiCorr drafter's candidate-lattice head (dflash_config's `lilicorr_*` keys): a small
    transformer over the top candidate_topk candidates of every draft position that scores
    the edges between neighbouring positions' candidates."""

    candidate_topk: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_ratio: float
    factor_dim: int
    vector_eps: float
    logit_scale: float

    def __post_init__(self) -> None:
        k = self.candidate_topk
        if not 1 <= k <= 16 or k & (k - 1):
            raise DFlashConfigError(
                f"lilicorr_candidate_topk {k} must be a power of two from 1 to 16; fix: "
                "correct dflash_config.lilicorr_candidate_topk")
        if self.num_heads < 1 or self.hidden_size % self.num_heads:
            raise DFlashConfigError(
                f"lilicorr_num_heads {self.num_heads} does not divide the head's hidden size "
                f"{self.hidden_size}; fix: correct dflash_config.lilicorr_num_heads")
        if self.factor_dim < 1 or self.num_layers < 0 or int(self.hidden_size * self.mlp_ratio) < 1:
            raise DFlashConfigError(
                f"lilicorr_factor_dim {self.factor_dim}, lilicorr_num_layers {self.num_layers} "
                f"and lilicorr_mlp_ratio {self.mlp_ratio} must be >= 1, >= 0 and > 0; fix: "
                "correct dflash_config")

    @classmethod
    def from_dflash_config(cls, dc: dict[str, Any], hidden_size: int) -> "LiLiCorrConfig":
        if not dc.get("lilicorr_enabled", True):
            raise DFlashConfigError(
                f"architectures ['{LILICORR}'] with dflash_config.lilicorr_enabled false; fix: "
                "set it true, or use the checkpoint's DFlash architecture")
        # Each field is dflash_config's `lilicorr_<field>`; a null hidden size means the drafter's.
        values = {f.name: dc.get(f"lilicorr_{f.name}") for f in fields(cls)}
        values["hidden_size"] = values["hidden_size"] or hidden_size
        missing = [f"lilicorr_{name}" for name, value in values.items() if value is None]
        if missing:
            raise DFlashConfigError(
                f"a {LILICORR} config needs {missing} in dflash_config; fix: add them from the "
                "checkpoint's training config")
        return cls(**{f.name: f.type(values[f.name]) for f in fields(cls)})

    def to_dflash_config(self) -> dict[str, Any]:
        return {"lilicorr_enabled": True,
                **{f"lilicorr_{f.name}": getattr(self, f.name) for f in fields(self)}}


def _integers_option(text: str, metavar: str) -> list[int]:
    from argparse import ArgumentTypeError

    values = [int(x) for x in text.split(",")]
    if len(values) != len(metavar.split(",")):
        raise ArgumentTypeError(f"takes {len(metavar.split(','))} integers: {metavar}")
    return values


DFLASH2_METAVAR = "TAPS,GROUP,RANK,TOP_K"
LILICORR_METAVAR = "TOP_K,LAYERS,HEADS,FACTOR_DIM"


def dflash2_option(text: str) -> list[int]:
    """The value of a `--dflash2 TAPS,GROUP,RANK,TOP_K` command-line option (an argparse type)."""
    return _integers_option(text, DFLASH2_METAVAR)


def lilicorr_option(text: str) -> list[int]:
    """The value of a `--lilicorr TOP_K,LAYERS,HEADS,FACTOR_DIM` option (an argparse type)."""
    return _integers_option(text, LILICORR_METAVAR)


def dflash2_fields(values: list[int] | None) -> dict[str, int]:
    """DFlashConfig's DFlash2 fields from a `--dflash2` value; {} for a DFlash drafter."""
    return dict(zip(DFLASH2_KEYS, values, strict=True)) if values else {}


def lilicorr_fields(values: list[int] | None, hidden_size: int) -> dict[str, Any]:
    """DFlashConfig's LiLiCorr field from a `--lilicorr` value (a head as wide as the drafter,
    an MLP twice as wide, logit scale 16); {} for other drafters."""
    if not values:
        return {}
    top_k, num_layers, num_heads, factor_dim = values
    return {"lilicorr": LiLiCorrConfig(
        candidate_topk=top_k, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, mlp_ratio=2.0, factor_dim=factor_dim, vector_eps=1e-6,
        logit_scale=16.0)}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map 'bf16' / 'bfloat16' / torch.bfloat16 (and fp16, fp32 alike) to a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise DFlashConfigError(
        f"dtype {dtype!r} is not supported (supported: float32, float16, bfloat16); "
        "fix: pass one of those"
    )


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers the published drafters read when config.json does not list them."""
    if num_features == 1:
        return [num_target_layers // 2]
    # Spread evenly over [1, T-3]: skips the embedding-like first and the last layers.
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    layer_types: list[str]
    sliding_window: int | None
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    causal: bool | None = None
    attention_bias: bool = False
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    # DFlash2 (all four set, or none): per-layer grouped dynamic causal convolutions over the
    # block (taps, channels per group) and the candidate selector (codebook rank, candidates
    # per position).
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # LiLiCorr: the candidate-lattice head instead of DFlash2's selector (convolutions optional),
    # and candidates from the drafter's own lm_head (lm_head.weight) instead of the target's.
    lilicorr: LiLiCorrConfig | None = None
    has_own_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise DFlashConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                f"{self.num_kv_heads}; fix: use a head count divisible by the KV head count"
            )
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise DFlashConfigError(
                f"layer_types {self.layer_types} must list {self.num_layers} entries "
                f"(num_hidden_layers) from {LAYER_TYPES}; fix: correct layer_types"
            )
        if self.block_size < 2:
            raise DFlashConfigError(
                f"block_size {self.block_size} leaves no draft tokens (need >= 2); "
                "fix: set dflash_config.block_size to the block size the drafter was trained with"
            )
        if not self.target_layer_ids:
            raise DFlashConfigError(
                "dflash_config.target_layer_ids is empty; fix: list the target layers whose "
                "outputs the drafter reads"
            )
        if self.is_dflash2:
            self._check_dflash2()
        elif self.has_convs:
            self._check_convs()

    @property
    def is_dflash2(self) -> bool:
        """DFlash2's candidate selector (and convolutions): any of its keys, LiLiCorr aside."""
        keys = DFLASH2_KEYS if self.lilicorr is None else SELECTOR_KEYS
        return any(getattr(self, key) is not None for key in keys)

    @property
    def has_selector(self) -> bool:
        """A candidate selector, DFlash2's or LiLiCorr's, chooses the drafts."""
        return self.is_dflash2 or self.lilicorr is not None

    @property
    def has_convs(self) -> bool:
        """Grouped causal convolutions around each layer's attention and MLP."""
        return self.conv_kernel_size is not None or self.conv_group_size is not None

    @property
    def architecture(self) -> str:
        if self.lilicorr is not None:
            return LILICORR
        return DFLASH2 if self.is_dflash2 else "DFlashDraftModel"

    def _check_dflash2(self) -> None:
        if self.lilicorr is not None:
            raise DFlashConfigError(
                f"a {LILICORR} config has selector_rank/selector_top_k, DFlash2's selector "
                "keys; fix: remove them (LiLiCorr scores candidates with its own head)")
        missing = [key for key in DFLASH2_KEYS if getattr(self, key) is None]
        if missing:
            raise DFlashConfigError(
                f"a {DFLASH2} config needs {list(DFLASH2_KEYS)} in dflash_config; {missing} "
                "missing; fix: add them from the checkpoint's training config"
            )
        if self.selector_rank < 1:
            raise DFlashConfigError(
                f"selector_rank {self.selector_rank} must be >= 1; fix: correct dflash_config"
            )
        self._check_convs()
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise DFlashConfigError(
                f"selector_top_k {self.selector_top_k} is outside [1, vocab_size "
                f"{self.vocab_size}]; fix: correct dflash_config.selector_top_k"
            )

    def _check_convs(self) -> None:
        if self.conv_kernel_size is None or self.conv_group_size is None:
            raise DFlashConfigError(
                f"conv_kernel_size {self.conv_kernel_size} and conv_group_size "
                f"{self.conv_group_size}: the convolutions need both; fix: set both in "
                "dflash_config, or neither")
        if self.conv_kernel_size < 1:
            raise DFlashConfigError(
                f"conv_kernel_size {self.conv_kernel_size} must be >= 1; fix: correct "
                "dflash_config"
            )
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise DFlashConfigError(
                f"conv_group_size {self.conv_group_size} does not divide hidden_size "
                f"{self.hidden_size}; fix: correct dflash_config.conv_group_size"
            )

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, i: int) -> bool:
        # Same rule as the reference: an explicit causal flag applies to every layer;
        # otherwise sliding layers are causal and full layers see the whole block.
        if self.causal is not None:
            return self.causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        """A z-lab config.json's config (checkpoint.read_config also reads the speculators
        schema)."""
        architectures = set(d.get("architectures") or ())
        dc = d.get("dflash_config")
        if not isinstance(dc, dict):
            raise DFlashConfigError(
                "config.json has no dflash_config section, so this is not a DFlash drafter; "
                "fix: point at a DFlash checkpoint (dflash_config {mask_token_id, "
                "target_layer_ids})"
            )
        num_layers = _required(d, "num_hidden_layers")
        num_target_layers = _required(d, "num_target_layers", dc)
        # Mirror transformers' Qwen3Config, which the reference and vLLM both read through:
        # the window only counts with use_sliding_window, and absent layer_types derive from it.
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        layer_types = d.get("layer_types") or [
            "sliding_attention"
            if window is not None and i >= d.get("max_window_layers", 28)
            else "full_attention"
            for i in range(num_layers)
        ]
        softcap = _draft(d, dc, "final_logit_softcapping")
        lilicorr = None
        if LILICORR in architectures:
            lilicorr = LiLiCorrConfig.from_dflash_config(dc, _required(d, "hidden_size"))
        return cls(
            hidden_size=_required(d, "hidden_size"),
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=num_layers,
            num_heads=_required(d, "num_attention_heads"),
            num_kv_heads=d.get("num_key_value_heads") or _required(d, "num_attention_heads"),
            head_dim=_required(d, "head_dim"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            vocab_size=_required(d, "vocab_size"),
            layer_types=list(layer_types),
            sliding_window=window,
            block_size=int(_draft(d, dc, "block_size", 16)),
            mask_token_id=_required(d, "mask_token_id", dc),
            target_layer_ids=list(
                _draft(d, dc, "target_layer_ids")
                or default_target_layer_ids(num_target_layers, num_layers)
            ),
            num_target_layers=num_target_layers,
            # vLLM's precedence: top-level is_causal, then dflash_config.causal.
            causal=d.get("is_causal", dc.get("causal")),
            attention_bias=bool(d.get("attention_bias", False)),
            output_multiplier=float(_draft(d, dc, "output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap and softcap > 0 else None,
            input_embedding_scale=float(_draft(d, dc, "input_embedding_scale", 1.0)),
            **_dflash2_fields(d, dc, architectures & {DFLASH2, LILICORR}),
            lilicorr=lilicorr,
            # vLLM reads it for LiLiCorr drafters only.
            has_own_lm_head=lilicorr is not None and bool(d.get("has_own_lm_head", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        """z-lab config.json, loadable by vLLM's in-tree DFlash and the reference package."""
        dflash_config: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "output_multiplier": self.output_multiplier,
            "final_logit_softcapping": self.final_logit_softcapping,
            "input_embedding_scale": self.input_embedding_scale,
        }
        if self.is_dflash2 or self.has_convs:
            dflash_config |= {key: getattr(self, key) for key in DFLASH2_KEYS
                              if getattr(self, key) is not None}
        top_level: dict[str, Any] = {}
        if self.lilicorr is not None:
            dflash_config |= self.lilicorr.to_dflash_config()
            top_level["has_own_lm_head"] = self.has_own_lm_head
        if self.causal is not None:
            dflash_config["causal"] = self.causal
            top_level["is_causal"] = self.causal  # the reference reads only the top-level flag
        return {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash_config,
            **top_level,
        }


def _required(d: dict[str, Any], key: str, dflash_config: dict[str, Any] | None = None) -> Any:
    value = _draft(d, dflash_config or {}, key)
    if value is None:
        name = key if dflash_config is None else f"{key} (in dflash_config or at the top level)"
        raise DFlashConfigError(
            f"config.json is missing {name}; fix: add {name} to config.json "
            "(every DFlash drafter config has it)"
        )
    return value


def _draft(d: dict[str, Any], dflash_config: dict[str, Any], key: str, default: Any = None) -> Any:
    # Newer checkpoints move keys into dflash_config; there they win over the top level.
    return dflash_config.get(key, d.get(key, default))


def _dflash2_fields(d: dict[str, Any], dflash_config: dict[str, Any],
                    architectures: set[str]) -> dict[str, int | None]:
    """The DFlash2 keys of a DFlash2 or LiLiCorr config, ints or None where missing
    (DFlashConfig names those); {} for other architectures."""
    if not architectures:
        return {}
    values = {key: _draft(d, dflash_config, key) for key in DFLASH2_KEYS}
    if LILICORR in architectures:  # vLLM reads 0 as no convolutions there
        values |= {key: values[key] or None for key in CONV_KEYS}
    if DFLASH2 in architectures and all(value is None for value in values.values()):
        raise DFlashConfigError(
            f"architectures {[DFLASH2]} but none of {list(DFLASH2_KEYS)} is in dflash_config; "
            "fix: add them from the checkpoint's training config"
        )
    return {key: None if value is None else int(value) for key, value in values.items()}


def _rope_theta(d: dict[str, Any]) -> float:
    field = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    params = d.get(field) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise DFlashConfigError(
            f"{field}.rope_type is {rope_type!r} but only 'default' RoPE is supported; "
            f"fix: use a drafter with plain RoPE ({field}.rope_type 'default')"
        )
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


def validate_against_target(
    cfg: DFlashConfig,
    *,
    target_hidden_size: int,
    target_num_layers: int,
    target_vocab_size: int,
    num_speculative_tokens: int | None = None,
    fc_in_features: int | None = None,
    dtype: str | torch.dtype | None = None,
) -> None:
    """Raise DFlashConfigError (field, both values, fix) if the drafter cannot serve the target."""
    fc_expected = cfg.num_features * target_hidden_size
    fc_found = fc_in_features if fc_in_features is not None else cfg.num_features * cfg.hidden_size
    if fc_found != fc_expected:
        raise DFlashConfigError(
            f"fc.weight input width is {fc_found} but len(target_layer_ids) "
            f"({cfg.num_features}) x target hidden_size ({target_hidden_size}) = {fc_expected}; "
            "fix: use a drafter trained for this target model"
        )
    for layer_id in cfg.target_layer_ids:
        # T-1 is excluded: HF and vLLM disagree on whether the last feature is final-normed.
        if not 0 <= layer_id < target_num_layers - 1:
            raise DFlashConfigError(
                f"dflash_config.target_layer_ids has {layer_id}, outside [0, "
                f"{target_num_layers - 1}) for a target with {target_num_layers} layers; "
                "fix: use a drafter made for this target, or ids in that range"
            )
    if not 0 <= cfg.mask_token_id < target_vocab_size:
        raise DFlashConfigError(
            f"dflash_config.mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
            f"[0, {target_vocab_size}); fix: set mask_token_id to a token id of the target "
            "tokenizer (e.g. its <|mask|> token)"
        )
    if cfg.vocab_size != target_vocab_size:
        raise DFlashConfigError(
            f"vocab_size is {cfg.vocab_size} in the drafter but {target_vocab_size} in the "
            "target; fix: use a drafter built for this target's tokenizer"
        )
    max_tokens = cfg.block_size - 1
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= max_tokens:
        raise DFlashConfigError(
            f"num_speculative_tokens is {num_speculative_tokens} but must be in [1, {max_tokens}] "
            f"(block_size {cfg.block_size} - 1); fix: set num_speculative_tokens to {max_tokens} "
            "or fewer"
        )
    if cfg.head_dim not in SUPPORTED_HEAD_DIMS:
        raise DFlashConfigError(
            f"head_dim is {cfg.head_dim}, not one of {SUPPORTED_HEAD_DIMS} that vLLM's CPU "
            "attention supports; fix: use a drafter with a supported head_dim"
        )
    if dtype is not None:
        resolve_dtype(dtype)
