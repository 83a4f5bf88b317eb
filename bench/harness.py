"""The benchmark harness every ``bench/bench_*.py`` script uses; a script only describes its sides.

* **Sides in subprocesses**: ``add_worker_flags`` adds the internal ``--side`` / ``--workdir`` / ``--result``
  flags; ``run_worker`` starts the script itself with them (optionally under a launcher such as torchrun,
  one result per rank: ``rank_result``) and reads back the JSON the worker wrote with ``worker_result``;
  ``forward_flags`` passes the driver's settings on, ``worker_env`` sets ``OMP_NUM_THREADS`` and
  ``PYTHONPATH``. Each side has its own process, so its peak RSS and allocator state are its own;
  ``start_worker`` sets the threads and imports the same modules on every side (comparable base RSS).
* **Interleaving and repeats**: ``schedule`` / ``run_interleaved`` run every (group, side) ``repeats``
  times, the sides interleaved within a repeat and the starting side rotated (A B, B A, ...; or A B, A B
  without rotation), so load from other tenants of a shared machine falls on all sides alike;
  ``rotated`` is the same order for in-process interleaving (``bench_packing.py``'s chunks).
* **Clocks**: ``add_step_clock`` stamps wall and CPU time at the end of every optimizer step of a
  ``transformers.Trainer`` (and each step's own duration); ``timed_window`` cuts the warm-up steps off;
  ``measure_training`` runs ``train()`` under the clock (with peak RSS before and after);
  ``after_warmup`` drops warm-up rows; ``Timers`` accumulates the wall time of wrapped methods;
  ``patched`` swaps attributes for a block; ``add_profiler`` / ``profile_summary`` profile a few steps.
* **Counting and memory**: ``Counting`` wraps a collator and records counts of every batch; ``rss_mib``
  is the peak RSS of this process (``ru_maxrss``); ``trainer_facts`` what both sides must share.
* **Data**: ``tokenizer`` (the bundled tiny one), ``data_subset`` (the first N records of a file),
  ``matched_batch`` (the reference side's examples per step = our mean per packed row).
* **Summaries**: ``medians``, ``summarize_runs`` (medians, values shared by every run, and the
  shared-machine columns ``on_cpu`` and ``calm_*``), ``ratios`` (ours / reference).
* **Reports**: ``markdown_table``, ``num``; ``environment`` (date, command, machine, library versions,
  settings) and ``write_report`` for the JSON file.

Timings are reported, never asserted: on a shared machine only medians of interleaved runs mean much.
Nothing here imports torch or transformers at module level, so a driver stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")
WORKER_FLAGS = ("side", "workdir", "result")


def tokenizer():
    """The bundled tiny tokenizer (``llm/assets/tiny_tokenizer``), as ``AutoTokenizer`` loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


# ----------------------------------------------------------------------------------- sides in subprocesses


def add_worker_flags(parser, profile_help: str | None = None, sides=None) -> None:
    """The internal flags of a worker run (``--side``, ``--workdir``, ``--result``) and, with ``profile_help``,
    ``--profile N``. ``sides``: the allowed values of ``--side`` (default: any, e.g. "task:side")."""
    if profile_help is not None:
        parser.add_argument("--profile", type=int, default=0, help=profile_help)
    parser.add_argument("--side", default=None, choices=sides, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)


def forward_flags(args, *names: str, **values) -> list[str]:
    """Command-line flags that give a worker the driver's settings ``names`` (argparse dests, ``--a-b`` for
    ``a_b``), then ``values`` (dest=value, overriding). ``None`` is left out, ``True`` / ``False`` of a
    store_true flag become the flag / nothing."""
    settings = {name: getattr(args, name) for name in names} | values
    argv: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def start_worker(threads: int) -> None:
    """In a Trainer comparison's worker: ``threads`` torch threads, the same imports on every side (so base RSS
    is comparable), quiet."""
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


def run_worker(
    script: str,
    side: str,
    workdir: str,
    argv: list[str],
    cwd: str = ROOT,
    env: dict | None = None,
    echo: bool = False,
    launcher: tuple[str, ...] = (),
    ranks: int | None = None,
    timeout: float | None = None,
) -> dict | list[dict]:
    """Run ``python [launcher...] script --side side --workdir workdir argv... --result PATH`` and return the
    JSON it wrote; stop with its output on failure. ``side``: e.g. "task:side"; ``echo``: also print the
    worker's stdout. ``launcher``: e.g. ``("-m", "torch.distributed.run", ...)``; with ``ranks`` every rank
    writes ``PATH.<rank>`` (see ``rank_result``) and the list of them is returned."""
    label = side.replace(":", "/")
    name = "".join(c if c.isalnum() else "_" for c in side)
    result = os.path.join(workdir, f"result_{name}_{time.time_ns()}.json")
    cmd = [sys.executable, *launcher, os.path.abspath(script), "--side", side, "--workdir", workdir, *argv]
    cmd += ["--result", result]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    if echo:
        print(f"----- {label}\n{proc.stdout}", flush=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-10000:])
        raise SystemExit(f"{label} failed (exit {proc.returncode})")
    paths = [result] if ranks is None else [f"{result}.{r}" for r in range(ranks)]
    results = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            results.append(json.load(f))
    return results[0] if ranks is None else results


