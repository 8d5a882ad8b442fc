"""The per-step JSONL log of a training run (owner-only, in the private run folder), and the
curves plotted into the model card."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from vip_hub.paths import make_private_dir, open_private, write_private

__all__ = ["RunLog", "plot_curves"]


class RunLog:
    """Append-only JSONL, one record per step (``step`` counts the steps done). On resume
    from a checkpoint after ``resume_step`` steps, later records (written after that
    checkpoint) are dropped, so the log matches the weights."""

    def __init__(self, path: str | os.PathLike[str], resume_step: int):
        self.path = Path(path)
        make_private_dir(self.path.parent)
        kept = [r for r in self.records() if r.get("step", 0) <= resume_step] if resume_step else []
        write_private(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self._file = io.TextIOWrapper(
            open_private(self.path, "ab"), encoding="utf-8", line_buffering=True
        )

    def records(self) -> list[dict[str, Any]]:
        """Every record written so far (a torn last line, from a kill, or any other line that is
        no JSON object, is skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_bytes().decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def plot_curves(records: list[dict[str, Any]], loss_key: str, loss_label: str, title: str) -> bytes:
    """A PNG of ``loss_key`` (and epsilon, when recorded) against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["step"], r[loss_key]) for r in records if r.get(loss_key) is not None]
    eps = [(r["step"], r["epsilon"]) for r in records if r.get("epsilon") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    if pts:
        ax.plot(*zip(*pts, strict=True), color="#2563eb", label=loss_label)
    ax.set_xlabel("step")
    ax.set_ylabel(loss_label, color="#2563eb")
    ax.grid(alpha=0.3)
    if eps:
        ax2 = ax.twinx()
        ax2.plot(*zip(*eps, strict=True), color="#dc2626", label="epsilon spent")
        ax2.set_ylabel("epsilon spent", color="#dc2626")
        ax2.set_ylim(bottom=0)
    ax.set_title(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
