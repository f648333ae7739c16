"""torchrun's flags for workers' output, and those ``ddpkit run`` accepts without acting on them.

``--local-ranks-filter`` and ``--redirects`` decide which workers' streams reach the console, as in
torchrun (log files under ``--log-dir`` keep everything). A torchrun command line must run unchanged,
so the flags ddpkit does not act on are accepted too, but never in silence: each one given says in
one line what ddpkit does instead (``notes``). A flag whose absence would change what a script
computes (``--virtual-local-rank`` renumbers LOCAL_RANK) is refused instead.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from ddpkit.errors import explain

__all__ = ["ConsoleFilter", "HANDLED_SIGNALS", "Streams", "add_torchrun_flags", "console_filter", "notes",
           "check_refused", "rdzv_conf", "rdzv_timeout", "RDZV_CONF_TIMEOUTS"]

RDZV_CONF_TIMEOUTS = ("timeout", "join_timeout")
"""The ``--rdzv-conf`` keys that bound the wait for the nodes: the static rendezvous's and c10d's."""

HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default, and what ddpkit stops on


@dataclass(frozen=True)
class Streams:
    """torchrun's per-rank stream choice (``--redirects``, ``--tee``): 1 stdout, 2 stderr, 3 both,
    one value for every local rank or ``LOCAL_RANK:STREAMS`` pairs (unlisted ranks: none)."""

    pairs: tuple[tuple[int, int], ...] = ()
    default: int = 0

    def of(self, local_rank: int) -> int:
        return dict(self.pairs).get(local_rank, self.default)


@dataclass(frozen=True)
class ConsoleFilter:
    """Which of a worker's streams the launcher shows: ``ranks`` (None: all) from --local-ranks-filter;
    a stream --redirects sends to the log files is hidden unless --tee shows it too, as in torchrun."""

    ranks: frozenset[int] | None = None
    redirected: Streams = Streams()
    teed: Streams = Streams()

    def shows(self, local_rank: int) -> tuple[bool, bool]:
        """(stdout shown, stderr shown) for the worker of ``local_rank``."""
        if self.ranks is not None and local_rank not in self.ranks:
            return False, False
        hidden = self.redirected.of(local_rank) & ~self.teed.of(local_rank)
        return not hidden & 1, not hidden & 2


def add_torchrun_flags(p: argparse.ArgumentParser, pet: Callable[[str, object], object],
                       pet_flag: Callable[[str], bool], spellings: Callable[[str], list[str]]) -> None:
    p.add_argument("-t", "--tee", default=pet("tee", None), metavar="STREAMS",
                   help="streams --redirects sends to the log files that are shown on the console too, as "
                   "in torchrun (output not redirected is always shown, and kept per rank with --log-dir).")
    p.add_argument("-r", "--redirects", default=pet("redirects", None), metavar="STREAMS",
                   help="with --log-dir, these streams go to the log files only (1 stdout, 2 stderr, 3 "
                   "both; or per local rank, 0:1,1:3), as in torchrun.")
    p.add_argument(*spellings("local-ranks-filter"), dest="local_ranks_filter", metavar="RANKS",
                   default=pet("local_ranks_filter", ""),
                   help="show only these local ranks' output on the console, e.g. 0 or 0,1 (log "
                   "files keep every rank's; a failing rank's traceback is still in the summary).")
    quiet = "accepted for torchrun compatibility; ddpkit run says in one line what it does instead."
    for name, default in (("numa-binding", None), ("logs-specs", None), ("event-log-handler", "null"),
                          ("signals-to-handle", HANDLED_SIGNALS), ("duplicate-stdout-filters", ""),
                          ("duplicate-stderr-filters", "")):
        dest = name.replace("-", "_")
        p.add_argument(*spellings(name), dest=dest, default=pet(dest, default), help=quiet)
    p.add_argument(*spellings("virtual-local-rank"), dest="virtual_local_rank", action="store_true",
                   default=pet_flag("virtual_local_rank"),
                   help="refused: LOCAL_RANK stays each worker's local rank.")


def console_filter(args: argparse.Namespace) -> ConsoleFilter:
    ranks = None
    if str(args.local_ranks_filter).strip():
        try:
            ranks = frozenset(int(r) for r in str(args.local_ranks_filter).split(","))
        except ValueError:
            raise ValueError(f"--local-ranks-filter {args.local_ranks_filter!r} is not a comma-separated "
                             "list of local ranks, e.g. --local-ranks-filter 0,1.") from None
    redirected, teed = _streams("--redirects", args.redirects), _streams("--tee", args.tee)
    return ConsoleFilter(ranks, redirected if args.log_dir else Streams(), teed)


def _streams(flag: str, value: object) -> Streams:
    text = str(value or "").strip()
    try:
        if not text:
            return Streams()
        if ":" not in text:
            return Streams(default=_stream(text))
        pairs = [item.split(":") for item in text.split(",")]
        return Streams(tuple((int(rank), _stream(streams)) for rank, streams in pairs))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give 0-3 (1 stdout, 2 stderr, 3 both) or "
                         "LOCAL_RANK:STREAMS pairs, e.g. 0:3,1:2.") from None


def _stream(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 3:
        raise ValueError(text)
    return value


def check_refused(args: argparse.Namespace) -> None:
    if args.virtual_local_rank:
        raise ValueError(explain(
            "--virtual-local-rank is not supported: ddpkit run gives each worker its own LOCAL_RANK and "
            "leaves CUDA_VISIBLE_DEVICES as it is.",
            "leave the flag out and use cuda:LOCAL_RANK (ddpkit.init() picks it), or run under torchrun."))


def notes(args: argparse.Namespace) -> list[str]:
    """One line per accepted torchrun flag that ddpkit does not act on, where it was given."""
    said = []
    if args.redirects and not args.log_dir:
        said.append("--redirects needs --log-dir here (the files it redirects to); the output stays on "
                    "the console")
    if args.numa_binding:
        said.append(f"--numa-binding {args.numa_binding} has no effect: workers keep the launcher's CPU "
                    "affinity (bind them with numactl or your scheduler)")
    if args.logs_specs:
        said.append(f"--logs-specs {args.logs_specs} has no effect: output goes to the console and "
                    "--log-dir DIR/<run id>_<random>/attempt_<k>/rank_<r>.log")
    if str(args.event_log_handler) != "null":
        said.append(f"--event-log-handler {args.event_log_handler} has no effect: ddpkit run records no "
                    "torchelastic events")
    if _signal_set(args.signals_to_handle) != _signal_set(HANDLED_SIGNALS):
        said.append(f"--signals-to-handle {args.signals_to_handle} has no effect: {HANDLED_SIGNALS} stop "
                    "the workers, and SIGUSR1/SIGUSR2 are passed on to them")
    ignored = [key for key in rdzv_conf(args.rdzv_conf) if key not in RDZV_CONF_TIMEOUTS]
    if ignored:
        said.append(f"--rdzv-conf {', '.join(ignored)} has no effect: the static rendezvous reads only "
                    f"{' or '.join(RDZV_CONF_TIMEOUTS)} (the seconds the nodes wait for each other)")
    for stream in ("stdout", "stderr"):
        if getattr(args, f"duplicate_{stream}_filters"):
            said.append(f"--duplicate-{stream}-filters has no effect: with --log-dir every line is kept "
                        "per rank; grep those files")
    return said


def rdzv_conf(text: object) -> dict[str, str]:
    """``--rdzv-conf key=value,...`` as torchrun reads it, checked: a pair without '=' is named."""
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in str(text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf {text!r}: {item!r} is not KEY=VALUE; give e.g. "
                             "--rdzv-conf timeout=300.")
        pairs[key.strip()] = value.strip()
    return pairs


def rdzv_timeout(args: argparse.Namespace, default: float) -> float:
    """--rdzv-timeout, else torchrun's --rdzv-conf timeout (or join_timeout), else ``default``."""
    if args.rdzv_timeout is not None:
        return args.rdzv_timeout
    conf = rdzv_conf(args.rdzv_conf)
    for key in RDZV_CONF_TIMEOUTS:
        if key in conf:
            try:
                return float(conf[key])
            except ValueError:
                raise ValueError(f"--rdzv-conf {key}={conf[key]!r} is not a number of seconds.") from None
    return default


def _signal_set(text: object) -> set[str]:
    return {s.strip().upper() for s in str(text).split(",") if s.strip()}
