"""Plain-text tables and the small statistics the bench reports (median, quartiles, the median's
confidence interval)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["Table", "fmt_bytes", "median", "median_interval", "quantile", "ranks", "summarize"]


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile with linear interpolation (numpy's default), without numpy."""
    if not values:
        raise ValueError("quantile of no values.")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free ``confidence`` interval for the median of what ``values`` sample.

    The k-th smallest and the k-th largest of n values, with k the largest for which fewer than k
    values fall below the true median with probability at most (1 - confidence) / 2 (a binomial
    with p = 1/2; no assumption on the timings' distribution, which on a busy machine has a long
    tail). None where even their whole range falls short of ``confidence`` (fewer than 6 values
    for 95%, such as a ``--quick`` run's 3 rounds).
    """
    if not values:
        raise ValueError("median_interval of no values.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}.")
    ordered = sorted(values)
    n, tail = len(ordered), (1 - confidence) / 2
    below, k = 0.0, 0  # below: P(fewer than k + 1 values under the median)
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and extremes of repeated timings."""
    return {"median": median(values), "q1": quantile(values, 0.25), "q3": quantile(values, 0.75),
            "min": min(values), "max": max(values), "n": len(values)}


def ranks(n: int) -> str:
    """"1 rank", "2 ranks": a world size as the tables' titles say it."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def fmt_bytes(n: float) -> str:
    """Binary units, as message sizes are usually written: 4 KiB, 256 MiB, 1.5 GiB (one decimal,
    left out where it is 0, so that 781.02 KiB and 781 KiB read alike in one column)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f}".removesuffix(".0") + f" {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass
class Table:
    """A titled table of strings, rendered with aligned columns (numbers right-aligned)."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"row has {len(cells)} cells, table {self.title!r} has "
                             f"{len(self.headers)} columns.")
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
                  for i, h in enumerate(self.headers)]
        numeric = [all(_is_number(r[i]) for r in self.rows) and bool(self.rows)
                   for i in range(len(self.headers))]

        def line(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if num else c.ljust(w)
                             for c, w, num in zip(cells, widths, numeric)).rstrip()

        out = [self.title, "=" * len(self.title), line(self.headers),
               line(["-" * w for w in widths])]
        out += [line(r) for r in self.rows]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)


def _is_number(text: str) -> bool:
    head = text.split(" ")[0].rstrip("x%")
    try:
        float(head)
    except ValueError:
        return text in ("-", "n/a")
    return True
