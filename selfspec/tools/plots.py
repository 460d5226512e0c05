"""The benchmark's picture: speed-up per category per method (one panel per dtype), and accepted-length histograms;
and the serve load test's: total tokens/s and p95 latency against concurrent clients (``plot_load``).

Drawn on a matplotlib ``Figure`` with the Agg canvas directly, so importing this module never changes the global
matplotlib backend and needs no display.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from selfspec.tools.specbench import Summary


LEGEND_CHARS = 150
"""characters of legend labels one line under a speed-up panel holds (its width, 10.5 of the figure's 14 inches, in
matplotlib's "small" font)."""


def plot_summary(summary: Summary, path: str | Path) -> Path:
    """Row per dtype: left, grouped bars of speed-up over plain decoding per category; right, accept-length histogram."""
    dtypes = list(dict.fromkeys(r.dtype for r in summary.rows))
    methods = list(dict.fromkeys(r.method for r in summary.rows))
    categories = list(dict.fromkeys(r.category for r in summary.rows if r.category != "overall")) + ["overall"]
    cell = {(r.method, r.dtype, r.category): r for r in summary.rows}
    # the legend under each panel: as many columns as its longest label leaves room for (a llama.cpp method's label
    # runs to ~80 characters), and the figure taller by its rows, else constrained layout collapses the axes
    columns = max(1, min(len(methods), 3, LEGEND_CHARS // (max(map(len, methods), default=1) + 6)))
    legend_rows = -(-len(methods) // columns)
    fig = Figure(figsize=(14, (5.2 + 0.25 * legend_rows) * len(dtypes)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(dtypes), 2, squeeze=False, width_ratios=(3, 1))
    width = 0.8 / max(len(methods), 1)
    color = {m: f"C{j % 10}" for j, m in enumerate(methods)}  # one colour per method in both panels
    sampling = summary.meta.get("sampling")
    how = "greedy" if sampling is None else f"sampled at temperature {sampling['temperature']:g}"
    for row, dtype in enumerate(dtypes):
        bars, hist = axes[row]
        for j, method in enumerate(methods):
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(categories))]
            ys = [cell[(method, dtype, c)].speedup if (method, dtype, c) in cell else 0.0 for c in categories]
            bars.bar(xs, ys, width=width, label=method, color=color[method])
        drafted = [m for m in methods if m != "plain" and summary.accept_lengths.get(f"{m}/{dtype}")]
        if drafted:
            data = [summary.accept_lengths[f"{m}/{dtype}"] for m in drafted]
            top = max(max(d) for d in data)
            weights = [[1 / len(d)] * len(d) for d in data]  # share of the method's steps
            hist.hist(data, bins=range(1, top + 2), weights=weights, label=drafted, align="left",
                      color=[color[m] for m in drafted])
            hist.set_xticks(range(1, top + 1))  # no legend: the colours are the left panel's (a legend hid the bars)
        bars.axhline(1.0, color="black", linewidth=0.8)
        bars.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
        bars.set_ylabel(f"speed-up over plain ({dtype})")
        bars.set_title(f"{dtype}, {how}: speed-up per category")
        bars.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=columns,
                    frameon=False)  # below the categories: inside, it hid the bars
        hist.set_xlabel("tokens accepted per target forward")
        hist.set_ylabel("share of steps")
        hist.set_title(f"{dtype}: accepted lengths")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_load(rows: list[dict], path: str | Path) -> Path:
    """``infer.py serve-load``'s rows -> left, total tokens/s against concurrent clients; right, p95 latency; one line
    per draft and server."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    speed, wait = fig.subplots(1, 2)
    lines = list(dict.fromkeys((r["draft"], r["server"]) for r in rows))
    for j, (draft, server) in enumerate(lines):
        mine = sorted((r for r in rows if (r["draft"], r["server"]) == (draft, server)), key=lambda r: r["clients"])
        style = dict(color=f"C{j % 10}", marker="o", linestyle={"batching": "-", "one at a time": "--"}.get(server, ":"),
                     label=f"{draft}, {server}")
        speed.plot([r["clients"] for r in mine], [r["tokens_per_s"] for r in mine], **style)
        wait.plot([r["clients"] for r in mine], [r["p95_s"] for r in mine], **style)
    speed.set(xlabel="concurrent clients", ylabel="total tokens/s", title="throughput")
    wait.set(xlabel="concurrent clients", ylabel="p95 latency per request (s)", title="waiting")
    for ax in (speed, wait):
        ax.set_xticks(sorted({r["clients"] for r in rows}))
        ax.grid(alpha=0.3)
    speed.legend(fontsize=8)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
