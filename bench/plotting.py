"""What the demo benchmarks' PNG curves share: matplotlib when installed, running means, finishing a figure."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (the JSON is enough)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def finish(fig, ax, out: Path, title: str, xlabel: str, ylabel: str) -> None:
    """Label, lay out and save the figure as `out` with a .png suffix."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(f"wrote {out.with_suffix('.png')}")
