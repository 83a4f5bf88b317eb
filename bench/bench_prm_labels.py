"""Step labels from rollouts against the true first error (issue 28 item 2), on SmolLM2-135M-Instruct (CPU).

Not a test: a measurement. The arithmetic word problems of the sample-data generator (``llm.data.sample_problems``:
each wrong solution carries one injected error at a known step and follows the wrong value honestly, so the true
labels are ``+`` before the first error and ``-`` from it on) are drawn afresh with this script's seed, held out
from every bundled sample file. Their given solutions are labelled by ``llm/run_label.py`` (the user's path: a
config file written here, the entry point run as a subprocess) with SmolLM2-135M-Instruct as the completer:

- ``math_shepherd``: every step's prefix completed ``--completions`` times; one run gives the **hard** estimate
  (``+`` when any completion reaches the answer) and the **soft** one (the fraction that does; a step counts as
  ``-`` below ``--soft-threshold``);
- ``omegaprm``: OmegaPRM's binary search for the first step whose prefix has no right completion (on solutions whose
  own answer is wrong; a right one is all ``+`` for free).

For each: agreement of the first ``-`` step with the true first error (overall, on wrong and on right solutions,
and their ProcessBench-style F1), step-level accuracy and F1 of the ``-`` class against the true labels, the
completions generated (``report.json``) and wall time. Then two PRMs (``llm/run_reward.py``,
``llm/config/smollm2/prm_argument.json``: the same steps, learning rate, seed and data size) are trained, one on the
Math-Shepherd hard labels and one on the true labels of the same solutions, and each is evaluated by an
evaluation-only run on a held-out ProcessBench-format set drawn from the same generator (``processbench_f1`` at
threshold 0.5); the untrained model's readout too.

Usage (from the repository root, in ``.venv``; ``--quick``: a smoke run of a few minutes)::

    python bench/bench_prm_labels.py [--quick] [--problems 24] [--completions 8] [--prm-steps 30]
        [--out bench/results/prm_labels_smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import harness

LABEL_CONFIG = "llm/config/smollm2/label_argument.json"
PRM_CONFIG = "llm/config/smollm2/prm_argument.json"
SAMPLE_FILES = ("prm_train.jsonl", "prm_dev.jsonl", "processbench_dev.jsonl", "pairs_train.jsonl", "pairs_dev.jsonl")
METHODS = ("hard", "soft", "omegaprm")


# --------------------------------------------------------------------------------------------------------------
# The held-out problems, their solutions and true labels
# --------------------------------------------------------------------------------------------------------------
def bundled_questions() -> set[str]:
    """Every question of the bundled sample files (kept out of the drawn sets)."""
    seen: set[str] = set()
    for name in SAMPLE_FILES:
        path = os.path.join(ROOT, "llm", "data", "sample", name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    q = rec.get("problem") or rec.get("src") or rec.get("prompt")
                    for text in q if isinstance(q, list) else [q]:
                        if isinstance(text, str):
                            seen.add(text)
    return seen


def draw(rng: random.Random, n: int, p_correct: float, seen: set[str]) -> list[dict]:
    """``n`` problems with a given solution each: right with probability ``p_correct``, else one visible error of
    the generator's PRM mix (``solve_prm``). Each: question, reference answer, steps, true labels, first error."""
    from llm.data.sample_problems import TEMPLATES, render_problem, solve_prm

    out: list[dict] = []
    while len(out) < n:
        problem = rng.choice(TEMPLATES)(rng)
        right = render_problem(problem, None)
        if right is None or problem.question in seen:
            continue
        seen.add(problem.question)
        answer = right[2]
        if rng.random() < p_correct:
            steps, labels, kind = right[0], right[1], "none"
        else:
            steps, labels, _, error = solve_prm(rng, problem)
            kind = error.kind
        first = next((i for i, lab in enumerate(labels) if lab == "-"), -1)
        out.append(
            {"question": problem.question, "answer": str(answer), "steps": steps, "labels": labels,
             "first_error": first, "kind": kind}
        )  # fmt: skip
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def processbench_rows(items: list[dict]) -> list[dict]:
    """ProcessBench's format (as ``llm.data.make_sample_data.make_processbench``): subset short / long by length."""
    return [
        {
            "id": f"{'short' if len(it['steps']) <= 3 else 'long'}-{i}",
            "generator": "sample_problems",
            "problem": it["question"],
            "steps": it["steps"],
            "final_answer_correct": it["first_error"] == -1,
            "label": it["first_error"],
        }
        for i, it in enumerate(items)
    ]


