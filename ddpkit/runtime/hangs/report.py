"""The hang report: from what every rank said (or did not say) to text and a verdict.

A pure function of the ranks' states, so that every wording is unit-tested in one process. A state is
what ``snapshot()`` publishes: per process group, the collectives still outstanding and the last ones
done, and where the main thread is. The verdict is *certain* when no rank can ever move on: a rank has
exited or does not answer, or the members of a group all wait and disagree, or every rank waits and no
group's collective can complete. Otherwise the job may still go on (a slow rank), and it does.
"""
from __future__ import annotations

import re
from typing import Any

from ddpkit.runtime.hangs.states import (
    blocked_in_p2p,
    divergence,
    first_waiting,
    kind,
    missing_sentence,
    p2p_call,
    plural,
    rank_list,
    unmatched_send,
    unrecorded,
    waiting_in,
)

__all__ = ["build_report", "rank_list", "Report", "RULE", "HEADER", "HANDLED", "ISSUERS", "issued_by"]

Report = dict  # {"text": str, "certain": bool, "picture": str, "peer_gone": bool}
RULE = "=" * 78
"""The line above and below a report (the launcher's summary finds a report by it and ``HEADER``)."""
HEADER = "ddpkit hang report ("
HANDLED = "ddpkit: this rank was handling the exception below when the deadlock ended it"
"""The line before the traceback a rank prints when a deadlock ends it inside an except: or finally: block."""
ISSUERS = ("DDP", "SyncBatchNorm", "torch's Join")
"""The parts of ddpkit a collective is said to be issued by (``via``); the innermost one on the way wins."""


# the hints for a rank whose data ran out first, and for ddpkit.save called on some ranks only
def _uneven(whose_data: str) -> str:
    """The hint for ranks whose data ran out first: ``whose_data`` is "rank 1's data" or the like."""
    return (f"{whose_data} ran out first (ranks with different numbers of batches), train under 'with "
            "model.join():' or give every rank as many batches (DistributedSampler(..., drop_last=True))")


_SAVE = "ddpkit.save is a collective (rank 0 writes, the others wait):"


def issued_by(via: str | None) -> str:
    """`` (issued by DDP)`` for a collective one of ``ISSUERS`` issued, else nothing: as the report
    and strict mode both name it."""
    return f" (issued by {via})" if via in ISSUERS else ""


def _group_name(group: dict[str, Any]) -> str:
    return "the default group" if group["default"] else f"group {group['ranks']}"


def _op(item: dict[str, Any]) -> str:
    return f"{item['op']} #{item['seq']}"


def _call(item: dict[str, Any]) -> str:
    """``all_reduce #5 float32[10] at train.py:8 in step()`` (and DDP's, and a failure)."""
    text = f"{_op(item)} {item['what']}".rstrip() + f" at {item['site']}"
    if item.get("via") in ISSUERS:
        text += issued_by(item["via"])
    elif item.get("via"):
        text += f" (in ddpkit's {item['via']}())"
    if item.get("error"):
        text += f", which failed: {item['error']}"
    return text


# the innermost frame of a rank inside backward(), in the autograd engine's call
_IN_BACKWARD = re.compile(r"torch[/\\]autograd[/\\](graph|__init__)\.py:\d+ in (_engine_run_backward|backward)\(\)$")


def _where(state: dict[str, Any]) -> str:
    where = state.get("where") or "an unknown place"
    top = state.get("top")
    if top and _IN_BACKWARD.search(top):  # torch's own DDP reduces there, from C++, unrecorded
        return (f"{where}, inside backward() (if torch's own DistributedDataParallel wraps the model, its "
                "all-reduces run there from C++, which ddpkit does not record: this rank may wait in one)")
    return where if not top or top == where else f"{where} (innermost: {top})"


