"""Worker for tests/test_launch.py, started by ``ddpkit run`` (or torchrun) with torchrun's variables.

    python tests/scripts/launch_worker.py OUT_DIR MODE [ARGS...]

Every rank first writes ``OUT_DIR/pids_<rank>_<attempt>.json`` ({"pid": ..., "child": ..., "daemon": ...})
so the test knows every process of the job; a rank told to fail or die first waits for every rank's
file, so none is stopped before it is known. Modes:

- ``allreduce``: ddpkit.init(backend="gloo"), all-reduce rank + 1, write
  ``OUT_DIR/result_<rank>.json`` with the sum, the detected launcher, the torchrun variables, the
  names of every variable a launcher may set, and this script's arguments.
- ``fail RANK``: RANK starts a grandchild (a sleeping python), then raises ValueError from a
  KeyError; others block.
- ``record-fail RANK``: RANK writes its TORCHELASTIC_ERROR_FILE's path to ``OUT_DIR/error_file_<rank>``,
  then raises ValueError from a function decorated with torch's ``@record``; others succeed.
- ``sigkill RANK``: RANK kills itself with SIGKILL; others block.
- ``block``: start a grandchild and block until killed; SIGUSR1 writes ``OUT_DIR/usr1_<rank>``.
- ``fail-once RANK``: on attempt 0 RANK raises; on later attempts every rank writes its result and exits.
- ``stdin``: read a line with input() and write it to ``OUT_DIR/result_<rank>.json``.
- ``progress``: write a progress line ending in no newline ("\\rprogress 1/2"), wait for a line on
  stdin, write 100,000 x without a newline, wait for another line, then "\\rprogress 2/2\\n".
- ``detached``: as ``block``, but with two daemons (sessions of their own, deaf to SIGTERM and
  SIGHUP) in place of the grandchild: ``child`` inherits the environment, ``daemon`` gets an empty one.
- ``mismatch``: ddpkit.init(backend="gloo"), an all-reduce, then one of 4 elements on rank 0 and 8 on
  the others: Gloo aborts the process.
- ``block-on-node NODE``: the ranks of node NODE start a grandchild and block; the others succeed.
- ``sigint``: count the SIGINTs this process gets in ``OUT_DIR/sigint_<rank>``; after the first, a
  cleanup of up to 2 s that a second one would interrupt, then exit 130.

Only ``allreduce``, ``mismatch`` and ``record-fail`` import torch, so the other modes start in a fraction of a second.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
             "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
             "DDPKIT_LAUNCHER", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
# what a launcher may set for its workers: the names ``allreduce`` lists, to compare two launchers
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
LAUNCHER_PREFIXES = ("LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "TORCH_NCCL_")


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # the test polls for the file: it must appear complete


def _record(out: str, rank: int, attempt: str, child: int | None = None,
            daemon: int | None = None) -> None:
    _write(os.path.join(out, f"pids_{rank}_{attempt}.json"),
           {"pid": os.getpid(), "child": child, "daemon": daemon})


def _grandchild(detached: bool = False, env: dict[str, str] | None = None) -> int:
    if detached:  # a daemon: a session of its own, deaf to SIGTERM and SIGHUP
        code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "signal.signal(signal.SIGHUP, signal.SIG_IGN); time.sleep(600)")
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, env=env).pid
    # no new session: it stays in the worker's process group, as a DataLoader worker would
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


def _block() -> None:
    threading.Event().wait()


def _wait_for_every_rank(out: str, attempt: str) -> None:
    """Hold a failing rank until every rank has its pid file: the test checks all of them are gone."""
    world, deadline = int(os.environ["WORLD_SIZE"]), time.monotonic() + 30
    while len(glob.glob(os.path.join(out, f"pids_*_{attempt}.json"))) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every one of the {world} ranks wrote its pid file within 30 s")
        time.sleep(0.02)


def main() -> None:
    out, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank, attempt = int(os.environ["RANK"]), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    target = int(args[0]) if args and mode != "allreduce" else None
    if mode == "block":  # before the pid file: the test sends SIGUSR1 as soon as it sees that
        signal.signal(signal.SIGUSR1, lambda *_: _write(os.path.join(out, f"usr1_{rank}"), {}))
    sigints: list[threading.Event] = [threading.Event(), threading.Event()]
    if mode == "sigint":  # before the pid file: the test interrupts the launcher as soon as it sees that
        def count(*_: object) -> None:
            done = sum(e.is_set() for e in sigints)
            _write(os.path.join(out, f"sigint_{rank}"), {"count": done + 1})
            sigints[min(done, 1)].set()

        signal.signal(signal.SIGINT, count)
    if mode == "block-on-node":
        mode = "block" if os.environ["GROUP_RANK"] == args[0] else "succeed"
    child = _grandchild() if mode == "block" or (mode == "fail" and rank == target) else None
    daemon = None
    if mode == "detached":  # one inherits the environment, one starts with an empty one
        child, daemon, mode = _grandchild(detached=True), _grandchild(detached=True, env={}), "block"
    _record(out, rank, attempt, child, daemon)
    print(f"rank {rank} started", flush=True)
    if mode in ("fail", "sigkill", "fail-once") and rank == target and attempt == "0":
        _wait_for_every_rank(out, attempt)

    if mode == "allreduce":
        import torch

        import ddpkit

        env = ddpkit.init(backend="gloo")  # CPU collectives, also on a machine with one GPU
        total = torch.tensor([float(rank + 1)])
        ddpkit.all_reduce(total)
        result = {"sum": total.item(), "launcher": env.launcher, "args": args,
                  "env": {name: os.environ.get(name) for name in VARIABLES},
                  "names": sorted(k for k in os.environ if k in LAUNCHER_NAMES or k.startswith(LAUNCHER_PREFIXES))}
        _write(os.path.join(out, f"result_{rank}.json"), result)
        print(f"sum {total.item()}", flush=True)
        ddpkit.shutdown()
    elif mode == "deadlock":  # every rank is the source of one broadcast, and keeps a Ctrl-C from ending it
        import torch

        import ddpkit

        signal.signal(signal.SIGINT, lambda *_: None)  # as a rank blocked in a collective: it cannot see one
        ddpkit.init(backend="gloo")  # stall_timeout: the default 60 s
        _write(os.path.join(out, f"deadlock_{rank}"), {})
        ddpkit.broadcast(torch.zeros(4), src=rank)
    elif mode == "mismatch":
        import torch

        import ddpkit

        ddpkit.init(backend="gloo", stall_timeout=0)
        ddpkit.all_reduce(torch.zeros(4))  # the pairs connect
        ddpkit.all_reduce(torch.zeros(4 if rank == 0 else 8))  # MISMATCHED ALL_REDUCE
        _block()
    elif mode == "exit-slowly":  # the target raises, then its exit takes a while (a logger's flush)
        import atexit

        if rank == target:  # before ddpkit is imported: runs after ddpkit's own exit handlers
            atexit.register(time.sleep, 3.0)
        import torch

        import ddpkit

        ddpkit.init(backend="gloo", stall_timeout=10)
        ddpkit.all_reduce(torch.zeros(4))
        if rank == target:
            raise RuntimeError(f"the cause, on rank {rank}")
        ddpkit.all_reduce(torch.zeros(4))  # the peer has left: this rank's hang report ends it with 86
    elif mode == "leave-then-fail":  # the target's connections close, then it fails: the peer's error is a consequence
        import torch

        import ddpkit

        ddpkit.init(backend="gloo", stall_timeout=30)
        ddpkit.all_reduce(torch.zeros(4))
        if rank == target:
            import gc

            ddpkit.shutdown()
            gc.collect()  # the group's last reference: its connections close
            time.sleep(2.0)
            sys.exit(3)
        ddpkit.all_reduce(torch.zeros(4))  # raises at once (connection closed), uncaught: exit code 1
    elif mode == "stdin":
        _write(os.path.join(out, f"result_{rank}.json"), {"stdin": input()})
    elif mode == "progress":
        for text in ("\rprogress 1/2", "\r" + "x" * 100_000, "\rprogress 2/2\n"):
            sys.stdout.write(text)
            sys.stdout.flush()
            if not text.endswith("\n"):
                input()  # the test saw it, without a newline after it
    elif mode == "fail" and rank == target:
        print("about to fail", file=sys.stderr, flush=True)
        try:
            {}["root cause"]
        except KeyError as e:
            raise ValueError(f"boom on rank {rank}") from e
    elif mode == "record-fail" and rank == target:
        from torch.distributed.elastic.multiprocessing.errors import record

        with open(os.path.join(out, f"error_file_{rank}"), "w") as f:
            f.write(os.environ["TORCHELASTIC_ERROR_FILE"])

        @record
        def fail() -> None:
            raise ValueError(f"recorded on rank {rank}")

        fail()
    elif mode == "all-fail":  # every rank raises at about the same moment, rank r 0.2 r s later
        _wait_for_every_rank(out, attempt)
        time.sleep(0.2 * rank)
        raise ValueError(f"bad config on rank {rank}")
    elif mode == "sigkill" and rank == target:
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "fail-once":
        if attempt == "0" and rank == target:
            raise RuntimeError("first attempt fails")
        if attempt == "0":
            _block()
        _write(os.path.join(out, f"result_{rank}.json"), {"restart_count": attempt})
    elif mode == "sigint":
        sigints[0].wait()
        sigints[1].wait(2.0)  # the cleanup of an `except KeyboardInterrupt:` a second one would cut short
        sys.exit(130)
    elif mode not in ("succeed", "record-fail"):
        _block()


if __name__ == "__main__":
    main()
