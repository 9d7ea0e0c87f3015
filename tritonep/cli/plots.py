"""PNG load plots of ``tritonep run --plot`` and ``tritonep plan --plot`` (matplotlib, no display needed).

Readable at a glance: a title that wraps instead of being cut, the legend outside the axes (never over the bars),
'before' and 'after' balancing side by side on a shared y axis, and a dashed line at the mean (perfect balance).
"""

from __future__ import annotations

import textwrap

__all__ = ["grouped_loads"]


def grouped_loads(groups: list[str], panels: list[tuple[str, list[list[float]]]], series: list[str], path: str,
                  title: str, xlabel: str, ylabel: str, mean: str = "group") -> None:
    """Bar panels side by side (shared y axis), one bar per (group, series); writes a PNG to ``path``.

    Args:
        groups: x tick labels (e.g. layers, or ranks).
        panels: ``[(panel title, values)]`` with ``values[g][s]`` the bar of group g, series s (e.g. routes of rank s
            at layer g). Every panel has ``len(groups)`` rows of ``len(series)`` values.
        series: labels of the bars within a group (e.g. ``["rank 0", ...]``); with one series the bars carry no
            legend entry.
        path: the PNG file. title: figure title (wrapped to the figure width). xlabel, ylabel: axis labels.
        mean: ``"group"``: a dashed line over each group at the mean of its bars; ``"panel"``: one dashed line at
            the mean of all bars of a panel.

    Raises:
        ValueError: panels whose shapes do not match ``groups`` x ``series``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    G, S = len(groups), len(series)
    for name, vals in panels:
        if len(vals) != G or any(len(v) != S for v in vals):
            raise ValueError(f"panel {name!r}: values must be {G} groups x {S} series")
    width_in = min(22.0, max(4.5, 0.35 * G * max(S, 2) + 1.5)) * len(panels) / max(1, len(panels) ** 0.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(width_in, 4.2), sharey=True, squeeze=False)
    bw = 0.8 / S
    colors = plt.get_cmap("tab10" if S <= 10 else "viridis")
    handles = None
    for ax, (name, vals) in zip(axes[0], panels):
        bars = []
        for s in range(S):
            c = colors(s % 10) if S <= 10 else colors(s / max(S - 1, 1))
            bars.append(ax.bar([g - 0.4 + bw * (s + 0.5) for g in range(G)], [vals[g][s] for g in range(G)], bw,
                               color=c, label=series[s]))
        mline = None
        if mean == "group":
            for g in range(G):
                m = sum(vals[g]) / max(S, 1)
                mline = ax.hlines(m, g - 0.45, g + 0.45, colors="black", linestyles="dashed", linewidth=1.0,
                                  label="mean (perfect balance)")
        else:
            allv = [v for row in vals for v in row]
            mline = ax.axhline(sum(allv) / max(len(allv), 1), color="black", linestyle="dashed", linewidth=1.0,
                               label="mean (perfect balance)")
        ax.set_xticks(range(G), groups)
        ax.set_xlabel(xlabel)
        ax.set_title(name, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        handles = (bars if S > 1 else []) + ([mline] if mline is not None else [])
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle("\n".join(textwrap.wrap(title, width=max(40, int(width_in * 11)))), fontsize=11)
    fig.legend(handles, [h.get_label() for h in handles], loc="center left", bbox_to_anchor=(1.0, 0.5),
               fontsize=8, frameon=False, ncol=1 if len(handles) <= 17 else 2)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # "tight" keeps the outside legend and the title in the image
    plt.close(fig)
