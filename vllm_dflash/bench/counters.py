"""vLLM's spec-decode counters (from LLM.get_metrics() or the server's /metrics) and peak RSS."""

import os
import re
from dataclasses import dataclass, field
from itertools import zip_longest

PREFIX = "vllm:spec_decode_"
POSITION = re.compile(r'position="(\d+)"')
FIELDS = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens",
          "num_accepted_tokens": "accepted"}


@dataclass
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)

    def plus(self, other: "SpecCounters", sign: float = 1.0) -> "SpecCounters":
        per_pos = zip_longest(self.accepted_per_pos, other.accepted_per_pos, fillvalue=0.0)
        return SpecCounters(
            self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted, [a + sign * b for a, b in per_pos],
        )

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        return self.plus(before, sign=-1.0)


def from_llm_metrics(metrics: list) -> SpecCounters:
    """From `LLM.get_metrics()`: Counter `.value`s and the per-position Vector `.values`."""
    counters = SpecCounters()
    for metric in metrics:
        name = metric.name.removeprefix(PREFIX)
        if name == "num_accepted_tokens_per_pos":
            counters.accepted_per_pos = [float(v) for v in metric.values]
        elif name in FIELDS:
            setattr(counters, FIELDS[name], float(metric.value))
    return counters


def from_prometheus(text: str) -> SpecCounters:
    """From the server's /metrics text (counters end in `_total`; summed over engines)."""
    counters = SpecCounters()
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{")[0].removeprefix(PREFIX).removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            position = int(POSITION.search(series).group(1))
            per_pos[position] = per_pos.get(position, 0.0) + float(value)
        elif name in FIELDS:
            setattr(counters, FIELDS[name], getattr(counters, FIELDS[name]) + float(value))
    counters.accepted_per_pos = [per_pos[p] for p in sorted(per_pos)]
    return counters


def acceptance(counters: SpecCounters) -> dict:
    """Mean acceptance length (1 + accepted / drafts) and the acceptance rate per position."""
    if counters.drafts <= 0:
        return {"mean_acceptance_length": None, "acceptance_per_position": []}
    return {
        "mean_acceptance_length": 1.0 + counters.accepted / counters.drafts,
        "acceptance_per_position": [a / counters.drafts for a in counters.accepted_per_pos],
    }


def peak_rss_mib(pid: int) -> float:
    """Sum of the peak resident set (VmHWM) of pid and all its descendants, in MiB."""
    import psutil  # a vLLM dependency

    pids = [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    return sum(vm_hwm_kib(p) for p in pids) / 1024


def vm_hwm_kib(pid: int) -> float:
    path = f"/proc/{pid}/status"
    if not os.path.exists(path):
        return 0.0
    with open(path) as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return float(line.split()[1])
    return 0.0
