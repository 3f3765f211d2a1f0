"""Per-epoch training records: JSON lines + CSV (rewritten atomically), Dice thresholds, curves PNG.

Example:
```python
history = History("runs/demo", class_names=["grey matter", "white matter"], thresholds=[0.8, 0.9])
history.append({"epoch": 1, "train_loss": 0.9, "val_mean_dice": 0.42, ...})
history.plot("runs/demo/training_curves.png")
```
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from tfmis.utils.io import atomic_writer

JSONL = "history.jsonl"
CSV = "history.csv"


class History:
    """The epochs trained so far, as written in `output_dir/history.jsonl`.

    Args:
        output_dir: the run folder.
        thresholds: mean-Dice thresholds whose first crossing (epoch, seconds) is recorded.
    """

    def __init__(self, output_dir: str | Path, thresholds=(0.8, 0.9, 0.93, 0.95)):
        self.dir = Path(output_dir)
        self.thresholds = sorted(float(t) for t in thresholds)
        path = self.dir / JSONL
        self.records = [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []

    def truncate(self, last_epoch: int) -> None:
        """Drops epochs after `last_epoch` (those of an interrupted run that were not checkpointed)."""
        kept = [r for r in self.records if r["epoch"] <= last_epoch]
        if len(kept) != len(self.records):
            self.records = kept
            self._write()

    def append(self, record: dict) -> None:
        self.records.append(record)
        self._write()

    @property
    def best(self) -> dict | None:
        scored = [r for r in self.records if _finite(r.get("val_mean_dice"))]
        return max(scored, key=lambda r: r["val_mean_dice"]) if scored else None

    def thresholds_reached(self) -> dict[str, dict]:
        """{"0.80": {"epoch": 7, "elapsed_seconds": 312.4}, ...} for each threshold crossed."""
        reached = {}
        for t in self.thresholds:
            for r in self.records:
                if _finite(r.get("val_mean_dice")) and r["val_mean_dice"] >= t:
                    reached[f"{t:.2f}"] = {"epoch": r["epoch"], "elapsed_seconds": r["elapsed_seconds"]}
                    break
        return reached

    def _write(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with atomic_writer(self.dir / JSONL) as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        flat = [_flatten(r) for r in self.records]
        columns = list(dict.fromkeys(k for r in flat for k in r))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(flat)
        with atomic_writer(self.dir / CSV) as f:
            f.write(buffer.getvalue())

    def plot(self, path: str | Path) -> Path:
        """Loss, validation Dice (mean and per class) and epoch time (compute vs input wait) curves."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        epochs = [r["epoch"] for r in self.records]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        axes[0].plot(epochs, [r["train_loss"] for r in self.records], "o-", ms=3)
        axes[0].set(title="training loss", xlabel="epoch")
        val = [r for r in self.records if _finite(r.get("val_mean_dice"))]
        if val:
            ve = [r["epoch"] for r in val]
            axes[1].plot(ve, [r["val_mean_dice"] for r in val], "k-o", ms=4, lw=2, label="mean")
            for name in val[-1]["val_dice"]:
                axes[1].plot(ve, [r["val_dice"].get(name, math.nan) for r in val], "-", label=name, alpha=0.8)
            for t in self.thresholds:
                axes[1].axhline(t, color="grey", lw=0.5, ls=":")
            axes[1].legend(fontsize=8, loc="lower right")
        axes[1].set(title="validation Dice (sliding window, full volumes)", xlabel="epoch", ylim=(0, 1))
        compute = [r["compute_seconds"] for r in self.records]
        wait = [r["data_wait_seconds"] for r in self.records]
        axes[2].bar(epochs, compute, label="compute")
        axes[2].bar(epochs, wait, bottom=compute, label="waiting for input")
        axes[2].plot(epochs, [r["epoch_seconds"] for r in self.records], "k.", label="epoch total (incl. validation)")
        axes[2].set(title="time per epoch (s)", xlabel="epoch")
        axes[2].legend(fontsize=8)
        fig.tight_layout()
        path = Path(path)
        with atomic_writer(path, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        plt.close(fig)
        return path


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _flatten(record: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out
