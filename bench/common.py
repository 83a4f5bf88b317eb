"""Helpers shared by the ours-vs-TRL training benchmarks (``bench_reward.py``, ``bench_sft_dpo.py``).

A benchmark script runs each (task, side) in its own subprocess (the script itself with ``--side``):
``run_worker`` starts it and reads back the JSON result the worker wrote with ``worker_result``. Inside
the worker, ``start_worker`` sets the threads and imports, ``add_step_clock`` stamps
wall and CPU time at the end of every optimizer step, ``timed_window`` turns the stamps into the
timed part of the run (after the warm-up steps), ``add_profiler`` / ``profile_summary`` profile a few
steps at op level, and ``rss_mib`` reads the process's peak RSS.

Nothing here imports torch or transformers at module level, so the driver stays light.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time


def add_worker_flags(parser, profile_help: str) -> None:
    """``--profile N`` and the internal flags of a worker run (``--side task:side``, ``--workdir``, ``--result``)."""
    parser.add_argument("--profile", type=int, default=0, help=profile_help)
    # internal: one run in this process
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)  # "orm:ours", "sft:trl_packed", ...
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)


def start_worker(threads: int) -> None:
    """In a worker: ``threads`` torch threads, the same imports on every side (so base RSS is comparable), quiet."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    torch.set_num_threads(threads)
    import datasets
    import transformers
    import trl  # noqa: F401

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def worker_result(path: str, result: dict) -> dict:
    """Write a worker's result for ``run_worker`` and return it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return result


def rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def add_step_clock(trainer) -> tuple[list[float], list[float]]:
    """Append ``time.perf_counter()`` and ``time.process_time()`` at every ``on_step_end`` of ``trainer``."""
    from transformers import TrainerCallback

    stamps: list[float] = []
    cpu_stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.process_time())

    trainer.add_callback(Stamp())
    return stamps, cpu_stamps


def timed_window(stamps: list[float], cpu_stamps: list[float], t0: float, c0: float, warmup: int) -> dict:
    """The timed part of a run: every step after the first ``warmup`` (at least one step is timed).

    ``t0`` / ``c0``: wall and CPU time just before ``trainer.train()``. Returns ``steps`` (all),
    ``warmup`` (untimed steps actually skipped), ``seconds``, ``cpu_seconds`` and ``step_times``
    (per timed step; empty when nothing was skipped).
    """
    steps = len(stamps)
    w = min(warmup, steps - 1)
    seconds = stamps[-1] - stamps[w - 1] if w > 0 else stamps[-1] - t0
    cpu_seconds = cpu_stamps[-1] - cpu_stamps[w - 1] if w > 0 else cpu_stamps[-1] - c0
    step_times = [b - a for a, b in zip(stamps[w - 1 :], stamps[w:])] if w > 0 else []
    return {"steps": steps, "warmup": w, "seconds": seconds, "cpu_seconds": cpu_seconds, "step_times": step_times}


def add_profiler(trainer, warmup: int, steps: int):
    """torch.profiler (op level, with Python stacks) over optimizer steps ``warmup + 1 .. warmup + steps``."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    prof = profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True)

    class Prof(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step == warmup:
                prof.__enter__()
            elif state.global_step == warmup + steps:
                prof.__exit__(None, None, None)

    trainer.add_callback(Prof())
    return prof


def profile_summary(prof, steps: int, rows: int = 40, stack_rows: int = 25, **extra) -> dict:
    """Print the top ops by self CPU time (and by Python stack); return ``steps``, ``extra``, self CPU (us)
    and calls per op."""
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    total_ms = sum(e.self_cpu_time_total for e in averages) / 1e3
    print(
        f"profiled {steps} steps: {total_ms:.0f} ms self CPU in {len(averages)} op kinds, "
        f"{sum(e.count for e in averages)} op calls"
    )
    summary = {
        "steps": steps,
        **extra,
        "self_cpu_us": {e.key: e.self_cpu_time_total for e in averages},
        "calls": {e.key: e.count for e in averages},
    }
    stacks = prof.key_averages(group_by_stack_n=6)
    print(stacks.table(sort_by="self_cpu_time_total", row_limit=stack_rows, max_name_column_width=60))
    return summary


def run_worker(
    script: str, side: str, workdir: str, argv: list[str], cwd: str, env: dict | None = None, echo: bool = False
) -> dict:
    """Run ``python script --side side --workdir workdir argv... --result PATH`` and return the JSON it wrote;
    stop with its output on failure. ``side`` is "task:side"; ``echo``: also print the worker's stdout."""
    label = side.replace(":", "/")
    result = os.path.join(workdir, f"result_{side.replace(':', '_')}_{time.time_ns()}.json")
    cmd = [sys.executable, os.path.abspath(script), "--side", side, "--workdir", workdir, *argv, "--result", result]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=cwd, env=env)
    if echo:
        print(f"----- {label}\n{proc.stdout}", flush=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-10000:])
        raise SystemExit(f"{label} failed (exit {proc.returncode})")
    with open(result, encoding="utf-8") as f:
        return json.load(f)


CALM = 0.95  # a run "on CPU" (CPU time / wall time of its timed steps) at least this much was not preempted


def on_cpu(run: dict) -> float:
    """The share of a run's timed wall time it spent on a CPU (< 1: preempted by other work)."""
    return run["timed_cpu_seconds"] / run["timed_seconds"]


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize_runs(runs: list[dict], median_keys, first_keys) -> dict:
    """One side's summary: medians of ``median_keys`` over its runs, ``first_keys`` (the same in every run)
    from the first, the run count and every run's tokens/s."""
    summary = {k: median_of(runs, k) for k in median_keys}
    summary.update({k: runs[0][k] for k in first_keys})
    summary["runs"] = len(runs)
    summary["tokens_per_second_all"] = [r["tokens_per_second"] for r in runs]
    return summary


def environment(script: str, argv: list[str], args) -> dict:
    """Date, command line, machine, library versions and the settings (``args`` less the worker flags),
    for the head of a JSON report."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), script, *argv]),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": __import__("torch").__version__,
        "transformers": __import__("transformers").__version__,
        "trl": __import__("trl").__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("side", "workdir", "result")},
    }


def write_report(path: str | None, report: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {path}")
