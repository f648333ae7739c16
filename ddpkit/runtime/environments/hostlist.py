"""SLURM's compact lists: hostlists (``"gpu-[01-03,07],cpu5"``) and tasks per node (``"2(x3),1"``).

SLURM writes both in a compressed grammar; the SLURM reader needs them one entry per node, to take
the first host as the default MASTER_ADDR and each node's task count. The grammar stands on its own
(``expand_hostlist`` is public and tested directly), so it lives apart from ``slurm.py``.
"""
from __future__ import annotations

import re

from ddpkit.errors import LauncherVariableError, explain

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

_HOSTLIST_HINT = "write it as SLURM does, e.g. 'gpu-[01-03,07],cpu5', or let sbatch/srun set it."


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist: ``"gpu-[01-03,07],cpu5"`` -> gpu-01, gpu-02, gpu-03, gpu-07, cpu5.

    Zero padding is kept, several bracket groups in one name multiply out (``"n[1-2]-ib[0-1]"``), and
    duplicates are kept in order, as ``scontrol show hostnames`` does.
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist):
        hosts += _expand_one(name, hostlist)
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in hostlist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(explain(f"SLURM hostlist {hostlist!r} has a ']' without its '['.",
                                         _HOSTLIST_HINT))
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(explain(f"SLURM hostlist {hostlist!r} has a '[' without its ']'.", _HOSTLIST_HINT))
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str, hostlist: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", name)
    if match is None:
        return [name]
    prefix, suffix = name[: match.start()], name[match.end():]
    expanded = []
    for item in match.group(1).split(","):
        item = item.strip()
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if bounds is None:
            raise ValueError(explain(f"SLURM hostlist {hostlist!r}: range {item!r} is not N or N-M.",
                                     _HOSTLIST_HINT))
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            raise ValueError(explain(f"SLURM hostlist {hostlist!r}: range {item!r} runs backwards.",
                                     _HOSTLIST_HINT))
        width = len(low)
        for number in range(int(low), int(high) + 1):
            for tail in _expand_one(suffix, hostlist):
                expanded.append(f"{prefix}{number:0{width}d}{tail}")
    return expanded


def expand_tasks_per_node(name: str, text: str) -> list[int]:
    """Read a tasks-per-node variable such as ``"2(x3),1"`` into one count per node: [2, 2, 2, 1].

    ``name`` is the variable the text came from, for the error message.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", part)
        if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise LauncherVariableError(
                explain(f"{name}={text!r} is not in SLURM's format: positive task counts such as '4' or "
                        "'2(x3),1'.", "unset it, or let sbatch/srun set it."), variable=name, value=text)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
