"""The PPO benchmarks still run end to end (driver, workers, report) on the tiny model: a flag one script adds
to a shared config builder must reach every script that uses it (bench_ppo_async.py once stopped with an
AttributeError after bench_ppo.py's --bf16). Timings are not looked at."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(script: str, out: str, *flags: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", script), *flags, "--out", out],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def test_bench_ppo_async_runs_sync_and_async_sides(tmp_path):
    report = run_bench(
        "bench_ppo_async.py",
        str(tmp_path / "async.json"),
        *("--threads", "1", "--repeats", "1", "--steps", "3", "--batch", "4", "--response-len", "8"),
        *("--hidden", "64", "--layers", "2", "--ppo-epochs", "1", "--sides", "sync,async"),
    )
    assert set(report["median"]) == {"sync", "async"}
    assert report["median"]["async"]["staleness"] == 1  # the async side really ran one step off


def test_bench_ppo_runs_both_sides_in_bf16(tmp_path):
    report = run_bench(
        "bench_ppo.py",
        str(tmp_path / "ppo.json"),
        *("--threads", "1", "--repeats", "1", "--steps", "2", "--batch", "4", "--response-len", "8"),
        *("--hidden", "64", "--layers", "2", "--bf16"),
    )
    assert set(report["median"]) == {"ours", "trl"}
    assert report["args"]["bf16"] is True
