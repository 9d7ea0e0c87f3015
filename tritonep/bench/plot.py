"""PNG of bandwidth vs tokens per rank for benchmark rows (matplotlib, no display needed)."""

from __future__ import annotations

__all__ = ["plot_gbps_vs_tokens"]


def plot_gbps_vs_tokens(rows: list[dict], path: str, key: str = "nvlink_gbps", title: str = "") -> int:
    """Draw ``key`` (GB/s) against ``tokens`` per rank, one line per (op, num_sms); write a PNG to ``path``.

    The legend sits outside the axes (right), so it never covers a line; the image is cropped to its contents.

    Args:
        rows: benchmark rows of :func:`tritonep.bench.ep.bench_ep` (need ``op``, ``tokens``, ``num_sms``, ``key``).
        path: output PNG file. key: ``"nvlink_gbps"`` or ``"logical_gbps"``. title: figure title (default: what
            is plotted).

    Returns:
        the number of lines drawn.

    Raises:
        ValueError: no row carries ``key`` and ``tokens``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict = {}
    for r in rows:
        if key not in r or "tokens" not in r:
            continue
        series.setdefault((r["op"], r.get("num_sms", 0)), []).append((r["tokens"], r[key]))
    if not series:
        raise ValueError(f"no benchmark row has {key!r} and 'tokens'")
    fig, ax = plt.subplots(figsize=(8, 5))
    for (op, sms), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{op} ({sms or 'all'} SMs)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(f"{key.replace('_gbps', '')} GB/s")
    ax.grid(True, alpha=0.3)
    ax.set_title(title or f"{key.replace('_gbps', '')} GB/s vs tokens per rank", fontsize=11)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return len(series)
