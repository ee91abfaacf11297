"""Training records streamed from disk: JSONL lines, or a local Hugging Face dataset.

A Hugging Face dataset is a `save_to_disk` folder (it holds dataset_info.json or
dataset_dict.json), or .parquet / .arrow files (one file, or a folder of them, as a hub snapshot
has); reading one needs the `datasets` package. Records come one at a time: no file is read
whole into memory.
"""

import json
from collections.abc import Iterator
from pathlib import Path

HF_FILE_TYPES = {".parquet": "parquet", ".arrow": "arrow"}
HF_DISK_MARKERS = ("dataset_info.json", "dataset_dict.json")


def hf_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in HF_FILE_TYPES)


def is_hf_dataset(path: Path) -> bool:
    if path.is_dir():
        return any((path / name).exists() for name in HF_DISK_MARKERS) or bool(hf_files(path))
    return path.suffix in HF_FILE_TYPES


def jsonl_records(path: Path) -> Iterator[dict]:
    """The JSON objects of path's non-blank lines, in order."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON record ({error}); fix: one JSON "
                                 "object per line") from error


def import_datasets(path: Path):
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"{path} is a Hugging Face dataset, and reading it needs the datasets "
                          "package; fix: pip install datasets") from error
    return datasets


def hf_records(path: Path) -> Iterator[dict]:
    """The rows of a local Hugging Face dataset (its "train" split when it has several)."""
    datasets = import_datasets(path)
    if path.is_dir() and any((path / name).exists() for name in HF_DISK_MARKERS):
        rows = datasets.load_from_disk(str(path))  # memory-mapped, not read into memory
        if isinstance(rows, datasets.DatasetDict):
            if "train" not in rows:
                raise ValueError(f"{path} has the splits {sorted(rows)} and no 'train'; fix: "
                                 "point --data at one split's folder")
            rows = rows["train"]
        yield from rows
        return
    files = [path] if path.is_file() else hf_files(path)
    kinds = {HF_FILE_TYPES[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(f"{path} mixes {sorted(kinds)} files; fix: keep one type per folder")
    yield from datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files],
                                     split="train", streaming=True)


def records(path: Path) -> Iterator[dict]:
    """The records of a JSONL file or a local Hugging Face dataset, in order."""
    return hf_records(path) if is_hf_dataset(path) else jsonl_records(path)