def _state_lines(answers: dict[int, dict]) -> tuple[list[str], str]:
    """One line per distinct state, ranks grouped; and the picture (the lines without ages)."""
    lines: dict[str, list[int]] = {}
    ages: dict[str, float] = {}
    for rank, state in answers.items():
        waiting = first_waiting(state)
        unseen = unrecorded(state) if waiting is None else None
        if unseen:
            line = f"waits in torch.distributed.{unseen}(), which ddpkit does not record; at {_where(state)}"
        elif waiting is None:
            line = f"in no collective; at {_where(state)}"
        else:
            item, group = waiting
            line = f"{'was' if item.get('error') else 'waits'} in {_call(item)} [{_group_name(group)}]"
        if state.get("handling"):
            line += f", while handling {state['handling']}"
        for dead in state.get("dead_threads") or ():
            line += f"; its {dead}"
        if waiting is not None:
            ages[line] = max(ages.get(line, 0.0), waiting[0]["age"])
        lines.setdefault(line, []).append(rank)
    text = [f"  {rank_list(ranks)}: {plural(line) if len(ranks) > 1 else line}"
            + (f", for {ages[line]:.1f} s" if line in ages else "")
            for line, ranks in sorted(lines.items(), key=lambda kv: min(kv[1]))]
    picture = "\n".join(f"{rank_list(ranks)}: {line}" for line, ranks in sorted(lines.items()))
    return text, picture


