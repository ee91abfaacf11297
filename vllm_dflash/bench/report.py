"""From the runs' measurements to the report: ratios to no speculation, greedy equality with
no speculation, and bench.json, bench.png and table.md."""

import json
import statistics
from pathlib import Path

from vllm_dflash.bench.counters import SpecCounters, acceptance
from vllm_dflash.bench.methods import BASELINE, color


def median_of_repeats(results: list[dict]) -> list[dict]:
    """One row per (method, concurrency): its median run by tokens/s (the lower middle one of
    an even count), with every run's tokens/s in tokens_per_s_repeats; a failed repeat makes
    the row that failure."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for result in results:
        groups.setdefault((result["method"], result["concurrency"]), []).append(result)
    rows = []
    for runs in groups.values():
        failed = [r for r in runs if not ok(r)]
        if failed:
            rows.append(failed[0])
            continue
        runs = sorted(runs, key=lambda r: r["output_tokens_per_s"])
        rows.append(runs[(len(runs) - 1) // 2] | {
            "tokens_per_s_repeats": [r["output_tokens_per_s"] for r in runs]})
    return rows


def paired_ratios(results: list[dict], methods: list[str]) -> list[dict]:
    """Tokens/s ratios of two methods run in the same repeat, next to each other in time, so
    the machine's load drift cancels out of each one; their median and range over repeats.

    Pairs: every method against no speculation, and each speculative method against every
    one listed after it (e.g. vllm-dflash / vllm-inproc-dflash)."""
    speed = {(r["method"], r["concurrency"], r.get("repeat", 0)): r["output_tokens_per_s"]
             for r in results if ok(r)}
    spec = [m for m in methods if m != BASELINE]
    pairs = [(m, BASELINE) for m in spec] if BASELINE in methods else []
    pairs += [(a, b) for i, a in enumerate(spec) for b in spec[i + 1 :]]
    rows = []
    for concurrency in dict.fromkeys(r["concurrency"] for r in results):
        repeats = sorted({r.get("repeat", 0) for r in results if r["concurrency"] == concurrency})
        for a, b in pairs:
            ratios = [speed[a, concurrency, i] / speed[b, concurrency, i] for i in repeats
                      if (a, concurrency, i) in speed and (b, concurrency, i) in speed]
            if ratios:
                rows.append({"concurrency": concurrency, "numerator": a, "denominator": b,
                             "median": statistics.median(ratios), "min": min(ratios),
                             "max": max(ratios), "repeats": len(ratios)})
    return rows


def compare_to_baseline(results: list[dict], greedy: bool = True) -> list[dict]:
    """Adds speedup_vs_none and greedy_equals_none (None without a baseline run at that
    concurrency, or when the requests sample) and drops the token ids."""
    baselines = {r["concurrency"]: r for r in results if r["method"] == BASELINE and ok(r)}
    rows = []
    for result in results:
        row = {k: v for k, v in result.items() if k != "token_ids"}
        base = baselines.get(result["concurrency"])
        if ok(result) and base:
            row["speedup_vs_none"] = result["output_tokens_per_s"] / base["output_tokens_per_s"]
            row["greedy_equals_none"] = result["token_ids"] == base["token_ids"] if greedy \
                else None
        else:
            row["speedup_vs_none"] = row["greedy_equals_none"] = None
        rows.append(row)
    return rows


def ok(result: dict) -> bool:
    return "error" not in result


def write_report(out_dir: Path, meta: dict, rows: list[dict], ratios: list[dict]) -> str:
    """Writes bench.json, bench.png and table.md into out_dir; returns the markdown tables."""
    report = {"meta": meta, "runs": rows, "paired_ratios": ratios}
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(out_dir / "bench.png", rows, meta["mode"])
    table = markdown_table(rows, server=meta["mode"] == "server")
    if ratios:
        table += "\n\n" + ratio_table(ratios)
    (out_dir / "table.md").write_text(table + "\n")
    return table


def acceptance_by_method(rows: list[dict]) -> dict[str, list[float]]:
    """Per-position acceptance rate of each speculative method, over all its concurrencies."""
    totals: dict[str, SpecCounters] = {}
    for row in rows:
        if ok(row) and row["mean_acceptance_length"] is not None:
            counters = SpecCounters(**row["spec_counters"])
            totals[row["method"]] = totals.get(row["method"], SpecCounters()).plus(counters)
    return {m: acceptance(c)["acceptance_per_position"] for m, c in totals.items()}


def plot(path: Path, rows: list[dict], mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, accept) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [(r["concurrency"], r["speedup_vs_none"]) for r in rows
                  if r["method"] == method and r["speedup_vs_none"] is not None]
        if points:
            speed.plot(*zip(*points), marker="o", label=method, color=color(method))
    concurrencies = sorted({r["concurrency"] for r in rows})
    speed.set_xscale("log", base=2)
    speed.set_xticks(concurrencies, [str(c) for c in concurrencies])
    speed.set(xlabel="concurrency", ylabel="output tokens/s / no speculation",
              title=f"Speedup vs concurrency ({mode})")
    speed.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for method, rates in acceptance_by_method(rows).items():
        accept.plot(range(1, len(rates) + 1), rates, marker="o", label=method,
                    color=color(method))
    accept.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1.05),
               title="Acceptance per position")
    for axes in (speed, accept):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(rows: list[dict], server: bool) -> str:
    header = ["method", "C", "tokens/s", "x none", "accept len", "peak RSS MiB", "= none"]
    if server:
        header[4:4] = ["TTFT p50/p99 ms", "ITL p50/p99 ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(table_cells(row, server)) + " |")
    return "\n".join(lines)


def ratio_table(ratios: list[dict]) -> str:
    """Paired ratios: one row per method pair, one column per concurrency."""
    concurrencies = list(dict.fromkeys(r["concurrency"] for r in ratios))
    cells: dict[str, dict[int, str]] = {}
    for r in ratios:
        pair = f"{r['numerator']} / {r['denominator']}"
        cells.setdefault(pair, {})[r["concurrency"]] = (
            f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
    header = ["tokens/s ratio, same repeat: median (min-max)"] + [f"C={c}" for c in concurrencies]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for pair, by_concurrency in cells.items():
        row = [pair] + [by_concurrency.get(c, "-") for c in concurrencies]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def table_cells(row: dict, server: bool) -> list[str]:
    if not ok(row):
        return [row["method"], str(row["concurrency"]), f"failed: {row['error']}"]
    cells = [
        row["method"], str(row["concurrency"]), f"{row['output_tokens_per_s']:.1f}",
        fmt(row["speedup_vs_none"], "{:.2f}"), fmt(row["mean_acceptance_length"], "{:.2f}"),
        f"{row['peak_rss_mib']:.0f}", fmt(row["greedy_equals_none"], "{}"),
    ]
    if server:
        cells[4:4] = [p50_p99(row["ttft_ms"]), p50_p99(row["itl_ms"])]
    return cells


def fmt(value: object, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def p50_p99(stats: dict | None) -> str:
    return "-" if stats is None else f"{stats['p50']:.1f} / {stats['p99']:.1f}"