def run_entry_point(script: str, config: str, log: str, env: dict, flags: dict | None = None) -> float:
    """``python llm/<script> <config> [--k v ...]`` as a user runs it, its output in ``log``; the wall seconds. A
    failure ends the benchmark with the log's tail and its path."""
    cmd = [sys.executable, os.path.join(ROOT, "llm", script), config]
    for k, v in (flags or {}).items():
        cmd += [f"--{k}", str(v)]
    print("$", " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd), flush=True)
    t = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    seconds = time.perf_counter() - t
    if rc != 0:
        with open(log, encoding="utf-8") as f:
            sys.stderr.write(f.read()[-4000:])
        raise SystemExit(f"{script} {config} failed (exit {rc}); log {log}")
    return seconds


def rank_result(path: str) -> str:
    """Where a rank of a ``run_worker(..., ranks=n)`` launch writes its result (``RANK`` from torchrun)."""
    return f"{path}.{int(os.environ.get('RANK', '0'))}"


def worker_env(threads: int, **extra: str) -> dict:
    """This process's environment with ``OMP_NUM_THREADS=threads`` and ``PYTHONPATH`` = the repository root."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": ROOT, **extra}


# ------------------------------------------------------------------------------- interleaving and repeats


def rotated(names, k: int) -> tuple:
    """``names`` starting at index ``k`` (mod its length)."""
    names = tuple(names)
    k %= len(names)
    return names[k:] + names[:k]


def schedule(groups: dict, repeats: int, rotate: bool = True) -> Iterator[tuple[int, object, object]]:
    """(repeat, group, side) in run order: every repeat runs every group's sides, interleaved; with ``rotate``
    the starting side moves on by one per repeat and per group (A B, B A, ...), else A B, A B, ..."""
    for rep in range(repeats):
        for i, (group, sides) in enumerate(groups.items()):
            yield from ((rep, group, side) for side in rotated(sides, rep + i if rotate else 0))


def run_interleaved(
    groups: dict | Iterable,
    repeats: int,
    run: Callable,
    rotate: bool = True,
    describe: Callable[[dict], str] | None = None,
    stream=None,
) -> dict:
    """Run ``run(group, side, rep)`` (``run(side, rep)`` when ``groups`` is a plain list of sides) in
    ``schedule`` order; returns ``{group: {side: [result per repeat]}}`` (or ``{side: [...]}``).
    ``describe(result)``: a progress line after every run, with the elapsed time, on ``stream`` (stdout)."""
    flat = not isinstance(groups, dict)
    groups = {None: tuple(groups)} if flat else groups
    runs = {g: {s: [] for s in sides} for g, sides in groups.items()}
    started = time.time()
    for rep, group, side in schedule(groups, repeats, rotate):
        r = run(side, rep) if flat else run(group, side, rep)
        runs[group][side].append(r)
        if describe is not None:
            label = side if flat else f"{group}/{side}"
            print(
                f"[{time.time() - started:6.0f}s] rep {rep + 1}/{repeats} {label}: {describe(r)}",
                file=stream or sys.stdout,
                flush=True,
            )
    return runs[None] if flat else runs


def data_subset(source: str, n: int, dest: str) -> int:
    """The first ``n`` records (non-empty lines) of the JSONL file ``source`` written to ``dest``; returns how
    many there were (a warning when fewer than ``n``)."""
    with open(source, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()][:n]
    if len(lines) < n:
        print(f"warning: {os.path.relpath(source, ROOT)} has only {len(lines)} records (asked {n})", file=sys.stderr)
    with open(dest, "w", encoding="utf-8") as f:
        f.writelines(lines)
    return len(lines)


def matched_batch(stats, batch: str | int) -> int:
    """The reference side's examples per step: ``batch`` as an int, or for ``"auto"`` our mean examples per
    packed row (``stats``: our ``PackStats``), rounded, so both sides take about as many per optimizer step."""
    return max(1, round(stats.examples / stats.rows)) if batch == "auto" else int(batch)


# -------------------------------------------------------------------------------------------------- clocks


class StepClock:
    """Wall (``perf_counter``) and CPU (``process_time``) stamps at the end of every optimizer step, and each
    step's own wall time (``on_step_begin`` to ``on_step_end``)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.durations: list[float] = []


def add_step_clock(trainer) -> StepClock:
    """A ``StepClock`` filled by a callback on ``trainer`` (a ``transformers.Trainer``)."""
    from transformers import TrainerCallback

    clock = StepClock()

    class Stamp(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            clock.ends.append(now)
            clock.cpu_ends.append(time.process_time())
            clock.durations.append(now - self.begin)

    trainer.add_callback(Stamp())
    return clock


def timed_window(clock: StepClock, t0: float, c0: float, warmup: int) -> dict:
    """The timed part of a run: every step after the first ``warmup`` (at least one step is timed).

    ``t0`` / ``c0``: wall and CPU time just before ``trainer.train()``. Returns ``steps`` (all),
    ``warmup`` (untimed steps actually skipped), ``seconds``, ``cpu_seconds`` and ``step_times``
    (per timed step, end to end; empty when nothing was skipped).
    """
    stamps, cpu_stamps = clock.ends, clock.cpu_ends
    steps = len(stamps)
    w = min(warmup, steps - 1)
    seconds = stamps[-1] - stamps[w - 1] if w > 0 else stamps[-1] - t0
    cpu_seconds = cpu_stamps[-1] - cpu_stamps[w - 1] if w > 0 else cpu_stamps[-1] - c0
    step_times = [b - a for a, b in zip(stamps[w - 1 :], stamps[w:])] if w > 0 else []
    return {"steps": steps, "warmup": w, "seconds": seconds, "cpu_seconds": cpu_seconds, "step_times": step_times}


def after_warmup(rows: list, warmup: int) -> list:
    """``rows`` less the first ``warmup`` (all of them when nothing would be left)."""
    return rows[warmup:] or rows


class Timers:
    """Wraps methods to accumulate their wall time per key; ``take`` returns the sums and starts again."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}

    def wrap(self, obj, name: str, key: str) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.acc[key] = self.acc.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out, self.acc = self.acc, {}
        return out


@contextlib.contextmanager
def patched(obj, **replacements):
    """``obj.name = value`` for each replacement inside the block, the originals restored after it."""
    originals = {name: getattr(obj, name) for name in replacements}
    for name, value in replacements.items():
        setattr(obj, name, value)
    try:
        yield originals
    finally:
        for name, value in originals.items():
            setattr(obj, name, value)


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


class Counting:
    """Wraps a collator; records ``measure(batch)`` for every batch it builds: a ``counts`` tuple."""

    def __init__(self, collate, measure: Callable):
        self.collate, self.measure, self.batches = collate, measure, []

    def __call__(self, features):
        batch = self.collate(features)
        self.batches.append(self.measure(batch))
        return batch


def counts(real: int, slots: int, examples: int, computed: int | None = None, targets: int = 0) -> tuple:
    """One batch's counts, as ``throughput`` reads them: (real tokens, computed tokens (default: real), elements
    of ``input_ids``, examples, target tokens)."""
    return real, real if computed is None else computed, slots, examples, targets


def throughput(m: dict, batches: list[tuple]) -> dict:
    """A training run's measured fields from ``measure_training``'s ``m`` and the ``counts`` of its batches:
    steps and timed window, epoch totals, rates over the timed steps, pad ratio (1 - computed / elements),
    peak RSS and what training added to it."""
    steps, w, seconds, cpu = m["steps"], m["warmup"], m["seconds"], m["cpu_seconds"]
    timed, epoch = batches[w:steps], batches[:steps]
    col = lambda rows, i: sum(b[i] for b in rows)
    return {
        "steps": steps,
        "timed_steps": steps - w,
        "timed_seconds": seconds,
        "timed_cpu_seconds": cpu,
        "step_seconds": m["step_times"],
        "train_seconds_total": m["train_seconds_total"],
        "examples_epoch": col(epoch, 3),
        "examples_per_step": col(epoch, 3) / steps,
        "real_tokens_epoch": col(epoch, 0),
        "computed_tokens_epoch": col(epoch, 1),
        "target_tokens_epoch": col(epoch, 4),
        "real_tokens_per_example": col(epoch, 0) / max(col(epoch, 3), 1),
        "timed_real_tokens": col(timed, 0),
        "step_real_tokens": [b[0] for b in timed],
        "tokens_per_second": col(timed, 0) / seconds,
        "computed_tokens_per_second": col(timed, 1) / seconds,
        "tokens_per_cpu_second": col(timed, 0) / cpu,
        "examples_per_second": col(timed, 3) / seconds,
        "pad_ratio": 1.0 - col(epoch, 1) / col(epoch, 2),
        "slots_per_step": col(epoch, 2) / steps,
        "peak_rss_mib": m["peak_rss_mib"],
        "pre_train_rss_mib": m["pre_train_rss_mib"],
        "train_added_rss_mib": m["peak_rss_mib"] - m["pre_train_rss_mib"],
    }


def measure_training(trainer, warmup: int, profile: int = 0) -> dict:
    """``trainer.train()`` under a ``StepClock`` (and ``add_profiler`` over ``profile`` steps): the
    ``timed_window`` fields plus ``train_seconds_total``, ``pre_train_rss_mib`` (peak RSS just before
    training), ``peak_rss_mib`` (after), ``output`` (what ``train`` returned) and ``profiler`` (or None)."""
    clock = add_step_clock(trainer)
    prof = add_profiler(trainer, warmup, profile) if profile else None
    pre_train_rss = rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    out = trainer.train()
    total = time.perf_counter() - t0
    peak_rss = rss_mib()
    window = timed_window(clock, t0, c0, warmup)
    return {
        **window,
        "train_seconds_total": total,
        "pre_train_rss_mib": pre_train_rss,
        "peak_rss_mib": peak_rss,
        "output": out,
        "profiler": prof,
    }


def trainer_facts(trainer) -> dict:
    """What both sides of a Trainer comparison must share: parameters, optimizer, checkpointing, attention, threads."""
    import torch

    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "optimizer": str(trainer.args.optim),
        "activation_checkpointing": bool(trainer.args.activation_checkpointing),
        "attn_implementation": trainer.model.config._attn_implementation,
        "threads": torch.get_num_threads(),
    }


def rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------- summaries

CALM = 0.95  # a run "on CPU" (CPU time / wall time of its timed steps) at least this much was not preempted


def on_cpu(run: dict) -> float:
    """The share of a run's timed wall time it spent on a CPU (< 1: preempted by other work)."""
    return run["timed_cpu_seconds"] / run["timed_seconds"]


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def medians(rows: list[dict], keys: Iterable[str] | None = None) -> dict:
    """The median of every key (default: every key of the first row) over ``rows``."""
    return {k: median_of(rows, k) for k in (rows[0] if keys is None else keys)}


def summarize_runs(runs: list[dict], median_keys, first_keys, rate: str = "tokens_per_second") -> dict:
    """One side's summary: medians of ``median_keys`` over its runs, ``first_keys`` (the same in every run)
    from the first, the run count, every run's ``rate``, and the shared-machine columns: ``on_cpu`` (median)
    and ``on_cpu_all``, ``calm_runs`` (runs >= ``CALM`` on CPU, which had a core to themselves) and the
    median ``rate`` over those (``calm_tokens_per_second``; NaN when none)."""
    summary = medians(runs, median_keys)
    summary.update({k: runs[0][k] for k in first_keys})
    summary["runs"] = len(runs)
    summary[f"{rate}_all"] = [r[rate] for r in runs]
    shares = [on_cpu(r) for r in runs]
    calm = [r[rate] for r in runs if on_cpu(r) >= CALM]
    summary["on_cpu"] = statistics.median(shares)
    summary["on_cpu_all"] = shares
    summary["calm_runs"] = len(calm)
    summary["calm_tokens_per_second"] = statistics.median(calm) if calm else float("nan")
    return summary


def ratios(ours: dict, reference: dict, keys: Iterable[str]) -> dict:
    """``ours[k] / reference[k]`` for each key (NaN where the reference is 0 or missing)."""
    return {k: ours[k] / reference[k] if reference.get(k) else float("nan") for k in keys}


# ------------------------------------------------------------------------------------------------- reports


def num(x, fmt: str, suffix: str = "", missing: str = "n/a") -> str:
    """``x`` formatted, or ``missing`` for None / NaN (e.g. no run qualified)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return missing
    return format(x, fmt) + suffix


def markdown_table(header, rows: Iterable) -> str:
    """A Markdown table. ``header`` and each row: a list of cells or one string of cells separated by ``|``
    (cells are stripped; an empty one is written ``| |``)."""
    split = lambda r: [c.strip() for c in r.split("|")] if isinstance(r, str) else [str(c) for c in r]
    line = lambda cells: "|" + "".join(f" {c} |" if c else " |" for c in split(cells))
    return "\n".join([line(header), "|" + "---|" * len(split(header)), *(line(r) for r in rows)])


def environment(script: str, argv: list[str], args, libs=("torch", "transformers", "trl")) -> dict:
    """Date, command line, machine, library versions and the settings (``args`` less the worker flags),
    for the head of a JSON report."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(lib):
        try:
            return version(lib)
        except PackageNotFoundError:
            return None

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), script, *argv]),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **{lib: ver(lib) for lib in libs},
        "settings": {k: v for k, v in vars(args).items() if k not in WORKER_FLAGS},
    }


def write_report(path: str | None, report: dict, indent: int = 2) -> None:
    """Write ``report`` as JSON to ``path`` (if given; its directory is made)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=indent)
        print(f"\nwrote {path}")
