"""Plots of a bench run: bus bandwidth against message size, and DDP step time per variant.

matplotlib is an optional extra (``pip install 'ddpkit[plot]'``) and is imported only here.
"""
from __future__ import annotations

from ddpkit.bench.report import ranks

__all__ = ["plot_results"]


def plot_results(results: dict, path: str) -> None:
    """Write a figure with one panel per available table (collectives, DDP step) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib. HINT: pip install 'ddpkit[plot]'.") from e
    panels = [k for k in ("collectives", "ddp_step", "ratios", "memory") if results.get(k)
              or (k == "ratios" and results.get("ddp_step", {}).get("ratios"))]
    if not panels:
        raise ValueError("nothing to plot: run the collectives, ddp or memory tables.")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    draw = {"collectives": lambda ax: _plot_bandwidth(ax, results["collectives"], results["meta"]),
            "ddp_step": lambda ax: _plot_steps(ax, results["ddp_step"]["rows"], results["meta"]),
            "ratios": lambda ax: _plot_ratios(ax, results["ddp_step"]["ratios"], results["meta"]),
            "memory": lambda ax: _plot_memory(ax, results["memory"], results["meta"])}
    for ax, panel in zip(axes[0], panels):
        draw[panel](ax)
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
    ax.set_title(f"collectives, {ranks(meta['world_size'])}, {meta['backend']}")
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
    ax.set_title(f"DDP step, {ranks(meta['world_size'])}, {meta['backend']}")
    ax.legend()


def _plot_ratios(ax, ratios: dict, meta: dict) -> None:
    """ddpkit/torch and ddpkit/floor per model: medians of the rounds' ratios, quartiles as bars."""
    models = list(ratios)
    for j, pair in enumerate(("ddpkit/torch", "ddpkit/floor", "torch/floor")):
        xs = [i + j * 0.27 for i, m in enumerate(models) if ratios[m].get(pair) is not None]
        got = [ratios[m] for m in models if ratios[m].get(pair) is not None]
        heights = [r[pair] for r in got]
        errs = [[r[pair] - r[f"{pair} q1"] for r in got], [r[f"{pair} q3"] - r[pair] for r in got]]
        ax.bar(xs, heights, 0.27, yerr=errs, capsize=3, label=pair, color=f"C{j}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.27 for i in range(len(models))], models, rotation=30)
    ax.set_ylim(0.6, 1.4)
    ax.set_ylabel("step-time ratio, median and quartiles")
    ax.set_title(f"ratios, {ranks(meta['world_size'])}")
    ax.legend()


def _plot_memory(ax, rows: list[dict], meta: dict) -> None:
    """Peak memory above the start, per model, for each DDP with and without bucket views."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    series = [(impl, view) for impl in ("ddpkit", "torch") for view in (False, True)]
    width = 0.8 / len(series)
    for j, (impl, view) in enumerate(series):
        by = {r["model"]: r["peak_bytes"] for r in rows if r["impl"] == impl and r["gradient_as_bucket_view"] == view}
        xs = [i + j * width for i, m in enumerate(models) if m in by]
        ax.bar(xs, [by[m] / 2**20 for m in models if m in by], width, color=f"C{j}",
               label=f"{impl}, {'view' if view else 'no view'}")
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(models))], models, rotation=30)
    ax.set_ylabel("peak memory delta (MiB)")
    ax.set_title(f"memory, {ranks(meta['world_size'])}")
    ax.legend()