def _judge(answers: dict[int, dict], missing: dict[int, dict], answer_seconds: float) -> tuple[list[str], bool]:
    sentences: list[str] = []
    certain = False
    groups = {g["name"]: g for s in answers.values() for g in s["groups"]}
    for info in missing.values():
        for group in info.get("final", {}).get("groups", []) if info.get("final") else []:
            groups.setdefault(group["name"], group)
    waiting_groups = {g: groups[g] for g in groups if any(waiting_in(s, g) for s in answers.values())}
    busy = [r for r, s in answers.items() if first_waiting(s) is None]
    known = {r: s["groups"] for r, s in answers.items()}
    known.update({r: info["final"].get("groups", []) for r, info in missing.items() if info.get("final")})
    for rank, info in sorted(missing.items()):
        sentence = missing_sentence(rank, info, answer_seconds)
        waiting = [r for r in answers if first_waiting(answers[r])]
        if waiting:
            item = first_waiting(answers[min(waiting)])[0]
            one = len(waiting) == 1
            verb = ("was" if one else "were") if item.get("error") else ("waits" if one else "wait")
            sentence += f"; {rank_list(waiting)} {verb} in {_op(item)} ({item['site']})"
            left = (info.get("final") or {}).get("how") in ("exit", "shutdown")  # done, not failed
            if left and item.get("via") == "DDP":
                sentence += ": if " + _uneven(f"rank {rank}'s data")
            elif left and item.get("via") == "save":
                sentence += f": {_SAVE} call it on every rank, not under 'if rank == 0:'"
        sentences.append(sentence + ".")
        # a rank busy in a call that holds the GIL cannot answer either: only one known gone is certain
        certain = certain or bool(info.get("final") or info.get("exited"))
    perhaps_busy = [r for r, info in missing.items() if not (info.get("final") or info.get("exited"))]
    can_complete = False
    for name, group in sorted(waiting_groups.items()):
        members = [r for r in group["ranks"] if r in answers]
        items = {r: waiting_in(answers[r], name) for r in members}
        waiters = [r for r in members if items[r] is not None]
        signatures: dict[tuple, list[int]] = {}
        for r in waiters:
            it = items[r]
            signatures.setdefault((it["seq"], it["op"], it["what"]), []).append(r)
        absent = [r for r in members if items[r] is None]
        where = f" of {_group_name(group)}" if not group["default"] else ""
        if len(signatures) > 1:
            seqs = sorted({sig[0] for sig in signatures})
            at = f"#{seqs[0]}" if len(seqs) == 1 else "their next collective"
            sides = ", ".join(f"{rank_list(rs)} {_call(items[rs[0]])}"
                              for sig, rs in sorted(signatures.items(), key=lambda kv: min(kv[1])))
            sentences.append(f"the ranks disagree at {at}{where}: {sides}.")
            ddp = [r for r in waiters if items[r].get("via") == "DDP"]
            if ddp and len(ddp) < len(waiters):  # the others moved on to a collective the rest never reach
                others = [r for r in waiters if r not in ddp]
                short, call = rank_list(others), "calls" if len(others) == 1 else "call"
                lead = (f"{_SAVE} if {short} alone {call} it" if any(items[r].get("via") == "save" for r in waiters)
                        else f"if {short} alone {call} that one")
                sentences.append(f"{lead} (under 'if rank == 0:', say), call it on every rank. If the "
                                 f"{_uneven(f'data of {short}')}.")
            if not absent and not [r for r in group["ranks"] if r in missing]:
                certain = True
        elif not absent and not [r for r in group["ranks"] if r in missing]:
            can_complete = True
            item = items[waiters[0]]
            sentences.append(f"{rank_list(waiters)} all wait in {_op(item)}{where} ({item['site']}) and agree: "
                             "the collective itself is slow or stuck (network, GPU, or a peer's send/recv).")
        for r in absent:
            item = items[waiters[0]] if waiters else None
            if item is None:
                continue
            elsewhere = first_waiting(answers[r])
            if elsewhere is None:
                op = unrecorded(answers[r])
                state = (f"it waits in torch.distributed.{op}() instead, at {answers[r].get('where')}" if op
                         else f"it is at {_where(answers[r])}")
            else:
                state = f"it waits in {_call(elsewhere[0])} of {_group_name(elsewhere[1])} instead"
            sentences.append(f"rank {r} has not reached {_op(item)}{where} ({item['site']}) that "
                             f"{rank_list(waiters)} wait{'s' if len(waiters) == 1 else ''} in; {state}.")
        waiting_at = {sig[0] for sig in signatures}
        hint = divergence(known, name, waiting_at) if (absent or len(signatures) > 1 or missing) else None
        if hint and not (len(signatures) > 1 and {hint[0]} == waiting_at):
            sentences.append(hint[1])
    if not busy and not can_complete and waiting_groups and not perhaps_busy:
        certain = True
    receiving = [r for r in busy if blocked_in_p2p(answers[r]) == "recv"]
    # a rank in send may be in the middle of a long transfer, unless its destination cannot take it
    stuck = {r: why for r in busy if blocked_in_p2p(answers[r]) == "send" and (why := unmatched_send(answers, r))}
    for r, why in stuck.items():
        sentences.append(f"rank {r} waits in {p2p_call(answers[r], 'send')} at {_where(answers[r])}, which is never "
                         f"received: {why}.")
    if (receiving or stuck) and len(receiving) + len(stuck) == len(busy) and not can_complete and not perhaps_busy:
        # one in recv waits for a rank that is itself waiting in a collective, a recv or such a send,
        # so nothing will ever be sent
        elsewhere = "a collective, a recv or a send never received" if stuck else "a collective or a recv"
        one, others = len(receiving) == 1, (f"every other rank waits in {elsewhere}" if len(receiving) < len(answers)
                                            else "so does every other rank")
        if receiving:
            call = p2p_call(answers[receiving[0]], "recv") if one else "recv()"
            sentences.append(f"{rank_list(receiving)} wait{'s' if one else ''} in {call} "
                             f"at {_where(answers[receiving[0]])}, a point-to-point call, and {others}: no rank is "
                             "left to send.")
        certain = True
    certain = _judge_unrecorded(answers, busy, sentences, can_complete or bool(perhaps_busy)) or certain
    return sentences, certain


