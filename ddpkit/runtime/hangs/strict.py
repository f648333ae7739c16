"""Strict mode (``DDPKIT_CHECK_COLLECTIVES=1``): compare each collective across ranks before it runs.

A collective that would not hang can still be wrong: two ranks reducing same-sized tensors from
different lines, or with different reductions, mix unrelated values, silently. Here every rank
publishes (op, reduction, dtype, shape, call site) for (group, sequence number) and reads the other
members' before the collective runs, so the first difference raises on every rank, naming both
sides. It costs a few store round trips per collective (see the README), which is why it is opt-in.
"""
from __future__ import annotations

import torch.distributed as dist

from ddpkit.errors import CollectiveMismatchError, explain
from ddpkit.runtime.hangs.callsite import format_site
from ddpkit.runtime.hangs.recorder import GroupLog, Record
from ddpkit.runtime.hangs.report import issued_by, rank_list

__all__ = ["StrictCheck"]

_JOIN_HINT = ("a forward inside 'with model.join():' first all-reduces the count of ranks still active "
              "(torch's Join), which a rank outside it does not: enter the join context on every rank, "
              "around the same loop.")


def _issuer(signature: str) -> str | None:
    """Who issued the collective a signature describes, as ``(issued by ...)`` names it."""
    start = signature.find(" (issued by ")
    return None if start < 0 else signature[start + 12: signature.index(")", start)]


class StrictCheck:
    """The recorder's ``before`` hook; ``store`` is used from the calling thread only."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank

    def __call__(self, log: GroupLog, record: Record) -> None:
        key = f"check/{log.name}/{{}}/{{}}"
        mine = f"{record.op} {record.what()}{issued_by(record.via)} at {format_site(record.site)}".replace("  ", " ")
        self.store.set(key.format(record.seq, self.rank), mine)
        keys = [key.format(record.seq, r) for r in log.ranks]
        self.store.wait(keys)
        theirs = dict(zip(log.ranks, (v.decode() for v in self.store.multi_get(keys))))
        if record.seq > 1:  # every member has read it: each published this seq only after that
            self.store.delete_key(key.format(record.seq - 1, self.rank))
        if len(set(theirs.values())) > 1:
            sides: dict[str, list[int]] = {}
            for r, sig in theirs.items():
                sides.setdefault(sig, []).append(r)
            ordered = sorted(sides.items(), key=lambda kv: min(kv[1]))
            listed = "; ".join(f"{rank_list(rs)}: {sig}" for sig, rs in ordered)
            where = "the default group" if log.default else f"group {log.ranks}"
            calls = {(sig.split(" ", 1)[0], _issuer(sig), sig.rsplit(" at ", 1)[-1]) for sig in sides}
            reduces = record.reduction is not None
            hint = (f"the same call on every rank, with other tensors: {record.op} needs the same shape and dtype on "
                    f"every rank{', and the same op (none shown: sum)' if reduces else ''}; make them agree, e.g. "
                    + ("pad to the largest size, or use ddpkit.all_gather, whose first dimensions may differ."
                       if reduces else "send the shape first and allocate the tensor from it on every rank.")
                    if len(calls) == 1 else _JOIN_HINT if any(_issuer(sig) == "torch's Join" for sig in sides) else
                    "every rank must call the same collectives in the same order, from the same line.")
            raise CollectiveMismatchError(explain(
                f"the ranks disagree at collective #{record.seq} of {where}: {listed}.", hint,
                who="ddpkit", rank=self.rank),
                rank=self.rank, seq=record.seq, group=log.ranks, by_rank=theirs)
