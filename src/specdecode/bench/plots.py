"""PNG plots of a bench result (matplotlib, headless).

- OUT-acceptance.png: acceptance by draft position, one panel per workload;
- OUT-speedup-vs-k.png: speedup over plain vs k, per workload and drafter;
- OUT-tokens-per-second.png: median tokens/s of every configuration, peers included.
Panels per temperature where the result has several.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _spec(summary: list[dict]) -> list[dict]:
    return [e for e in summary if e["engine"] == "specdecode" and e["method"] != "plain"]


def acceptance(result: dict, path: Path) -> Path:
    entries = _spec(result["summary"])
    workloads = list(dict.fromkeys(e["workload"] for e in entries)) or ["-"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6),
                             squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for e in (e for e in entries if e["workload"] == w):
            pos = e.get("position_acceptance") or []
            ax.plot(range(1, len(pos) + 1), pos, marker="o", markersize=3,
                    linestyle="-" if e["temperature"] == 0 else "--",
                    label=f"{e['config'].removeprefix('specdecode ')} T={e['temperature']:g}")
        ax.set(title=w, xlabel="draft position", ylabel="P(accepted | earlier accepted)",
               ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def speedup_vs_k(result: dict, path: Path) -> Path:
    entries = _spec(result["summary"])
    temps = sorted({e["temperature"] for e in entries}) or [0.0]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 3.8), squeeze=False)
    for ax, t in zip(axes[0], temps):
        lines = {}
        for e in (e for e in entries if e["temperature"] == t and e["speedup"]):
            lines.setdefault((e["workload"], e["method"]), []).append((e["k"], e["speedup"]))
        for (w, method), points in lines.items():
            points.sort()
            ax.plot([k for k, _ in points], [s for _, s in points], marker="o",
                    label=f"{w}: {method}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"T={t:g}", xlabel="k (draft tokens per step)",
               ylabel="speedup vs plain (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def tokens_per_second(result: dict, path: Path) -> Path:
    summary = result["summary"]
    temps = sorted({e["temperature"] for e in summary})
    workloads = list(dict.fromkeys(e["workload"] for e in summary))
    configs = result["configs"]
    fig, axes = plt.subplots(len(temps), 1, figsize=(max(6, 1.2 * len(configs) * len(
        workloads)), 3.6 * len(temps)), squeeze=False)
    width = 0.8 / max(1, len(configs))
    for ax, t in zip(axes[:, 0], temps):
        for j, c in enumerate(configs):
            values = [next((e["tokens_per_second"] for e in summary if e["temperature"] == t
                            and e["workload"] == w and e["config"] == c), 0.0)
                      for w in workloads]
            ax.bar([i + j * width for i in range(len(workloads))], values, width, label=c,
                   hatch="//" if c.startswith("HF") else None)
        ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(workloads))],
                      workloads)
        ax.set(title=f"T={t:g}", ylabel="tokens/s (median)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def write_all(result: dict, out: Path) -> list[Path]:
    out = Path(out)
    stem = out.with_suffix("")
    return [acceptance(result, Path(f"{stem}-acceptance.png")),
            speedup_vs_k(result, Path(f"{stem}-speedup-vs-k.png")),
            tokens_per_second(result, Path(f"{stem}-tokens-per-second.png"))]
