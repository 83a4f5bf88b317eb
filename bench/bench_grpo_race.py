"""GRPO time-to-accuracy, ours against TRL's current ``GRPOTrainer``, over several seeds (issue 30 item 3).

Not a test: a benchmark. Each seed is one run of ``bench_real_learning.py``'s GRPO task: the same model
(SmolLM2-135M-Instruct), prompts (llm/data/sample_arith/arith_train.jsonl), rule reward (``math_exact_match``),
group size, completion cap, sampling, learning rate, k3 KL loss, micro-batch and precision on both sides, both
sides at once, one thread each, for ``--minutes`` of training wall time (checkpoint saving not counted), each
saving its policy every ``--minutes / --evals`` minutes; afterwards one evaluator scores the base model and every
checkpoint (greedy, chat template, the first ``--eval-prompts`` of arith_dev.jsonl). Seeds ``--seed``,
``--seed + 1``, ... run one after the other.

The report: per seed, each side's curve (held-out accuracy against training wall time) and steps; per side, the
median over seeds of the accuracy and of the wall time at each checkpoint; TRL's final median accuracy, and the
training wall time at which each side's median curve first reaches it (linear between checkpoints). The goal
(issue 30 item 3): ours reaches TRL's final median accuracy in less time than TRL.

Precision (``--precision``, default fp32) is set on both sides: TRL's configs turn bf16 autocast on by default,
on a CPU too (``bf16=None`` means True), so a TRL run left at its defaults does less arithmetic per token than
an fp32 run of ours.

Usage (from the repository root; TRL's current release in ``.trl-current``, as scripts/setup.sh installs it)::

    OMP_NUM_THREADS=1 python bench/bench_grpo_race.py --quick                 # the pipeline, a minute a side
    OMP_NUM_THREADS=1 python bench/bench_grpo_race.py --seeds 3 --minutes 16 --evals 4   # about 70 minutes

Writes ``--out`` (default bench/results/grpo_race_smollm2.json; ``--quick``: output/grpo_race_quick.json) and a
PNG beside it; the report is rewritten after every seed.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import harness
from bench.bench_real_learning import env, model_dir, parser, task_grpo

SIDES = ("ours", "trl")


def median_curve(per_seed: list[dict], side: str) -> list[dict]:
    """Checkpoint k of every seed (k = 0 is the base model): the median accuracy and the median wall time."""
    curves = [r[side]["curve"] for r in per_seed if side in r and r[side].get("curve")]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [
        {
            "checkpoint": k,
            "wall_s": statistics.median(c[k]["wall_s"] for c in curves),
            "accuracy": statistics.median(c[k]["accuracy"] for c in curves),
            "accuracies": [c[k]["accuracy"] for c in curves],
        }
        for k in range(n)
    ]


def time_to(curve: list[dict], target: float) -> float | None:
    """The first wall time at which ``curve`` (points in time order) reaches ``target``, linear between points;
    None if it never does."""
    for prev, cur in itertools.pairwise(curve):
        if cur["accuracy"] >= target:
            if prev["accuracy"] >= target:
                return prev["wall_s"]
            frac = (target - prev["accuracy"]) / (cur["accuracy"] - prev["accuracy"])
            return prev["wall_s"] + frac * (cur["wall_s"] - prev["wall_s"])
    return None


def summarise(per_seed: list[dict]) -> dict:
    medians = {s: median_curve(per_seed, s) for s in SIDES}
    out: dict = {"median_curves": medians}
    if all(medians[s] for s in SIDES):
        target = medians["trl"][-1]["accuracy"]
        reach = {s: time_to(medians[s], target) for s in SIDES}
        out.update(
            target_accuracy=target,
            time_to_target_s=reach,
            final_median_accuracy={s: medians[s][-1]["accuracy"] for s in SIDES},
            steps={s: [r[s].get("steps") for r in per_seed if s in r] for s in SIDES},
            goal_met=reach["ours"] is not None and reach["trl"] is not None and reach["ours"] < reach["trl"],
        )
        if reach["ours"] and reach["trl"]:
            out["time_ratio_ours_over_trl"] = reach["ours"] / reach["trl"]
    return out


def plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"ours": "tab:blue", "trl": "tab:orange"}
    names = {"ours": "ours", "trl": f"TRL {rep.get('trl_version', '')} GRPOTrainer"}
    for r in rep["seeds"]:
        for side in SIDES:
            c = r.get(side, {}).get("curve") or []
            ax.plot(
                [p["wall_s"] / 60 for p in c], [100 * p["accuracy"] for p in c], "-", color=colors[side], alpha=0.25
            )
    for side in SIDES:
        m = rep["summary"]["median_curves"].get(side) or []
        steps = rep["summary"].get("steps", {}).get(side)
        ax.plot(
            [p["wall_s"] / 60 for p in m],
            [100 * p["accuracy"] for p in m],
            "o-",
            color=colors[side],
            lw=2,
            label=f"{names[side]}: median of {len(rep['seeds'])} seeds (steps {steps})",
        )
    target = rep["summary"].get("target_accuracy")
    if target is not None:
        ax.axhline(100 * target, color="grey", ls=":", lw=1, label="TRL's final median accuracy")
    s = rep["settings"]
    ax.set_xlabel(f"training wall time (min, {s['threads_per_side']} thread per side, both sides at once)")
    ax.set_ylabel(f"arith_dev accuracy (%, greedy, first {rep['eval_prompts']})")
    ax.set_title(
        f"GRPO on SmolLM2-135M-Instruct, {s['prompts_per_step']}x{s['group']} completions, {rep['precision']}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, default=3, help="runs per side: seeds --seed, --seed + 1, ...")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the --out report, run nothing")
    p.set_defaults(minutes=16.0, evals=4, tasks="grpo", out=None, workdir=os.path.join(ROOT, "output/grpo_race"))
    a = p.parse_args()
    out = a.out or os.path.join(
        ROOT, "output/grpo_race_quick.json" if a.quick else "bench/results/grpo_race_smollm2.json"
    )
    png = a.png or os.path.splitext(out)[0] + ".png"
    if a.plot_only:
        with open(out, encoding="utf-8") as f:
            plot(json.load(f), png)
        print(f"plot: {png}")
        return
    os.environ.update({k: v for k, v in env(a.threads).items() if k != "PYTHONPATH"})
    a.model_dir = a.model_dir or model_dir()
    if a.quick:
        a.minutes, a.evals, a.eval_prompts, a.seeds = min(a.minutes, 1.0), 1, min(a.eval_prompts, 16), min(a.seeds, 2)
        a.workdir += "_quick"
    root_workdir, first_seed = a.workdir, a.seed
    rep: dict = {
        "environment": harness.environment("bench/bench_grpo_race.py", sys.argv[1:], a, libs=("torch", "transformers")),
        "quick": a.quick,
        "precision": a.precision,
        "eval_prompts": a.eval_prompts,
        "seeds": [],
    }
    t = time.perf_counter()
    for seed in range(first_seed, first_seed + a.seeds):
        a.seed, a.workdir = seed, os.path.join(root_workdir, f"seed{seed}")
        print(f"=== seed {seed} ({time.strftime('%H:%M:%S')}) ===", flush=True)
        r = task_grpo(a)
        r["seed"] = seed
        rep["settings"] = {**r.pop("settings"), "seed": f"{first_seed}..{seed}"}
        rep["trl_version"] = r.get("trl", {}).get("trl_version", "")
        rep["seeds"].append(r)
        rep["summary"] = summarise(rep["seeds"])
        rep["total_wall_s"] = time.perf_counter() - t
        harness.write_report(out, rep, indent=1)
        plot(rep, png)
        for side in SIDES:
            if side in r:
                curve = [(round(c["wall_s"]), c["accuracy"]) for c in r[side]["curve"]]
                print(f"seed {seed} {side}: {r[side]['steps']} steps, curve {curve}", flush=True)
    print(json.dumps({k: v for k, v in rep["summary"].items() if k != "median_curves"}, indent=1))
    print(f"report: {out}\nplot: {png}")


if __name__ == "__main__":
    main()