# --------------------------------------------------------------------------------------------------------------
# Running the entry points
# --------------------------------------------------------------------------------------------------------------
def env(threads: int) -> dict:
    return harness.worker_env(
        threads, MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
    )  # fmt: skip


def run(a, script: str, config: str, log_path: str, flags: dict | None = None) -> float:
    """``python llm/<script> <config> [--k v ...]``, its output in ``log_path``; returns the wall seconds."""
    return harness.run_entry_point(script, config, log_path, env(a.threads), flags)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def label(a, method: str, problems_path: str, model: str) -> dict:
    """One ``llm/run_label.py`` run through a config file (the smollm2 label config with this benchmark's values)."""
    with open(os.path.join(ROOT, LABEL_CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    out_dir = os.path.join(a.workdir, f"labels_{method}")
    shutil.rmtree(out_dir, ignore_errors=True)  # a run of the same settings would resume: time it afresh
    config.update(
        problems_path=problems_path,
        max_problems=None,
        model_name_or_path=model,
        method=method,
        num_completions=a.completions,
        temperature=a.temperature,
        max_new_tokens=a.new_tokens,
        generation_batch_size=a.generation_batch,
        output_dir=out_dir,
        overwrite_output_dir=True,
        seed=a.seed,
    )
    config.pop("num_solutions", None)  # the problems give their solutions (omegaprm refuses the field)
    path = os.path.join(a.workdir, f"label_{method}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    before = load()
    seconds = run(a, "run_label.py", path, out_dir + ".log")
    with open(os.path.join(out_dir, "report.json"), encoding="utf-8") as f:
        report = json.load(f)
    return {"config": config, "report": report, "wall_s": seconds, "load_before": before, "load_after": load(),
            "records": read_jsonl(os.path.join(out_dir, "labels.jsonl"))}  # fmt: skip


def reused_labels(a, method: str) -> dict:
    """The labels of an earlier run of this script in the same ``--workdir`` (same seed and sizes), with the wall
    time and load its report (``--reuse-labels``) recorded: only the PRMs are trained and evaluated again."""
    with open(a.reuse_labels, encoding="utf-8") as f:
        before = json.load(f)
    out_dir = os.path.join(a.workdir, f"labels_{method}")
    with open(os.path.join(out_dir, "report.json"), encoding="utf-8") as f:
        rep = json.load(f)
    if rep != before["label_reports"][method]:
        raise SystemExit(f"{out_dir}/report.json is not the one of {a.reuse_labels}: label again (no --reuse-labels)")
    timed = before["labelling"]["omegaprm" if method == "omegaprm" else "hard"]
    config = before["environment"]["settings"]
    for name in ("problems", "completions", "p_correct", "seed", "temperature", "new_tokens"):
        if config[name] != getattr(a, name):
            raise SystemExit(f"--{name.replace('_', '-')} differs from {a.reuse_labels}'s: {config[name]}")
    return {"report": rep, "wall_s": timed["wall_s"], "load_before": timed["load_before"],
            "load_after": timed["load_after"], "records": read_jsonl(os.path.join(out_dir, "labels.jsonl"))}  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Agreement with the truth
# --------------------------------------------------------------------------------------------------------------
def first_minus(labels: list[bool]) -> int:
    return next((i for i, right in enumerate(labels) if not right), -1)


def agreement(truth: list[dict], predicted: dict[int, list[bool]]) -> dict:
    """``predicted``: problem index -> per-step ``+`` (True) / ``-``; scored against the true labels."""
    hit_err = n_err = hit_ok = n_ok = 0
    tp = fp = fn = right_steps = steps = 0
    early = late = 0
    for i, t in enumerate(truth):
        if i not in predicted:
            continue
        pred, true = predicted[i], [lab == "+" for lab in t["labels"]]
        f = first_minus(pred)
        if t["first_error"] == -1:
            n_ok += 1
            hit_ok += f == -1
        else:
            n_err += 1
            hit_err += f == t["first_error"]
            early += f != -1 and f < t["first_error"]
            late += f == -1 or f > t["first_error"]
        for p, q in zip(pred, true):
            steps += 1
            right_steps += p == q
            tp += (not p) and (not q)
            fp += (not p) and q
            fn += p and (not q)
    acc_err = hit_err / n_err if n_err else None
    acc_ok = hit_ok / n_ok if n_ok else None
    prec = tp / (tp + fp) if tp + fp else None
    rec = tp / (tp + fn) if tp + fn else None
    return {
        "solutions": n_err + n_ok,
        "first_error_agreement": (hit_err + hit_ok) / (n_err + n_ok) if n_err + n_ok else None,
        "acc_error": acc_err,
        "acc_correct": acc_ok,
        "first_error_f1": 2 * acc_err * acc_ok / (acc_err + acc_ok) if acc_err is not None and acc_ok is not None
        and acc_err + acc_ok else 0.0,
        "first_error_too_early": early,
        "first_error_too_late_or_missed": late,
        "step_accuracy": right_steps / steps if steps else None,
        "minus_precision": prec,
        "minus_recall": rec,
        "minus_f1": 2 * prec * rec / (prec + rec) if prec and rec else 0.0,
        "steps": steps,
    }  # fmt: skip


def predictions(records: list[dict], kind: str, threshold: float) -> dict[int, list[bool]]:
    out = {}
    for r in records:
        if kind == "soft":  # a step without a value (none here: Math-Shepherd values every step) keeps its hard label
            out[r["problem_index"]] = [
                (v >= threshold) if v is not None else lab == "+" for v, lab in zip(r["soft_labels"], r["labels"])
            ]
        else:
            out[r["problem_index"]] = [lab == "+" for lab in r["labels"]]
    return out


def soft_separation(truth: list[dict], records: list[dict]) -> dict:
    """Mean Monte Carlo value of the prefixes ending at a truly right step and at a truly wrong one (the last step,
    whose value is the solution's own checked answer, left out), and how often a right prefix reached the answer."""
    pos, neg = [], []
    for r in records:
        t = truth[r["problem_index"]]
        for lab, v in list(zip(t["labels"], r["soft_labels"]))[:-1]:
            if v is not None:
                (pos if lab == "+" else neg).append(v)
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return {
        "mean_value_right_prefix": mean(pos),
        "mean_value_wrong_prefix": mean(neg),
        "right_prefixes": len(pos),
        "wrong_prefixes": len(neg),
        "right_prefixes_never_completed_right": sum(v == 0 for v in pos),
        "wrong_prefixes_completed_right_at_least_once": sum(v > 0 for v in neg),
    }


# --------------------------------------------------------------------------------------------------------------
# The two PRMs
# --------------------------------------------------------------------------------------------------------------
def prm_flags(a, model: str, out_dir: str) -> dict:
    return {
        "model_name_or_path": model,
        "tokenizer_name_or_path": model,
        "output_dir": out_dir,
        "overwrite_output_dir": "true",
        "save_strategy": "no",
        "report_to": "none",
        "seed": a.seed,
        "max_seq_len": a.seq_len,
        "max_prompt_len": min(256, a.seq_len // 2),
        "logging_steps": 5,
    }


def train_prm(a, name: str, train_path: str, base: str) -> dict:
    out = os.path.join(a.workdir, f"prm_{name}")
    flags = prm_flags(a, base, out) | {
        "train_dataset_path": train_path,
        "dev_dataset_path": train_path,  # do_eval false: nothing is evaluated here
        "do_eval": "false",
        "max_steps": a.prm_steps,
        "learning_rate": a.prm_lr,
        "warmup_steps": a.prm_warmup,
    }
    before = load()
    seconds = run(a, "run_reward.py", os.path.join(ROOT, PRM_CONFIG), out + ".log", flags)
    state = {}
    if os.path.isfile(os.path.join(out, "trainer_state.json")):
        with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
            state = json.load(f)
    losses = [h["loss"] for h in state.get("log_history", []) if "loss" in h]
    return {"dir": out, "wall_s": seconds, "load_before": before, "load_after": load(), "losses": losses,
            "steps": state.get("global_step"), "flags": flags}  # fmt: skip


def evaluate_prm(a, name: str, model: str, bench_path: str) -> dict:
    out = os.path.join(a.workdir, f"pb_{name}")
    flags = prm_flags(a, model, out) | {"do_train": "false", "do_eval": "true", "dev_dataset_path": bench_path}
    if a.tune_subset:  # also F1 at the threshold that maximises it on that subset (of this same set: optimistic)
        flags["prm_threshold_subset"] = a.tune_subset
    seconds = run(a, "run_reward.py", os.path.join(ROOT, PRM_CONFIG), out + ".log", flags)
    with open(os.path.join(out, "eval_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    keep = {k[5:]: None if isinstance(v, float) and math.isnan(v) else v  # NaN: a subset without such solutions
            for k, v in results.items() if k.startswith("eval_processbench")}  # fmt: skip
    return {"wall_s": seconds, **keep}


def remove_weights(directory: str) -> None:
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(directory, name))


# --------------------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 problems, 2 completions, 2 PRM steps")
    p.add_argument("--problems", type=int, default=24, help="labelled problems (one given solution each)")
    p.add_argument("--p-correct", type=float, default=0.35, help="share of labelled solutions without an error")
    p.add_argument("--completions", type=int, default=8, help="completions per estimated prefix (N, OmegaPRM's k)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--new-tokens", type=int, default=48, help="max_new_tokens of a completion")
    p.add_argument("--generation-batch", type=int, default=64, help="generation_batch_size of run_label")
    p.add_argument("--soft-threshold", type=float, default=0.5, help="a soft label below it counts as '-'")
    p.add_argument("--bench-problems", type=int, default=40, help="held-out ProcessBench-format solutions")
    p.add_argument("--prm-steps", type=int, default=30)
    p.add_argument("--prm-lr", type=float, default=3e-5)
    p.add_argument("--prm-warmup", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512, help="max_seq_len (packed row) of the PRMs")
    p.add_argument("--no-baseline", action="store_true", help="skip the untrained model's ProcessBench run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=20261204)
    p.add_argument("--workdir", default=os.path.join(ROOT, "output", "prm_labels"))
    p.add_argument("--keep-weights", action="store_true")
    p.add_argument(
        "--tune-subset", help="also report F1 at the threshold best on this subset of the set (short / long)"
    )
    p.add_argument(
        "--reuse-labels", metavar="REPORT", help="an earlier report of this script with the same --workdir and "
        "label settings: reuse its labels (and their wall time), train and evaluate the PRMs only",
    )  # fmt: skip
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "prm_labels_smollm2.json"))
    a = p.parse_args()
    if a.quick:
        a.problems, a.completions, a.bench_problems, a.prm_steps = 4, 2, 8, 2
        a.prm_warmup, a.new_tokens, a.seq_len = 0, 32, 256
        a.workdir += "_quick"
        if a.out == p.get_default("out"):
            a.out = os.path.join(ROOT, "output", "prm_labels_quick.json")
    os.makedirs(a.workdir, exist_ok=True)
    started = time.perf_counter()
    report: dict = {"environment": harness.environment("bench/bench_prm_labels.py", sys.argv[1:], a),
                    "load_start": load()}  # fmt: skip
    report["environment"]["threads_per_process"] = a.threads

    from llm.utils.gguf import smollm2_dir

    model = smollm2_dir()

    # --- the data: labelled problems and a disjoint ProcessBench set, neither in the bundled samples
    rng = random.Random(a.seed)
    seen = bundled_questions()
    truth = draw(rng, a.problems, a.p_correct, seen)
    bench_items = draw(rng, a.bench_problems, 0.5, seen)
    problems_path = os.path.join(a.workdir, "problems.jsonl")
    write_jsonl(problems_path, [{"src": t["question"], "tgt": t["answer"], "responses": t["steps"]} for t in truth])
    bench_path = os.path.join(a.workdir, "processbench_heldout.jsonl")
    write_jsonl(bench_path, processbench_rows(bench_items))
    kinds = {}
    for t in truth:
        kinds[t["kind"]] = kinds.get(t["kind"], 0) + 1
    report["data"] = {
        "labelled_solutions": len(truth),
        "labelled_with_error": sum(t["first_error"] >= 0 for t in truth),
        "error_kinds": kinds,
        "labelled_steps": sum(len(t["steps"]) for t in truth),
        "bench_solutions": len(bench_items),
        "bench_with_error": sum(t["first_error"] >= 0 for t in bench_items),
        "example": truth[next((i for i, t in enumerate(truth) if t["first_error"] >= 0), 0)],
    }
    print(json.dumps(report["data"], indent=1), flush=True)

    # --- labelling: one Math-Shepherd run (hard and soft), one OmegaPRM run
    if a.reuse_labels:
        runs = {m: reused_labels(a, m) for m in ("math_shepherd", "omegaprm")}
        report["labels_reused_from"] = os.path.relpath(a.reuse_labels, ROOT)
    else:
        runs = {m: label(a, m, problems_path, model) for m in ("math_shepherd", "omegaprm")}
    for m, r in runs.items():
        print(f"{m}: {r['wall_s']:.0f} s, report {json.dumps(r['report'])}", flush=True)
    ms, om = runs["math_shepherd"]["records"], runs["omegaprm"]["records"]
    preds = {"hard": predictions(ms, "hard", 0), "soft": predictions(ms, "soft", a.soft_threshold),
             "omegaprm": predictions(om, "hard", 0)}  # fmt: skip
    labelling = {}
    for method in METHODS:
        r = runs["omegaprm" if method == "omegaprm" else "math_shepherd"]
        rep = r["report"]
        labelling[method] = {
            **agreement(truth, preds[method]),
            "run": "omegaprm" if method == "omegaprm" else "math_shepherd (shared by hard and soft)",
            "completions": rep["completions"],
            "unfinished_completions": rep["unfinished_completions"],
            "estimates": rep["estimates"],
            "completions_per_solution": rep["completions"] / max(rep["solutions"], 1),
            "completions_per_labelled_step": rep["completions_per_labelled_step"],
            "wall_s": r["wall_s"],
            "load_before": r["load_before"],
            "load_after": r["load_after"],
        }
    labelling["soft"]["threshold"] = a.soft_threshold
    labelling["soft"]["separation"] = soft_separation(truth, ms)
    report["labelling"] = labelling
    report["label_reports"] = {m: r["report"] for m, r in runs.items()}
    report["solutions"] = [
        {"first_error": t["first_error"], "kind": t["kind"], "n_steps": len(t["steps"]),
         "hard": "".join("+" if x else "-" for x in preds["hard"].get(i, [])),
         "soft": [r["soft_labels"] for r in ms if r["problem_index"] == i][:1],
         "omegaprm": "".join("+" if x else "-" for x in preds["omegaprm"].get(i, []))}
        for i, t in enumerate(truth)
    ]  # fmt: skip
    print(json.dumps(labelling, indent=1), flush=True)
    harness.write_report(a.out, report)  # partial: the labels are worth keeping if training fails

    # --- two PRMs on the same solutions: Math-Shepherd hard labels vs the true labels
    mc_path = os.path.join(a.workdir, "train_mc_hard.jsonl")
    true_path = os.path.join(a.workdir, "train_true.jsonl")
    mc_rows, true_rows = [], []
    for r in ms:
        base = {"src": r["src"], "tgt": r["tgt"], "responses": r["responses"]}
        mc_rows.append({**base, "labels": r["labels"]})
        true_rows.append({**base, "labels": truth[r["problem_index"]]["labels"]})
    write_jsonl(mc_path, mc_rows)
    write_jsonl(true_path, true_rows)
    prms = {}
    if not a.no_baseline:
        prms["untrained"] = {"processbench": evaluate_prm(a, "untrained", model, bench_path)}
        print("untrained:", json.dumps(prms["untrained"]), flush=True)
    for name, path in (("mc_hard", mc_path), ("true", true_path)):
        trained = train_prm(a, name, path, model)
        trained["processbench"] = evaluate_prm(a, name, trained["dir"], bench_path)
        if not a.keep_weights:
            remove_weights(trained["dir"])
        prms[name] = trained
        print(name, json.dumps({k: v for k, v in trained.items() if k != "flags"}), flush=True)
        report["prms"] = prms
        harness.write_report(a.out, report)
    report["total_wall_s"] = time.perf_counter() - started
    report["load_end"] = load()
    harness.write_report(a.out, report)


if __name__ == "__main__":
    main()