def _judge_unrecorded(answers: dict[int, dict], busy: list[int], sentences: list[str], may_move: bool) -> bool:
    """Ranks blocked in a collective the recorder never saw: said so, and certain when every other
    rank waits in a recorded collective (or a recv) of another kind, which theirs can never match."""
    blocked = {r: op for r in busy if (op := unrecorded(answers[r]))}
    if not blocked:
        return False
    recorded = {item["op"] for state in answers.values() for group in state["groups"] for item in group["waiting"]}
    by_op: dict[str, list[int]] = {}
    for r, op in blocked.items():
        by_op.setdefault(op, []).append(r)
    for op, ranks in sorted(by_op.items(), key=lambda kv: min(kv[1])):
        one = len(ranks) == 1
        sentences.append(
            f"the torch.distributed.{op}() that {rank_list(ranks)} wait{'s' if one else ''} in "
            f"({answers[ranks[0]].get('where')}) is one ddpkit does not record: called through a reference taken "
            f"before ddpkit.init() (from torch.distributed import {op}), which ddpkit cannot wrap; call "
            f"dist.{op}() (import torch.distributed as dist) to have it numbered and compared.")
    # of one kind, the unrecorded call may be the very one the others wait in (and slow)
    kinds = {kind(op) for op in blocked.values()}
    certain = (bool(recorded) and not may_move and not kinds & {kind(op) for op in recorded}
               and all(r in blocked or blocked_in_p2p(answers[r]) == "recv" for r in busy))
    if certain:
        sentences.append(f"the other ranks wait in {', '.join(sorted(recorded))}, never in "
                         f"{', '.join(sorted(set(blocked.values())))}: no rank can move on.")
    return certain


def build_report(answers: dict[int, dict], missing: dict[int, dict], *, stall_timeout: float,
                 answer_seconds: float, seen_by: int, exit_code: int) -> Report:
    """The report every rank prints, and whether the deadlock is certain (the job then ends)."""
    lines, picture = _state_lines(answers)
    for rank, info in sorted(missing.items()):
        lines.append(f"  rank {rank}: no answer" + (f" ({info['final']['how']})" if info.get("final") else ""))
        picture += f"\nrank {rank}: missing"
    sentences, certain = _judge(answers, missing, answer_seconds)
    if not sentences:
        sentences = ["no rank waits in a collective any more."]
    sentences += [f"rank {rank} is handling {state['handling']}: a collective in its except: or finally: block "
                  "(a checkpoint save, a barrier) may be one the other ranks do not call; if so, that exception "
                  "is the cause to fix." for rank, state in sorted(answers.items()) if state.get("handling")]
    sentences += [f"rank {rank}'s {dead}: if rank {rank} waits for what that thread was doing (a queue it fed, "
                  "a lock it held), that wait never ends; the thread's exception is the cause to fix."
                  for rank, state in sorted(answers.items()) for dead in state.get("dead_threads") or ()]
    failed = [r for r, state in sorted(answers.items())
              if (waiting := first_waiting(state)) is not None and waiting[0].get("error")]
    # a rank that went away by itself (not one a report ended) closes its connections, and the
    # collectives waiting on it raise: those errors go on to the scripts, as under torch
    peer_gone = any((info.get("final") or {}).get("how") != "hang" and (info.get("final") or info.get("exited"))
                    for info in missing.values())
    if certain and peer_gone:
        after = ("a rank is gone, so this cannot complete: a collective that waits on it raises (as under torch), "
                 f"and the error goes on to the script; a rank still waiting after a moment ends with exit "
                 f"code {exit_code}.")
    elif certain:
        after = f"a certain deadlock: every rank ends now with exit code {exit_code}" + (
            " (a rank handling an exception prints it and ends with exit code 1)."
            if any(state.get("handling") for state in answers.values()) else ".")
    elif failed:  # a timed-out collective has raised there: an error, not a slow rank, ends the job
        after = (f"the collective of {rank_list(failed)} failed (above); that error ends the job unless the "
                 "script catches it.")
    elif any(state.get("dead_threads") for state in answers.values()):
        after = ("the job goes on (this may be a slow rank), but a rank waiting for a thread that died never "
                 "arrives: if so, stop the job and fix that thread's exception.")
    elif any(info.get("stopped") for info in missing.values()):
        after = "the job waits for the stopped rank(s) above; another report follows if this changes."
    else:
        after = "slow is not wrong: the job goes on; another report follows if this changes."
    text = "\n".join([RULE, f"{HEADER}stall_timeout={stall_timeout:g} s, collected by rank "
                      f"{seen_by}). Where each rank is:", *lines, "Verdict:",
                      *(f"  {s}" for s in sentences), f"What next: {after}",
                      "(DDPKIT_STALL_TIMEOUT sets the delay, 0 turns this off)", RULE])
    return {"text": text, "certain": certain, "picture": picture, "peer_gone": peer_gone}
