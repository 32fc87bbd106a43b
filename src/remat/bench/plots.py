"""The bench's figures, drawn with matplotlib's Agg backend into PNG files.

Each function takes plain numbers (the report module reads them from the results folder) and a ``footer``
that names the machine and the exact command; every figure carries it, so a figure copied out of the
report still says where and how it was made.
"""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

MIB = 2**20
_MARKERS = "osD^v<>Ph*Xd"


def _finish(fig: Any, path: Path, footer: str) -> Path:
    text = "\n".join(textwrap.wrap(footer, 130))
    lines = text.count("\n") + 1
    fig.text(0.01, 0.005, text, fontsize=6.5, color="0.35", va="bottom", ha="left", family="monospace")
    with warnings.catch_warnings(record=True) as caught:  # "Tight layout not applied": the figure is cropped instead
        warnings.simplefilter("always")
        fig.tight_layout(rect=(0, 0.012 * lines + 0.02, 1, 1))
    tight = not any("Tight layout not applied" in str(w.message) for w in caught)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, **({} if tight else {"bbox_inches": "tight"}))
    plt.close(fig)
    return path


def pareto(points: Sequence[Mapping[str, Any]], budget_bytes: int | None, path: Path, footer: str) -> Path:
    """Measured peak activation memory against step time, one point per strategy (mean over seeds, 95% CI
    bars); hollow markers are over the budget; the line joins the strategies no other beats on both."""
    fig, ax = plt.subplots(figsize=(8, 5.2))
    usable = [p for p in points if p.get("memory_bytes") is not None and p.get("step_ms") is not None]
    for i, p in enumerate(usable):
        x, y = p["memory_bytes"] / MIB, p["step_ms"]
        over = budget_bytes is not None and p["memory_bytes"] > budget_bytes
        err = None
        if p.get("ci_low") is not None and p.get("ci_high") is not None:
            err = [[max(0.0, y - p["ci_low"])], [max(0.0, p["ci_high"] - y)]]
        color = f"C{i % 10}"
        ax.errorbar(
            x,
            y,
            yerr=err,
            fmt=_MARKERS[i % len(_MARKERS)],
            color=color,
            capsize=3,
            markersize=8,
            markerfacecolor="none" if over else color,
            label=p["label"] + (" (over budget)" if over else ""),
        )
        ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(6, 5), fontsize=8)
    front = pareto_front([(p["memory_bytes"], p["step_ms"]) for p in usable])
    if len(front) > 1:
        xs, ys = zip(*[(m / MIB, t) for m, t in front], strict=True)
        ax.step(xs, ys, where="post", color="0.6", linestyle=":", linewidth=1.2, label="Pareto front")
    if budget_bytes is not None:
        ax.axvline(budget_bytes / MIB, color="red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("peak activation memory, measured (MiB)")
    ax.set_ylabel("step time (ms, mean of timed steps, 95% CI)")
    ax.set_title("Memory against step time per strategy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _finish(fig, path, footer)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both memory and time, by increasing memory."""
    front: list[tuple[float, float]] = []
    for m, t in sorted(points):
        if not front or t < front[-1][1]:
            front.append((m, t))
    return front


def loss_curves(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]], warmup: int, path: Path, footer: str
) -> Path:
    """Training loss per step for each strategy (mean over seeds). Exact strategies lie on top of each other."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    styles = ["-", "--", ":", "-."]
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        ax.plot(steps, losses, styles[i % len(styles)], color=f"C{i % 10}", linewidth=1.4, label=label)
    if warmup:
        ax.axvspan(-0.5, warmup - 0.5, color="0.9", label="warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over seeds)")
    ax.set_title("Training loss per strategy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _finish(fig, path, footer)


def mask_heatmap(
    histories: Mapping[str, tuple[Sequence[str], Sequence[Sequence[bool]]]], path: Path, footer: str
) -> Path:
    """PGAC's mask over steps: one row per block, one column per step, dark = activations stored."""
    n = max(1, len(histories))
    fig, axes = plt.subplots(
        n, 1, figsize=(9, 1.2 + 0.35 * max(len(f) for f, _ in histories.values()) * n + 0.6), squeeze=False
    )
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#f2f2f2", "#1f4e79"])
    for ax, (label, (fqns, masks)) in zip(axes[:, 0], histories.items(), strict=False):  # one row even with no history
        grid = [[1 if masks[s][b] else 0 for s in range(len(masks))] for b in range(len(fqns))]
        ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks(range(len(fqns)))
        ax.set_yticklabels(fqns, fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(f"{label}: blocks stored (dark) or recomputed (light) in each step", fontsize=9)
    return _finish(fig, path, footer)


def block_memory(fqns: Sequence[str], saved: Mapping[str, Sequence[int | None]], path: Path, footer: str) -> Path:
    """Bytes each block keeps for backward under each action, from the CostTable (None: the block cannot run the
    action, and its bar is left out)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(fqns) + 3), 4.6))
    actions = list(saved)
    width = 0.8 / max(1, len(actions))
    for j, action in enumerate(actions):
        offset = (j - (len(actions) - 1) / 2) * width
        bars = [(i + offset, b / MIB) for i, b in enumerate(saved[action]) if b is not None]
        ax.bar([x for x, _ in bars], [h for _, h in bars], width=width, label=action, color=f"C{j}")
    ax.set_xticks(range(len(fqns)))
    ax.set_xticklabels(fqns, rotation=30, ha="right", fontsize=7)
    top = max((b for values in saved.values() for b in values if b is not None), default=0) / MIB
    columns = min(len(actions), 3)  # a legend row per three actions, inside the axes
    legend_rows = -(-len(actions) // columns) if actions else 0
    ax.set_ylim(0, top * (1.2 + 0.15 * legend_rows) if top > 0 else 1)
    ax.set_ylabel("bytes kept after forward (MiB)")
    ax.set_title("Per-block activation memory by action (profiled CostTable, seed 0)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=columns, loc="upper center")
    return _finish(fig, path, footer)


def time_breakdown(rows: Sequence[Mapping[str, Any]], path: Path, footer: str) -> Path:
    """Mean step time split into forward, backward (without recomputation), recomputation and optimizer."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(rows) + 3), 4.6))
    labels = [r["label"] for r in rows]
    parts = [
        ("forward", "forward_ms"),
        ("backward (excl. recompute)", "backward_net_ms"),
        ("recompute", "recompute_ms"),
        ("optimizer", "optimizer_ms"),
    ]
    bottom = [0.0] * len(rows)
    for j, (name, key) in enumerate(parts):
        values = [float(r.get(key) or 0.0) for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=name, color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (mean of timed steps)")
    ax.set_title("Where the step time goes")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, path, footer)
