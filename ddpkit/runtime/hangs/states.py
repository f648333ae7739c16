"""What one rank's published state says: the collective it waits in (one the recorder numbered, one it
never saw, or a point-to-point call), why a rank that did not answer is missing, and a state line's
verb when several ranks share it; and across ranks, how a list of them is written and the first
collective of a group their histories show called from different places. The report
(``report.py``) puts these together.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["first_waiting", "waiting_in", "unrecorded", "kind", "blocked_in_p2p", "p2p_call", "unmatched_send",
           "missing_sentence", "plural", "rank_list", "divergence"]


def first_waiting(state: dict[str, Any]) -> tuple[dict, dict] | None:
    """The oldest outstanding collective of a rank and its group, or None when it waits in none."""
    found = [(item, group) for group in state["groups"] for item in group["waiting"]]
    return max(found, key=lambda pair: pair[0]["age"]) if found else None


def waiting_in(state: dict[str, Any], name: str) -> dict | None:
    for group in state["groups"]:
        if group["name"] == name and group["waiting"]:
            return min(group["waiting"], key=lambda item: item["seq"])
    return None


# torch's collectives, as the innermost frame of a rank blocked in one (point-to-point calls apart)
_C10D_CALL = re.compile(r"distributed_c10d\.py:\d+ in (\w+)\(\)$")
_KINDS = {  # torch's collectives by what they can match on the wire: an object's is its tensor one's
    "all_reduce": "all_reduce", "broadcast": "broadcast", "broadcast_object_list": "broadcast",
    "barrier": "barrier", "monitored_barrier": "barrier", "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_object": "all_gather", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "gather": "gather", "gather_object": "gather", "scatter": "scatter", "scatter_object_list": "scatter",
    "reduce": "reduce"}


def kind(op: str) -> str:
    """What a collective can match on another rank (``broadcast_object_list`` broadcasts)."""
    return _KINDS.get(op, op)


def unrecorded(state: dict[str, Any]) -> str | None:
    """The torch collective a rank that waits in no recorded one is blocked in: one called through a
    reference taken before ``ddpkit.init()`` wrapped it (``from torch.distributed import barrier``)."""
    if first_waiting(state) is not None:
        return None
    found = _C10D_CALL.search(state.get("top") or "")
    return found.group(1) if found and found.group(1) in _KINDS else None


def blocked_in_p2p(state: dict[str, Any]) -> str | None:
    """"recv" or "send" when the rank's innermost frame is torch's blocking point-to-point call, which
    the recorder does not number (its peer, not its group, must match it)."""
    found = _C10D_CALL.search(state.get("top") or "")
    return found.group(1) if found and found.group(1) in ("recv", "send") else None


def p2p_call(state: dict[str, Any], op: str) -> str:
    """``send() to rank 1 with tag 2``, as far as the rank's published call says (``op()`` alone
    where it says nothing)."""
    call = state.get("p2p")
    if not call or call.get("op") != op:
        return f"{op}()"
    peer = "any rank" if call.get("peer") is None else f"rank {call['peer']}"
    tag = "" if call.get("tag") is None else f" with tag {call['tag']}"
    return f"{op}() {'to' if op == 'send' else 'from'} {peer}{tag}"


def unmatched_send(answers: dict[int, dict], rank: int) -> str | None:
    """Why ``rank``'s blocking send can never be received, or None where it may be (its destination
    receives it, or computes and may yet, an async collective of its outstanding or not): the
    destination is blocked in a collective of a group that needs this rank too, sends to this rank,
    or receives from it with another tag."""
    call = answers[rank].get("p2p") or {}
    peer = call.get("peer")
    if call.get("op") != "send" or peer not in answers:
        return None
    theirs = answers[peer].get("p2p")
    if theirs is None:
        blocked = [item for group in answers[peer]["groups"] if rank in group["ranks"] for item in group["waiting"]
                   if item.get("blocking") and not item.get("error")]
        return f"rank {peer} waits in {blocked[0]['op']} #{blocked[0]['seq']}, which needs rank {rank} too" \
            if blocked else None
    if theirs["op"] == "send" and theirs.get("peer") == rank:
        return f"rank {peer} waits in {p2p_call(answers[peer], 'send')} as well"
    tags = (call.get("tag"), theirs.get("tag"))
    if theirs["op"] == "recv" and theirs.get("peer") in (rank, None) and None not in tags and tags[0] != tags[1]:
        return f"rank {peer} waits in {p2p_call(answers[peer], 'recv')}"
    return None


def missing_sentence(rank: int, info: dict[str, Any], answer_seconds: float) -> str:
    final = info.get("final")
    if final:
        if final["how"] == "hang":
            return (f"rank {rank} has ended with exit code {final['code']} after a report of a certain deadlock "
                    f"(it waited in {final['where']})")
        if final["how"] == "exception":
            return f"rank {rank} has exited after an uncaught {final['error']} at {final['where']}"
        if final["how"] == "shutdown":
            return f"rank {rank} has left the job: it called ddpkit.shutdown() at {final['where']}"
        how = f"it called {final['error']}" if final.get("error") else "its script ended or called sys.exit()"
        return (f"rank {rank} has exited without ddpkit.shutdown(): {how} while other ranks still needed it "
                f"(its last collective: {final['where']})")
    pid = f"pid {info['pid']} on {info['host']}" if info.get("pid") else "pid unknown"
    if info.get("parent_exited"):  # which died first cannot be told from here
        return (f"rank {rank} ({pid}) has died without a word, and the process that started it (pid "
                f"{info['parent']}) is gone too: its launcher was killed (ddpkit run and torchrun take their "
                "workers with them), or the rank was killed (SIGKILL: out of memory?) and a wrapper script "
                "that ran it ended with it")
    if info.get("exited"):
        return (f"rank {rank} ({pid}) has died without a word: killed by a signal (SIGKILL: out of "
                "memory?), a crash in native code (Gloo aborts a rank whose collective receives another size "
                "than its own tensor's: the ranks' tensors may differ), or os._exit")
    if info.get("stopped") == "stopped":
        return (f"rank {rank} ({pid}) did not answer within {answer_seconds:.0f} s: its process is stopped "
                f"(SIGSTOP, or Ctrl-Z in its shell); it goes on after 'kill -CONT {info['pid']}'")
    if info.get("stopped") == "traced":
        return (f"rank {rank} ({pid}) did not answer within {answer_seconds:.0f} s: a debugger holds its "
                "process (a breakpoint, or gdb/py-spy attached); it goes on when the debugger lets it")
    if info.get("exited") is False:
        return (f"rank {rank} ({pid}) did not answer within {answer_seconds:.0f} s, yet its process lives: "
                "it is in a long call that holds Python's lock (native code, a big pickle or regex), or "
                "stuck in one")
    return (f"rank {rank} ({pid}) did not answer within {answer_seconds:.0f} s, and from another host this "
            "rank cannot tell whether its process lives: it may be in a long call that holds Python's "
            "lock, stuck, or gone")


def plural(line: str) -> str:
    """A state line said of several ranks: "wait in", "were in"."""
    for one, many in (("waits in ", "wait in "), ("was in ", "were in ")):
        if line.startswith(one):
            return many + line[len(one):]
    return line


def rank_list(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 2`` or ``ranks 0-6, 8-15``: consecutive ranks as ranges."""
    ranks = sorted(set(ranks))
    parts, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}, {r}" if r == start + 1 else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def divergence(groups_by_rank: dict[int, list[dict]], name: str, waiting_at: set[int]) -> tuple[int, str] | None:
    """The first collective of group ``name`` that the ranks called from different places. Where that
    is the one they wait in now (``waiting_at``), the history each rank keeps shows no earlier split:
    then where that history starts (seq 0)."""
    calls: dict[int, dict[int, tuple]] = {}
    for rank, rank_groups in groups_by_rank.items():
        for group in rank_groups:
            if group["name"] == name:
                calls[rank] = {i["seq"]: (i["op"], i["what"], i["site"]) for i in group["recent"] + group["waiting"]}
    if len(calls) < 2:
        return None
    common = set.intersection(*(set(c) for c in calls.values()))
    for seq in sorted(common):
        seen: dict[tuple, list[int]] = {}
        for rank, c in calls.items():
            seen.setdefault(c[seq], []).append(rank)
        if len(seen) > 1:
            first = min(common)
            if seq in waiting_at and 1 < first < seq:  # one rank's extra call may lie further back
                return 0, (f"the collectives #{first} to #{seq - 1}, as far back as each rank keeps them, were "
                           "called from the same places: if a rank called one the others did not, it was "
                           f"before #{first}.")
            sides = "; ".join(f"{rank_list(ranks)} {op} {what} at {site}".replace("  ", " ")
                              for (op, what, site), ranks in sorted(seen.items(), key=lambda kv: min(kv[1])))
            return seq, f"the first collective the ranks called from different places is #{seq}: {sides}."
    return None
