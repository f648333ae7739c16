"""The body of one bench rank: join the group, run the selected tables, and (rank 0) report them."""
from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.bench.report import ranks
from ddpkit.runtime.quick_exit import quick_exit

__all__ = ["BenchConfig", "TABLES", "rank_main", "run_tables"]

TABLES = ("collectives", "ddp", "buckets", "memory")
"""The default tables; ``profile`` (phase times and cProfile) runs only when asked for."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything a rank needs to know; picklable, so it travels to spawned ranks."""

    nproc: int = 2
    backend: str = "gloo"
    device: str | None = None
    """``cuda`` or ``cpu``; None: the device ``ddpkit.init`` picks for the backend."""
    quick: bool = False
    repeats: int = 40
    coll_repeats: int = 20
    steps: int = 3
    models: tuple[str, ...] = ("large", "mlp34", "small", "transformer", "convbn", "embedding")
    bucket_models: tuple[str, ...] = ("large",)
    tables: tuple[str, ...] = TABLES
    max_bytes: int | None = None
    threads: int = 1
    json_path: str | None = None
    plot_path: str | None = None
    timeout: float = 600.0


def _rank_env(rank: int, config: BenchConfig, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "WORLD_SIZE": str(config.nproc), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(config.nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(config.threads),
        # the bench process hosts the store (on a port the OS picked); ranks only connect to it
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def rank_main(rank: int, config: BenchConfig, port: int) -> None:
    """Entry point of a spawned rank; exits non-zero (after printing the traceback) on failure."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")):
            del os.environ[name]
    os.environ.update(_rank_env(rank, config, port))
    torch.set_num_threads(config.threads)
    import ddpkit

    try:
        env = ddpkit.init(backend=config.backend, timeout=timedelta(seconds=config.timeout))
        results = run_tables(config, _rank_device(config, env.device, rank))
        if rank == 0:
            _write_outputs(config, results)
    except BaseException:
        import traceback

        sys.stderr.write(f"[ddpkit bench rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        quick_exit(1)  # skip teardown: the other ranks may be stuck in a collective with us
    ddpkit.shutdown()
    # torch's DDP, measured here, launches its all-reduces with backward's Python context in their
    # thread state; a Gloo thread freeing one while the interpreter finalizes aborts the process
    # (ddpkit's reducer avoids that, torch's cannot). Everything is written: skip finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    quick_exit(0)


def _rank_device(config: BenchConfig, chosen: torch.device, rank: int) -> torch.device:
    """The device of ``config.device``; several Gloo ranks share the GPUs there are, round robin."""
    if config.device is None or config.device == chosen.type:
        return chosen
    if config.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _print(text: str) -> None:
    if dist.get_rank() == 0:
        print(text + "\n", flush=True)


def run_tables(config: BenchConfig, device: torch.device) -> dict:
    """Run the selected tables in order, printing each on rank 0 as soon as it is done."""
    from ddpkit.bench import buckets, collectives, ddp_step, memory
    from ddpkit.bench.models import get_spec

    world_size = dist.get_world_size()
    backend = dist.get_backend()
    describe = {m: get_spec(m).describe(config.quick) for m in dict.fromkeys(config.models + config.bucket_models)}
    results: dict = {"meta": _meta(config, world_size, backend, device, describe)}
    _print(_header(results["meta"]))
    if "collectives" in config.tables:
        sizes = collectives.message_sizes(config.quick, config.max_bytes)
        rows = collectives.run_collectives(sizes, config.coll_repeats, device)
        results["collectives"] = rows
        _print(collectives.collectives_table(rows, world_size, backend).render())
    if "ddp" in config.tables:
        rows = ddp_step.run_ddp_step(list(config.models), config.quick, config.repeats,
                                     config.steps, device)
        results["ddp_step"] = {"rows": rows, "ratios": ddp_step.ratios(rows)}
        _print(ddp_step.ddp_step_table(rows, world_size, config.steps, describe).render())
    if "buckets" in config.tables:
        rows = buckets.run_buckets(list(config.bucket_models), config.quick, max(3, config.repeats // 2),
                                   config.steps, device)
        results["buckets"] = rows
        _print(buckets.buckets_table(rows, world_size).render())
    if "memory" in config.tables:
        rows = memory.run_memory(list(config.models), config.quick, device, repeats=1 if config.quick else 3)
        results["memory"] = rows
        tensor_ratios = memory.peak_ratios(rows, "tensor_peak_bytes")
        results["memory_peak_ratios"] = [{"model": m, "gradient_as_bucket_view": v, "ddpkit/torch": r,
                                          "tensor ddpkit/torch": tensor_ratios.get((m, v))}
                                         for (m, v), r in memory.peak_ratios(rows).items()]
        _print(memory.memory_table(rows, world_size).render())
    if "profile" in config.tables:
        from ddpkit.bench import profile

        result = profile.run_profile(list(config.models), config.quick,
                                     config.repeats * config.steps, device)
        results["profile"] = result
        _print(profile.profile_table(result, world_size))
        from ddpkit.bench import threads

        results["threads"] = threads.run_threads(list(config.models), config.quick, max(3, config.steps * 3), device)
        _print(threads.threads_table(results["threads"], world_size).render())
    if "big" in config.tables:
        from ddpkit.bench import big_gradients

        results["big_gradients"] = big_gradients.run_big_gradients(config.quick, config.repeats, config.steps, device)
        _print(big_gradients.big_gradients_table(results["big_gradients"], world_size).render())
    if "in_place" in config.tables:
        from ddpkit.bench import in_place

        results["in_place"] = in_place.run_in_place(list(config.models), config.quick, config.repeats,
                                                    config.steps, device)
        _print(in_place.in_place_table(results["in_place"], world_size).render())
    return results


def _meta(config: BenchConfig, world_size: int, backend: str, device: torch.device,
          describe: dict[str, str]) -> dict:
    from ddpkit import __version__

    return {"ddpkit": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node(), "cpus": os.cpu_count(), "world_size": world_size,
            "backend": backend, "device": str(device), "threads_per_rank": torch.get_num_threads(),
            "models": describe, "config": {k: v for k, v in asdict(config).items()
                                           if k not in ("json_path", "plot_path")}}


def _header(meta: dict) -> str:
    return (f"ddpkit bench: {ranks(meta['world_size'])}, backend {meta['backend']}, device "
            f"{meta['device']}, {meta['threads_per_rank']} thread(s) per rank, {meta['cpus']} CPUs; "
            f"torch {meta['torch']}, ddpkit {meta['ddpkit']}")


def _write_outputs(config: BenchConfig, results: dict) -> None:
    if config.json_path:
        with open(config.json_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {config.json_path}", flush=True)
    if config.plot_path:
        from ddpkit.bench.plot import plot_results

        plot_results(results, config.plot_path)
        print(f"wrote {config.plot_path}", flush=True)
