"""Load and save DFlash drafters in the z-lab format: config.json + *.safetensors, no key prefix."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_dflash import speculators
from vllm_dflash.config import DFlashConfig, DFlashConfigError, resolve_dtype
from vllm_dflash.model import DFlashDrafter

# Served from the target model; some checkpoints still carry copies, which are ignored.
# Copies of the target's tables that some checkpoints carry; the drafter reads the target's.
SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


def is_shared(key: str, cfg: DFlashConfig) -> bool:
    """A weight the drafter takes from its target (a LiLiCorr drafter may own its lm_head)."""
    return key.startswith(SHARED_PREFIXES) and not (
        cfg.has_own_lm_head and key.startswith("lm_head."))
SHAPE_FIX = (
    "fix: make config.json match the weights (hidden_size, intermediate_size, num_hidden_layers, "
    "num_attention_heads, num_key_value_heads, head_dim, target_layer_ids) or re-save the "
    "drafter with save_drafter"
)
# What a drafter needs from a hub repo; other files (README, training state) are not fetched.
HUB_FILES = ["config.json", "*.safetensors"]


def drafter_dir(model: str | Path, revision: str | None = None) -> Path:
    """The local directory of a drafter given as a directory or as a Hugging Face hub id.

    A hub id resolves as vLLM resolves its own models: to the snapshot of `revision` (default
    main) in the Hugging Face cache (HF_HUB_CACHE), downloading config.json and *.safetensors
    first unless HF_HUB_OFFLINE is set.
    """
    path = Path(model)
    if path.is_dir():
        return path
    if not is_hub_id(str(model)):
        raise DFlashConfigError(
            f"drafter directory {str(model)!r} does not exist; fix: pass the directory holding "
            "config.json and *.safetensors, or a hub id (org/name)"
        )
    return _hub_snapshot(str(model), revision)


def is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import validate_repo_id  # needed for hub ids only

    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download

    offline = constants.HF_HUB_OFFLINE
    try:
        snapshot = snapshot_download(
            repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline
        )
    except OSError as err:  # huggingface_hub's lookup and download errors are all OSErrors
        where = f"hub model {repo_id!r} at revision {revision or 'main'!r}"
        if offline:
            download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
            raise DFlashConfigError(
                f"drafter {repo_id!r} is not a local directory, and the {where} is not in the "
                f"Hugging Face cache {constants.HF_HUB_CACHE} while HF_HUB_OFFLINE is set; fix: "
                f"download it where the hub is reachable ({download} --include config.json "
                "'*.safetensors'), unset HF_HUB_OFFLINE, or pass the drafter's local directory"
            ) from err
        raise DFlashConfigError(
            f"drafter {repo_id!r} is not a local directory, and the {where} could not be "
            f"fetched ({type(err).__name__}: {err}); fix: check the hub id, the revision and "
            "your network or HF_TOKEN, or pass the drafter's local directory"
        ) from err
    return Path(snapshot)


def read_config(path: str | Path) -> DFlashConfig:
    """The config.json of a drafter directory, in the z-lab or the speculators schema."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise DFlashConfigError(
            f"no config.json in {str(path)!r}; fix: pass a DFlash checkpoint directory "
            "(config.json + *.safetensors)"
        )
    d = json.loads(config_file.read_text())
    if speculators.is_speculators_config(d):
        d = speculators.to_zlab(d)
    return DFlashConfig.from_dict(d)


def load_config(model: str | Path, revision: str | None = None) -> DFlashConfig:
    """The DFlashConfig of a drafter directory or hub id (drafter_dir)."""
    return read_config(drafter_dir(model, revision))


def load_drafter(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> DFlashDrafter:
    """Build a drafter from a checkpoint dir or hub id (drafter_dir); dtype None keeps the
    checkpoint's (fp32/fp16/bf16)."""
    path = drafter_dir(path)
    cfg = read_config(path)
    state = _read_weights(path, cfg)
    # Meta device: no time spent on a random init that the checkpoint overwrites.
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    _check_weights(drafter, state, path)
    dtype = resolve_dtype(dtype if dtype is not None else state["fc.weight"].dtype)
    state = {key: value.to(device=device, dtype=dtype) for key, value in state.items()}
    drafter.load_state_dict(state, assign=True)
    return drafter


def save_drafter(drafter: DFlashDrafter, path: str | Path, schema: str = "z-lab",
                 verifier: str | Path | None = None) -> None:
    """Write config.json + model.safetensors, loadable by load_drafter and vLLM, and in schema
    "z-lab" by the reference package, in schema "speculators" by speculators (verifier: the
    target's hub id or directory, which its config names)."""
    if schema not in ("z-lab", "speculators"):
        raise DFlashConfigError(f"schema {schema!r}; fix: pass 'z-lab' or 'speculators'")
    path = Path(path)
    state = {key: value.detach().cpu().contiguous() for key, value in drafter.state_dict().items()}
    if schema == "speculators":
        config = speculators.from_dflash_config(drafter.cfg, verifier)
    else:
        config = drafter.cfg.to_dict()
    path.mkdir(parents=True, exist_ok=True)
    config["dtype"] = str(drafter.fc.weight.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def _read_weights(path: Path, cfg: DFlashConfig) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashConfigError(
            f"no *.safetensors files in {str(path)!r}; fix: put the drafter weights next to "
            "config.json"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return {key: value for key, value in state.items() if not is_shared(key, cfg)}


def _check_weights(drafter: DFlashDrafter, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = {key: list(value.shape) for key, value in drafter.state_dict().items()}
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise DFlashConfigError(
            f"{str(path)!r} has unexpected weights {unexpected[:5]} ({len(unexpected)} in all), "
            "expected only the DFlash drafter keys (fc, hidden_norm, norm, layers.N.*); "
            "fix: use a plain DFlashDraftModel checkpoint with unprefixed keys"
        )
    for key, shape in expected.items():
        found = list(state[key].shape) if key in state else "missing"
        if found != shape:
            raise DFlashConfigError(
                f"weight {key}: expected shape {shape} from config.json, found {found}; "
                + SHAPE_FIX
            )


def check_weight_shapes(path: str | Path, cfg: DFlashConfig) -> None:
    """Weight names and shapes against cfg, from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        _read_weights(path, cfg)  # raises its "no *.safetensors files" error
    state = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                if not is_shared(key, cfg):
                    state[key] = torch.empty(f.get_slice(key).get_shape(), device="meta")
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    _check_weights(drafter, state, path)
