"""Private: the demo's summary table, `metrics.json` and loss/accuracy plot."""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

COLUMNS = (
    "algo", "backend", "devices", "steps", "train loss", "test acc", "examples/s",
    "comm/step", "vs sync",
)  # fmt: skip


def format_bytes(num: float | None) -> str:
    """`153900` -> `'150.3 KiB'`."""
    if num is None:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if abs(num) < 1024:
            return f"{num:.0f} B" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} GiB"


def _ratio(comm: dict[str, Any]) -> str:
    ratio = comm.get("reduction_vs_sync")
    if ratio is None:
        return "-"
    if math.isclose(ratio, 1.0, rel_tol=5e-3):
        return "1x"
    if ratio > 1:
        return f"{ratio:.1f}x less"
    return f"{1 / ratio:.1f}x more"


def table_row(metrics: dict[str, Any]) -> list[str]:
    """One row of the summary table."""
    eps = metrics["examples_per_second"]
    loss = metrics["final_train_loss"]
    acc = metrics["test_accuracy"]
    return [
        metrics["config"]["algo"], metrics["config"]["backend"],
        f"{metrics['num_devices']} {metrics['platform']}", str(metrics["steps"]),
        "-" if loss is None else f"{loss:.4f}",
        "-" if acc is None else f"{100 * acc:.1f}%",
        "-" if eps is None else f"{eps:,.0f}",
        format_bytes(metrics["communication"]["bytes_per_step"]),
        _ratio(metrics["communication"]),
    ]  # fmt: skip


def format_table(rows: list[list[str]]) -> str:
    """A Markdown table (readable in a terminal, pastable into a README)."""
    widths = [max(map(len, cells)) for cells in zip(COLUMNS, *rows, strict=True)]

    def line(cells):
        padded = [c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        return f"| {' | '.join(padded)} |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(COLUMNS), sep, *(line(r) for r in rows)])


def describe_communication(metrics: dict[str, Any]) -> str:
    """One sentence: which collectives a step runs, how often, and their sizes."""
    comm = metrics["communication"]
    groups: collections.Counter[tuple[str, int]] = collections.Counter()
    for c in comm["collectives"]:
        groups[c["kind"], c["runs_every"]] += c["bytes"]
    parts = [
        f"{kind} of {format_bytes(size)} "
        + ("every step" if every == 1 else f"every {every} steps (block sync)")
        for (kind, every), size in sorted(groups.items(), key=lambda kv: kv[0][1])
    ]
    text = "Communication: " + ("; ".join(parts) or "none")
    text += (
        f". Each device sends {format_bytes(comm['bytes_per_step'])} per step "
        "(ring algorithms: 2(N-1)/N of an all-reduced buffer)"
    )
    if metrics["config"]["algo"] != "sync" and comm.get("sync_bytes_per_step"):
        text += f"; synchronous SGD: {format_bytes(comm['sync_bytes_per_step'])}"
    return text + "."


def write_json(path: str, obj: Any) -> None:
    """Writes JSON atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def plot(metrics: dict[str, Any], path: str) -> None:
    """Train loss and test accuracy against steps, side by side, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend involved

    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    hist, ev = metrics["history"], metrics["eval"]
    algo = metrics["config"]["algo"]
    label = f"{algo} ({metrics['num_devices']} {metrics['platform']} devices)"
    ax_loss.plot(hist["step"], hist["loss"], lw=1, label=label)
    ax_loss.set(xlabel="step", ylabel="train loss", yscale="log", title="Train loss")
    ax_acc.plot(ev["step"], [100 * a for a in ev["test_accuracy"]], "o-", ms=3,
                label=label)  # fmt: skip
    ax_acc.set(xlabel="step", ylabel="test accuracy (%)", title="Test accuracy")
    ax_acc.set_ylim(top=100)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
