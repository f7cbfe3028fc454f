"""Render a gateway benchmark's JSON as PNG (runs under the bench venv, which has matplotlib)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def overhead(data: dict, out: Path) -> None:
    rows = [r for r in data["rows"] if r["target"] != "direct"]
    keys = sorted({(r["stream"], r["concurrency"]) for r in rows})
    targets = sorted({r["target"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric in zip(axes, ("added_ttft_p50_ms", "added_e2e_p99_ms"), strict=True):
        width = 0.8 / len(targets)
        for i, t in enumerate(targets):
            vals = [
                next(
                    (r[metric] for r in rows if r["target"] == t and (r["stream"], r["concurrency"]) == k), 0
                )
                for k in keys
            ]
            ax.bar([x + i * width for x in range(len(keys))], vals, width, label=t)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))])
        ax.set_xticklabels([f"{'stream' if s else 'plain'}\nc={c}" for s, c in keys])
        ax.set_ylabel(metric.replace("_", " ") + " (vs direct)")
        ax.set_yscale("symlog")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def routing(data: dict, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, workload in zip(axes, ("shared", "no-sharing"), strict=True):
        rows = [r for r in data["rows"] if r["workload"] == workload]
        names = [r["policy"] for r in rows]
        ax.bar(names, [r["ttft_p99_ms"] for r in rows], label="TTFT p99 (ms)")
        ax.set_title(f"{workload}: TTFT p99 (ms); labels = tokens/s")
        for i, r in enumerate(rows):
            ax.annotate(f"{r['tokens_per_s']:.0f}", (i, r["ttft_p99_ms"]), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def decision(data: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = data["rows"]
    ax.bar([r["what"] for r in rows], [r["p99_us"] for r in rows])
    ax.set_ylabel("p99 (µs)")
    ax.set_title(f"{data['replicas']} replicas, {data['prompt_tokens']}-token prompts")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    kind, path = sys.argv[1], Path(sys.argv[2])
    data = json.loads(path.read_text())
    {"overhead": overhead, "routing": routing, "decision": decision}[kind](data, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.png')}")
