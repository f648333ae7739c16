"""``ddpkit bench``: collective bandwidth and DDP step time, ddpkit vs torch, on this machine.

    ddpkit bench                       # full run, 2 local ranks (a few minutes on 2 CPU cores)
    ddpkit bench --quick --json o.json # smoke run, under a minute on 2 cores
    python -m ddpkit bench --nproc 4 --tables collectives --plot bw.png
    ddpkit bench --tables ddp,memory --nproc 2,3 --models mlp34,embedding
    ddpkit bench --pool run1.json run2.json run3.json   # one verdict from three runs' rounds

The bench spawns its own ranks (it needs no launcher), hosts their rendezvous store on a port the OS
picks, and prints every table on rank 0.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from dataclasses import replace
from typing import Sequence

from ddpkit.bench.arguments import check_values

__all__ = ["main", "parse_args", "parse_all"]

_TABLE_ALIASES = {"1": "collectives", "2": "ddp", "3": "buckets", "4": "memory",
                  "collectives": "collectives", "ddp": "ddp", "step": "ddp", "buckets": "buckets",
                  "hooks": "buckets", "memory": "memory", "5": "profile", "profile": "profile",
                  "6": "big", "big": "big", "7": "in_place", "in_place": "in_place"}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit bench",
        description="Collective bandwidth, and DDP step time of ddpkit vs torch vs the floor, on N "
                    "local ranks. Tables: 1 collectives, 2 ddp (step time), 3 buckets (bucket "
                    "cap and comm hooks), 4 memory; and on request 5 profile (step phases, cProfile), "
                    "6 big (where a gradient is scaled by its own hook) and 7 in_place (big "
                    "gradients in place or in buckets).")
    parser.add_argument("--nproc", default="2",
                        help="local ranks to spawn, or a comma list (2,3): one run per world size, "
                             "--json and --plot files then named FILE.nN.ext (default 2)")
    parser.add_argument("--backend", default=None,
                        help="process-group backend (default nccl with CUDA, else gloo)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the models and gradients live (default cuda with nccl, else cpu); "
                             "--backend gloo --device cuda puts several ranks on one GPU, the reducer's "
                             "CUDA path")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (under a minute on 2 cores)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats: rounds over the DDP variants (default 40) and per "
                             "collective size (default 20; large messages use fewer); quick 3")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per timed repeat (default 3, quick 2)")
    parser.add_argument("--models", default=None,
                        help="comma list of the family's members: large, mlp34, small, transformer, "
                             "convbn, embedding (default all)")
    parser.add_argument("--bucket-models", default="large",
                        help="the models of the bucket-cap and hook sweep, table 3 (default large)")
    parser.add_argument("--tables", default="collectives,ddp,buckets,memory",
                        help="comma list of: collectives, ddp, buckets, memory, profile, big, in_place "
                             "(or 1-7); default all but profile, big and in_place")
    parser.add_argument("--max-size", type=int, default=None, metavar="MIB",
                        help="largest collective message in MiB (default 256, quick 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per rank (default 1 on CPU)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds before the whole bench is stopped (default 900)")
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="write every figure here")
    parser.add_argument("--plot", dest="plot_path", metavar="FILE.png",
                        help="draw bandwidth and step-time plots (needs matplotlib: ddpkit[plot])")
    parser.add_argument("--pool", nargs="+", metavar="FILE.json",
                        help="run nothing: pool the DDP step rounds of earlier --json files into one "
                             "median and 95%% interval per model and pair, per world size (the other "
                             "options are ignored)")
    return parser


def _names(parser: argparse.ArgumentParser, flag: str, text: str, known: Sequence[str]) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))  # each once
    if not names or any(m not in known for m in names):
        parser.error(f"{flag} {text!r}: expected a comma list of {list(known)}.")
    return names


def parse_all(argv: list[str]) -> list:
    """Parse ``argv`` into one ``BenchConfig`` per world size of ``--nproc``; SystemExit(2) on bad input."""
    parser = _build_parser()
    try:
        sizes = [int(n) for n in parser.parse_args(argv).nproc.split(",") if n.strip()]
    except ValueError:
        parser.error("--nproc: expected a number of ranks or a comma list of them (2,3).")
    if not sizes or min(sizes) < 1:
        parser.error(f"--nproc must be >= 1, got {sizes}.")
    config = parse_args(argv, nproc=sizes[0])
    if len(sizes) == 1:
        return [config]
    return [replace(config, nproc=n, json_path=_suffixed(config.json_path, n),
                    plot_path=_suffixed(config.plot_path, n)) for n in sizes]


def _suffixed(path: str | None, nproc: int) -> str | None:
    if path is None:
        return None
    root, ext = os.path.splitext(path)
    return f"{root}.n{nproc}{ext}"


def parse_args(argv: list[str], nproc: int | None = None):
    """Parse and validate ``argv`` into a ``BenchConfig`` (the first world size of ``--nproc``, or
    ``nproc``); raises SystemExit(2) on bad input."""
    from ddpkit.bench.models import FAMILY, MODELS
    from ddpkit.bench.runner import BenchConfig

    parser = _build_parser()
    args = parser.parse_args(argv)
    if nproc is None:
        try:
            nproc = int(args.nproc.split(",")[0])
        except ValueError:
            parser.error("--nproc: expected a number of ranks or a comma list of them (2,3).")
    args.nproc = nproc
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}.")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}.")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}.")
    models = _names(parser, "--models", args.models, list(MODELS)) if args.models else FAMILY
    bucket_models = _names(parser, "--bucket-models", args.bucket_models, list(MODELS))
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    bad = [t for t in tables if t not in _TABLE_ALIASES]
    if bad or not tables:
        parser.error(f"--tables {args.tables!r}: expected a comma list of collectives, ddp, "
                     "buckets, memory, profile, big, in_place (or 1-7).")
    if args.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed. "
                         "HINT: pip install 'ddpkit[plot]' (or matplotlib).")
    check_values(parser, args, [_TABLE_ALIASES[t] for t in tables])
    backend = args.backend or ("gloo" if args.device == "cpu" else _default_backend())
    if args.device == "cuda" and not _cuda():
        parser.error("--device cuda: this machine has no usable CUDA device (torch.cuda.is_available() "
                     "is False).")
    if backend == "nccl" and not _cuda():
        parser.error("--backend nccl: this machine has no usable CUDA device (torch.cuda.is_available() "
                     "is False), and NCCL reduces CUDA tensors only. HINT: --backend gloo.")
    if args.device == "cpu" and backend == "nccl":
        parser.error("--device cpu with --backend nccl: NCCL reduces CUDA tensors only. "
                     "HINT: --backend gloo for CPU tensors.")
    if args.nproc < 2 and any(_TABLE_ALIASES[t] != "collectives" for t in tables):
        print("ddpkit bench: note: with --nproc 1 there is no communication to measure.",
              file=sys.stderr)
    on_cpu = args.device != "cuda" and (backend == "gloo" or not _cuda())
    return BenchConfig(
        nproc=args.nproc, backend=backend, device=args.device, quick=args.quick,
        repeats=args.repeats or (3 if args.quick else 40),
        coll_repeats=args.repeats or (3 if args.quick else 20),
        steps=args.steps or (2 if args.quick else 3), models=models, bucket_models=bucket_models,
        tables=tuple(dict.fromkeys(_TABLE_ALIASES[t] for t in tables)),
        max_bytes=args.max_size << 20 if args.max_size else None,
        threads=args.threads or (1 if on_cpu else max(1, (os.cpu_count() or 1) // args.nproc)),
        json_path=os.path.abspath(args.json_path) if args.json_path else None,
        plot_path=os.path.abspath(args.plot_path) if args.plot_path else None,
        timeout=args.timeout)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_backend() -> str:
    import torch.distributed as dist

    return "nccl" if _cuda() and dist.is_nccl_available() else "gloo"


def main(argv: list[str] | None = None) -> int:
    """Run the bench; returns 0 when every rank finished, 1 otherwise (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        pool = _build_parser().parse_args(argv).pool  # (--pool=FILE and --poo FILE too)
        if pool:
            return _pool(pool)
        configs = parse_all(argv)
    except SystemExit as e:
        return int(e.code or 0)
    worst = 0
    for config in configs:
        if len(configs) > 1:
            print(f"ddpkit bench: --nproc {config.nproc}", flush=True)
        worst = max(worst, _run(config))
    return worst


def _pool(paths: list[str]) -> int:
    """``--pool``: print the pooled tables of earlier runs; 2 for a file that holds none."""
    from ddpkit.bench.pool import BenchFileError, pool_tables

    real = [os.path.realpath(path) for path in paths]
    for i, path in enumerate(paths):
        if real[i] in real[:i]:
            first = paths[real.index(real[i])]
            also = "" if path == first else f" (also as {path!r})"
            print(f"ddpkit bench: --pool names {first!r} twice{also}: its rounds would count twice and narrow "
                  "the intervals. HINT: name each run's file once.", file=sys.stderr)
            return 2
    try:
        tables = pool_tables(paths)
    except BenchFileError as e:
        print(f"ddpkit bench: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(t.render() for t in tables))
    return 0


def _run(config) -> int:
    """One bench run at one world size."""
    if config.backend == "nccl" and _cuda():
        import torch

        if torch.cuda.device_count() < config.nproc:
            print(f"ddpkit bench: --nproc {config.nproc} with nccl needs {config.nproc} GPUs, found "
                  f"{torch.cuda.device_count()}. HINT: lower --nproc or use --backend gloo.",
                  file=sys.stderr)
            return 2
    return _spawn(config)


def _spawn(config) -> int:
    """Start the ranks, wait for all of them, and stop them all as soon as one fails."""
    import torch.distributed as dist

    from ddpkit.bench.runner import rank_main

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    store = dist.TCPStore("127.0.0.1", 0, config.nproc, is_master=True, wait_for_workers=False)
    procs = [context.Process(target=rank_main, args=(rank, config, store.port), name=f"rank{rank}")
             for rank in range(config.nproc)]
    deadline = time.monotonic() + config.timeout
    failed = None
    try:
        for p in procs:
            p.start()
        while any(p.exitcode is None for p in procs):
            failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
            if failed is not None:
                print(f"ddpkit bench: {failed.name} exited with code {failed.exitcode}; stopping "
                      "the others.", file=sys.stderr)
                break
            if time.monotonic() > deadline:
                print(f"ddpkit bench: stopped after --timeout {config.timeout:.0f} s.", file=sys.stderr)
                failed = procs[0]
                break
            time.sleep(0.05)
        failed = failed or next((p for p in procs if p.exitcode != 0), None)
    except KeyboardInterrupt:
        failed = procs[0]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return 0 if failed is None else 1
