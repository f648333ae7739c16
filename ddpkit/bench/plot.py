"""Plots of a bench run: bus bandwidth against message size, and DDP step time per variant.

matplotlib is an optional extra (``pip install 'ddpkit[plot]'``) and is imported only here.
"""
from __future__ import annotations

__all__ = ["plot_results"]


def plot_results(results: dict, path: str) -> None:
    """Write a figure with one panel per available table (collectives, DDP step) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib. HINT: pip install 'ddpkit[plot]'.") from e
    panels = [k for k in ("collectives", "ddp_step") if results.get(k)]
    if not panels:
        raise ValueError("nothing to plot: run the collectives or ddp tables.")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "collectives":
            _plot_bandwidth(ax, results["collectives"], results["meta"])
        else:
            _plot_steps(ax, results["ddp_step"]["rows"], results["meta"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_bandwidth(ax, rows: list[dict], meta: dict) -> None:
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        ax.plot([r["bytes"] for r in mine], [r["busbw"] / 1e9 for r in mine], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"collectives, {meta['world_size']} ranks, {meta['backend']}")
    ax.grid(True, alpha=0.3)
    ax.legend()


def _plot_steps(ax, rows: list[dict], meta: dict) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    for j, variant in enumerate(variants):
        xs, heights, errs = [], [], [[], []]
        for i, model in enumerate(models):
            r = next(r for r in rows if r["model"] == model and r["variant"] == variant)
            if not r["available"]:
                continue
            xs.append(i + j * width)
            heights.append(r["median"] * 1e3)
            errs[0].append((r["median"] - r["q1"]) * 1e3)
            errs[1].append((r["q3"] - r["median"]) * 1e3)
        # a fixed colour per variant, so an unavailable one does not shift the others' colours
        ax.bar(xs, heights, width, yerr=errs, capsize=3, label=variant, color=f"C{j}")
    ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(models))], models)
    ax.set_ylabel("step time (ms), median and IQR")
    ax.set_title(f"DDP step, {meta['world_size']} ranks, {meta['backend']}")
    ax.legend()
