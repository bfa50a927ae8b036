"""`onespec bench --plot FILE.png`: tokens/s against batch size for plain decoding, each fixed
draft length, auto, and the bandwidth floor, from the rows the benchmark printed.
matplotlib is an optional extra (`pip install onespec[plot]`)."""
from __future__ import annotations

import importlib.util

INSTALL_HINT = "--plot needs matplotlib: pip install 'onespec[plot]' (or pip install matplotlib)"


def check_matplotlib(error):
    """Calls error(message) before any work is done when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        error(INSTALL_HINT)


def series_label(row: dict) -> str:
    """plain, K=3 (a=2.5 when several forced lengths ran), auto."""
    if row["k"] == 0:
        return "plain"
    name = "auto" if row["k"] == "auto" else f"K={row['k']}"
    if row.get("forced_acceptance_rates") is None and row.get("forced_acceptance_length"):
        name += f" a={row['forced_acceptance_length']:g}"
    return name


def throughput_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{label: [(batch, tok/s)]} of the onespec rows, plus 'plain at the bandwidth floor': the
    tok/s a plain step moving only its floor bytes would reach."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row.get("engine") != "onespec" or "error" in row:
            continue
        out.setdefault(series_label(row), []).append((row["batch"], row["tok_s"]))
        if row["k"] == 0:
            floor = row["batch"] / row["floor_ms"] * 1e3
            out.setdefault("plain at the bandwidth floor", []).append((row["batch"], floor))
    return {name: sorted(points) for name, points in out.items()}


def plot_throughput(rows: list[dict], path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in throughput_series(rows).items():
        style = dict(linestyle="--", color="grey") if name.endswith("bandwidth floor") else \
            dict(linewidth=2.5, color="black") if name.startswith("auto") else {}
        ax.plot(*zip(*points), marker="o", label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
