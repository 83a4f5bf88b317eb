"""CPU threads: the same short training run with 1 thread, with every core, and with the run scripts' default
(llm/utils/threads.py), interleaved, each a fresh process; median train_runtime (steps only) and wall time.

    python bench/bench_threads.py --task demo --repeats 3 --label idle
    python bench/bench_threads.py --task smollm2 --repeats 2 --label loaded

``--task demo``: the tiny PRM demo (llm/config/tiny/prm_argument.json) for ``--steps`` steps (default 100), no
evaluation; ``--task smollm2``: SFT of the real model (llm/config/smollm2/sft_argument.json) for ``--steps`` steps
(default 4). The machine's load average is recorded before each run: "idle" and "loaded" are what it was.
Results: bench/results/threads_<task>_<label>.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = {
    "demo": ("run_reward.py", "llm/config/tiny/prm_argument.json", 100),
    "smollm2": ("run_finetune.py", "llm/config/smollm2/sft_argument.json", 4),
}


def run(task: str, steps: int, threads: str, out: str) -> dict:
    script, config, _ = TASKS[task]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    cmd = [sys.executable, os.path.join(ROOT, "llm", script), config, "--max_steps", str(steps), "--do_eval", "false"]
    cmd += ["--output_dir", out, "--overwrite_output_dir", "true", "--save_strategy", "no", "--report_to", "none"]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{threads} threads failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    return {"threads": threads, "load_before": load, "wall_s": wall, "train_runtime_s": results["train_runtime"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="demo")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="run", help="what the machine was doing (idle, loaded, ...)")
    parser.add_argument("--threads", default=f"1,{os.cpu_count()},default", help="comma-separated; default = unset")
    args = parser.parse_args()
    steps = args.steps or TASKS[args.task][2]
    variants = args.threads.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for threads in variants if repeat % 2 == 0 else reversed(variants):  # interleaved, order alternated
                rows.append({**run(args.task, steps, threads, os.path.join(tmp, threads)), "repeat": repeat})
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for threads in variants:
        mine = [r for r in rows if r["threads"] == threads]
        summary[threads] = {
            "train_runtime_median_s": statistics.median(r["train_runtime_s"] for r in mine),
            "wall_median_s": statistics.median(r["wall_s"] for r in mine),
            "load_before_median": statistics.median(r["load_before"] for r in mine),
        }
    one = summary[variants[0]]["train_runtime_median_s"]
    print(f"\n{args.task}, {steps} steps, {os.cpu_count()} cores, label {args.label}, {args.repeats} repeats (medians)")
    print("| OMP_NUM_THREADS | train_runtime s | wall s | vs first | load before |")
    print("|---|---|---|---|---|")
    for threads, s in summary.items():
        ratio = s["train_runtime_median_s"] / one
        runtime, wall, load = s["train_runtime_median_s"], s["wall_median_s"], s["load_before_median"]
        print(f"| {threads} | {runtime:.1f} | {wall:.1f} | {ratio:.2f}x | {load:.1f} |")
    out = os.path.join(ROOT, "bench", "results", f"threads_{args.task}_{args.label}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(
            {"task": args.task, "steps": steps, "cores": os.cpu_count(), "rows": rows, "summary": summary}, f, indent=1
        )
    print(out)


if __name__ == "__main__":
    main()
