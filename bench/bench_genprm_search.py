"""Generative vs discriminative PRM on SmolLM2-135M-Instruct, and PRM-guided search against N (issue 29 item 4).

Not a test: a benchmark (CPU, fp32, ``--threads`` each run, default 1) that goes the way a user goes: JSON configs
written into ``--workdir`` (default ``output/bench_genprm_search/``) and passed to the entry points as subprocesses.

(a) **PRM kinds, same labels, same training wall time.** One pool of step-labelled arithmetic solutions (the first
    ``--records`` of ``llm/data/sample/prm_train.jsonl``); ``llm/run_critiques.py`` (template critiques, by label)
    turns the same records into the generative PRM's data, checked record by record (problem, steps, labels). Each
    kind trains from SmolLM2 with ``llm/run_reward.py`` (``llm/config/smollm2/prm_argument.json`` /
    ``genprm_argument.json``): a pilot of ``--pilot-steps`` measures its seconds per step (``train_runtime`` of
    the run's ``all_results.json``), then ``max_steps`` is set so the run takes ``--train-minutes``; each side's
    actual ``train_runtime`` is reported. Then an evaluation-only run per kind on the held-out
    ``llm/data/sample/processbench_dev.jsonl`` (no problem of it is in the training pool: checked) -> ProcessBench
    F1 at ``prm_threshold`` 0.5 and at the threshold tuned on the ``short`` subset (``prm_threshold_subset``),
    with the ``long`` subset's F1 at that threshold (the part the threshold was not tuned on).
(b) **Accuracy against N.** ``llm/run_search.py`` with the PRM of higher F1 (``--search-prm``), SmolLM2 as the
    policy, on the first ``--problems`` of ``llm/data/sample/prompts.jsonl`` (none in the PRM's training pool:
    checked): best-of-N (one draw of max N solutions; best_of_n / weighted_vote / majority_vote / pass at every N,
    ``beam_width`` 1 so N = 1 is allowed) and beam search / DVTS (``beam_width`` ``--beam-width``, so N from it).
    ``--policy sft`` searches with SmolLM2 after the ``policy`` stage: ``--policy-sft-steps`` of our SFT
    (``run_finetune.py``) on ``llm/data/sample_sft/sft_train.jsonl``'s worked solutions, one step per line (the
    PRM's step marker), any record whose problem is a search problem dropped (counted in the report).
    ``--search-methods`` runs a subset, so that two processes can share the search; ``--merge A.json,B.json``
    joins split reports (the two PRM kinds, the search methods) into ``--out`` and redraws the PNGs.

Outputs: the JSON report (``--out``, default ``bench/results/genprm_search_smollm2.json``; written after every
stage, ``"complete": false`` until both stages have finished) and two PNGs next to it (``*_f1.png``: F1 bars; ``*_search.png``:
accuracy against N, log2 x-axis). ``--stages`` picks stages (``prm``, ``search``; ``--stages ""`` only redraws the
PNGs); a ``search``-only run reads the PRMs' results from the existing report.

    python bench/bench_genprm_search.py --quick                 # tiny sizes: a smoke run of a few minutes
    python bench/bench_genprm_search.py                         # 5 train minutes per kind, 12 problems
    python bench/bench_genprm_search.py --stages policy,search --policy sft --search-prm discriminative
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import harness

CONFIGS = "llm/config/smollm2"
PRM_TRAIN = "llm/data/sample/prm_train.jsonl"
PROCESSBENCH = "llm/data/sample/processbench_dev.jsonl"
PROMPTS = "llm/data/sample/prompts.jsonl"
SFT_TRAIN = "llm/data/sample_sft/sft_train.jsonl"
KINDS = {"discriminative": "prm_argument.json", "generative": "genprm_argument.json"}
PB_KEYS = (
    "f1",
    "acc_error",
    "acc_correct",
    "short_f1",
    "long_f1",
    "best_threshold",
    "f1_at_best_threshold",
    "acc_error_at_best_threshold",
    "acc_correct_at_best_threshold",
    "short_f1_at_best_threshold",
    "long_f1_at_best_threshold",
)


def read_jsonl(path: str) -> list[dict]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return path


def write_json(path: str, obj) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
    return path


def env(threads: int) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": ROOT,
    }


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(a, script: str, config: str, log: str) -> float:
    """``python llm/<script> <config>`` with ``--threads`` threads, its output in ``log``; the wall seconds."""
    seconds = harness.run_entry_point(script, config, log, env(a.threads))
    print(f"  {seconds:.0f} s, load average {load()}", flush=True)
    return seconds


def remove_weights(directory: str) -> None:
    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        if name.endswith(".safetensors") or name.startswith("checkpoint-"):
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


# --------------------------------------------------------------------------------------------------------------
# (a) the two PRM kinds
# --------------------------------------------------------------------------------------------------------------
def make_data(a) -> dict:
    """The training pool (the first --records of prm_train) and its critiques by run_critiques.py; the checks."""
    data = os.path.join(a.workdir, "data")
    os.makedirs(data, exist_ok=True)
    pool = read_jsonl(PRM_TRAIN)[: a.records]
    disc = os.path.join(data, "prm_train.jsonl")
    with open(disc, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in pool)
    cfg = write_json(
        os.path.join(a.workdir, "critiques.json"),
        {
            "data_path": os.path.relpath(disc, ROOT),
            "reward_tokens": "+,-",
            "output_dir": os.path.relpath(os.path.join(data, "critiques"), ROOT),
            "overwrite_output_dir": True,
            "seed": a.seed,
        },
    )
    seconds = run(a, "run_critiques.py", cfg, os.path.join(a.workdir, "critiques.log"))
    gen = os.path.join(data, "critiques", "critiques.jsonl")
    critiqued = read_jsonl(gen)
    same = len(critiqued) == len(pool) and all(
        c["src"] == r["src"] and c["responses"] == r["responses"] and c["labels"] == r["labels"]
        for c, r in zip(critiqued, pool)
    )
    if not same:
        raise SystemExit(f"{gen}: not the same problems / steps / labels as {disc}")
    problems = {r["src"][0] for r in pool}
    pb_overlap = sum(r["problem"] in problems for r in read_jsonl(PROCESSBENCH))
    prompt_overlap = sum(r["src"] in problems for r in read_jsonl(PROMPTS))
    steps = sum(len(r["labels"]) for r in pool)
    wrong = sum(lab == "-" for r in pool for lab in r["labels"])
    return {
        "discriminative_train": os.path.relpath(disc, ROOT),
        "generative_train": os.path.relpath(gen, ROOT),
        "records": len(pool),
        "steps": steps,
        "negative_steps": wrong,
        "same_problems_steps_labels": same,
        "critiques": "template (run_critiques.py defaults: 'The step is right.' / 'The step has an error.')",
        "critiques_s": round(seconds, 1),
        "processbench_problems_in_pool": pb_overlap,
        "search_prompts_in_pool": prompt_overlap,
    }


def training_run_config(a, config: str, out: str, **fields) -> str:
    """``out``.json: the SmolLM2 ``config`` with ``fields``, training only (no dev split, no checkpoints, no
    reports), the model written to ``out``."""
    cfg = read_json(os.path.join(ROOT, CONFIGS, config))
    cfg.update(
        **fields,
        do_train=True,
        do_eval=False,
        save_strategy="no",
        report_to="none",
        seed=a.seed,
        output_dir=os.path.relpath(out, ROOT),
        overwrite_output_dir=True,
    )
    cfg.pop("dev_dataset_path", None)
    return write_json(out + ".json", cfg)


def logged_losses(out: str) -> tuple[list[dict], list[float]]:
    """The log history of the training run in ``out`` and its logged losses."""
    state = os.path.join(out, "trainer_state.json")
    history = read_json(state).get("log_history", []) if os.path.isfile(state) else []
    return history, [h["loss"] for h in history if "loss" in h]


def train_config(a, kind: str, train_path: str, steps: int, out: str) -> str:
    # do_eval false: the held-out evaluation is the ProcessBench run below
    return training_run_config(
        a,
        KINDS[kind],
        out,
        train_dataset_path=train_path,
        max_seq_len=a.seq_len,
        max_steps=steps,
        learning_rate=a.lr,
        warmup_steps=max(1, min(10, steps // 10)),
        logging_steps=max(1, min(10, steps // 5)),
    )


def train_runtime(out: str) -> float:
    for name in ("all_results.json", "train_results.json"):
        path = os.path.join(out, name)
        if os.path.isfile(path):
            return float(read_json(path)["train_runtime"])
    raise SystemExit(f"no train_runtime in {out}")


def processbench_eval(a, kind: str, model: str, out: str) -> dict:
    cfg = read_json(os.path.join(ROOT, CONFIGS, KINDS[kind]))
    cfg.update(
        model_name_or_path=os.path.relpath(model, ROOT),
        tokenizer_name_or_path=os.path.relpath(model, ROOT),
        init_from_config=False,
        do_train=False,
        do_eval=True,
        dev_dataset_path=PROCESSBENCH,
        max_eval_samples=a.pb_records,
        max_seq_len=a.seq_len,
        prm_threshold=0.5,
        prm_threshold_subset="short",
        **({"max_critique_tokens": a.critique_tokens} if kind == "generative" else {}),
        save_strategy="no",
        report_to="none",
        seed=a.seed,
        output_dir=os.path.relpath(out, ROOT),
        overwrite_output_dir=True,
    )
    cfg.pop("train_dataset_path", None)
    seconds = run(a, "run_reward.py", write_json(out + ".json", cfg), out + ".log")
    res = read_json(os.path.join(out, "eval_results.json"))
    got = {k: res.get("eval_processbench_" + k) for k in PB_KEYS}
    got["eval_s"] = round(seconds, 1)
    got["all"] = {k: v for k, v in res.items() if k.startswith("eval_processbench")}
    return got


def stage_prm(a, report: dict, save) -> None:
    data = make_data(a)
    report["data"] = data
    save()
    budget = 60.0 * a.train_minutes
    prm = report.setdefault("prm", {})
    for kind in a.kinds.split(","):
        out = os.path.join(a.workdir, f"{kind}_pilot")
        load0 = load()
        if a.s_per_step:  # measured before (e.g. by an earlier run of this kind): no pilot
            per_step = a.s_per_step
        else:
            run(a, "run_reward.py", train_config(a, kind, data[f"{kind}_train"], a.pilot_steps, out), out + ".log")
            per_step = train_runtime(out) / a.pilot_steps
            remove_weights(out)
        steps = max(1, int(budget / per_step))
        out = os.path.join(a.workdir, kind)
        run(a, "run_reward.py", train_config(a, kind, data[f"{kind}_train"], steps, out), out + ".log")
        tries = [{"max_steps": steps, "train_runtime_s": round(train_runtime(out), 1)}]
        # the pilot's first step carries the start-up and the load moves: one correction when the run missed the
        # budget by more than 20%, at the seconds per step the run itself measured
        if abs(train_runtime(out) - budget) > 0.2 * budget:
            steps = max(1, round(steps * budget / train_runtime(out)))
            run(a, "run_reward.py", train_config(a, kind, data[f"{kind}_train"], steps, out), out + ".log")
            tries.append({"max_steps": steps, "train_runtime_s": round(train_runtime(out), 1)})
        history, losses = logged_losses(out)
        prm[kind] = {
            "pilot_steps": None if a.s_per_step else a.pilot_steps,
            "pilot_s_per_step": round(per_step, 3),
            "max_steps": steps,
            "train_runtime_s": round(train_runtime(out), 1),
            "budget_s": budget,
            "tries": tries,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "loss_log": [{"step": h["step"], "loss": h["loss"]} for h in history if "loss" in h],
            "load_before": load0,
            "load_after_train": load(),
            "config": os.path.relpath(out + ".json", ROOT),
        }
        prm[kind]["processbench"] = processbench_eval(a, kind, out, out + "_processbench")
        prm[kind]["load_after_eval"] = load()
        save()
    f1 = {k: prm[k]["processbench"]["f1"] or 0.0 for k in KINDS if k in prm}
    prm["better_by_f1_at_0.5"] = max(f1, key=f1.get)
    save()


# --------------------------------------------------------------------------------------------------------------
# (b) search against N
# --------------------------------------------------------------------------------------------------------------
def stage_policy(a, report: dict, save) -> None:
    """The search's policy: SmolLM2 after ``--policy-sft-steps`` of our SFT on the worked solutions of
    ``sft_train.jsonl`` (one step per line, the PRM's step marker), none of whose problems is a search problem
    (checked); SmolLM2 itself answers these problems in its own words and rarely right (0-8% at N 1-16, 12-04)."""
    problems = {r["src"] for r in read_jsonl(PROMPTS)[: a.problems]}
    rows = read_jsonl(SFT_TRAIN)
    kept = [r for r in rows if first_user_message(r) not in problems]
    data = write_jsonl(os.path.join(a.workdir, "data", "policy_sft.jsonl"), kept)
    out = os.path.join(a.workdir, "policy_sft")
    cfg = training_run_config(
        a,
        "sft_argument.json",
        out,
        train_dataset_path=os.path.relpath(data, ROOT),
        max_steps=a.policy_sft_steps,
        learning_rate=a.policy_sft_lr,
        warmup_steps=max(1, a.policy_sft_steps // 10),
        logging_steps=max(1, a.policy_sft_steps // 10),
    )
    load0 = load()
    seconds = run(a, "run_finetune.py", cfg, out + ".log")
    _, losses = logged_losses(out)
    report["policy"] = {
        "model": os.path.relpath(out, ROOT),
        "from": "SmolLM2-135M-Instruct",
        "sft_data": SFT_TRAIN,
        "sft_records": len(kept),
        "sft_records_dropped_as_search_problems": len(rows) - len(kept),
        "max_steps": a.policy_sft_steps,
        "learning_rate": a.policy_sft_lr,
        "train_s": round(seconds, 1),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "load_before": load0,
        "load_after": load(),
        "config": os.path.relpath(out + ".json", ROOT),
    }
    save()


def first_user_message(record: dict) -> str:
    """An SFT record's problem: its ``src`` (a list of turns, or one string), or its first user message."""
    if "messages" in record:
        return next(m["content"] for m in record["messages"] if m["role"] == "user")
    src = record["src"]
    return src[0] if isinstance(src, list) else src


def policy_model(a, report: dict) -> str:
    """``--policy``: base (SmolLM2 itself) or sft (the policy stage's model, from this run or an earlier one)."""
    if a.policy == "base":
        from llm.utils.gguf import smollm2_dir

        return smollm2_dir()
    # this report's policy stage, else one an earlier run left in --workdir (a search split across processes)
    model = report.get("policy", {}).get("model") or os.path.relpath(os.path.join(a.workdir, "policy_sft"), ROOT)
    if not os.path.isfile(os.path.join(ROOT, model, "config.json")):
        raise SystemExit(f"--policy sft: no model in {model}: run --stages policy first (same --workdir)")
    return os.path.join(ROOT, model)


def search_config(
    a, kind: str, model: str, policy: str, methods: list[str], budgets: list[int], width: int, out: str
) -> str:
    cfg = read_json(os.path.join(ROOT, CONFIGS, "search_argument.json"))
    cfg["policy"].update(
        model_name_or_path=os.path.relpath(policy, ROOT),
        max_new_tokens=a.max_new_tokens,
        max_step_tokens=a.max_step_tokens,
        batch_size=64,
    )
    prm = {"kind": kind, "model_name_or_path": os.path.relpath(model, ROOT), "reward_tokens": "+,-"}
    if kind == "discriminative":
        prm.update(placeholder_token="§", micro_batch_size=16)
    else:
        prm.update(max_critique_tokens=a.critique_tokens)
    cfg["prm"] = prm
    cfg["data"].update(problems_path=PROMPTS, max_problems=a.problems)
    cfg["search"].update(
        methods=methods,
        budgets=budgets,
        beam_width=width,
        max_steps=a.search_max_steps,
        seed=a.seed,
        output_dir=os.path.relpath(out, ROOT),
    )
    return write_json(out + ".json", cfg)


def stage_search(a, report: dict, save) -> None:
    prm = report.get("prm", {})
    kind = a.search_prm if a.search_prm != "auto" else prm.get("better_by_f1_at_0.5")
    if kind is None:
        raise SystemExit("--search-prm auto needs the prm stage's results (run --stages prm first)")
    model = os.path.join(a.workdir, kind)
    policy = policy_model(a, report)
    budgets = [int(n) for n in a.budgets.split(",")]
    tree_budgets = [n for n in budgets if n >= a.beam_width and n % a.beam_width == 0]
    methods = a.search_methods.split(",")
    search = {
        "prm": kind,
        "prm_choice": "--search-prm " + a.search_prm,
        "policy": os.path.relpath(policy, ROOT),
        "methods": methods,
        "problems": a.problems,
        "budgets": budgets,
        "beam_width_tree": a.beam_width,
        "policy_max_new_tokens": a.max_new_tokens,
        "policy_max_step_tokens": a.max_step_tokens,
        "max_steps": a.search_max_steps,
        "load_before": load(),
    }
    report["search"] = search
    # best-of-N first (one draw of max N serves every N), then the tree searches one (N, method) per run in
    # ascending N, so that a run stopped early still has the small budgets of both methods
    runs = [("best_of_n", ["best_of_n"], budgets, 1)] if "best_of_n" in methods else []
    trees = [m for m in ("beam_search", "dvts") if m in methods]
    runs += [(f"{m}@{n}", [m], [n], a.beam_width) for n in tree_budgets for m in trees]
    metrics: dict = {}
    search["runs"] = {}
    for name, run_methods, ns, width in runs:
        out = os.path.join(a.workdir, "search_" + name.replace("@", "_"))
        seconds = run(
            a, "run_search.py", search_config(a, kind, model, policy, run_methods, ns, width, out), out + ".log"
        )
        got = read_json(os.path.join(out, "search_metrics.json"))
        metrics.update({k: v for k, v in got.items() if "@" in k})
        search["runs"][name] = {
            "seconds": round(seconds, 1),
            "load_after": load(),
            **{k: v for k, v in got.items() if "@" not in k},
        }
        search["metrics"] = metrics
        curves: dict = {}
        for key, value in metrics.items():
            method, n = key.rsplit("@", 1)
            curves.setdefault(method, {})[int(n)] = value
        search["curves"] = {m: dict(sorted(c.items())) for m, c in curves.items()}
        save()
    search["finished"] = True


def merge_reports(reports: list[dict]) -> dict:
    """One report from runs split across processes: every PRM kind, the policy, the search runs, metrics and curves
    of each, and every invocation's environment. Two reports with the same PRM kind or search run stop it."""
    out: dict = {"environments": [], "quick": any(r.get("quick") for r in reports), "merged_from": len(reports)}
    for r in reports:
        out["environments"] += r.get("environments", [])
        for kind, value in r.get("prm", {}).items():
            if kind in KINDS and kind in out.setdefault("prm", {}):
                raise SystemExit(f"--merge: PRM kind {kind} in two reports")
            if kind in KINDS or kind not in out["prm"]:
                out["prm"][kind] = value
        if "data" in r:
            out.setdefault("data", r["data"])
        if "policy" in r:
            out["policy"] = r["policy"]
        if "search" in r:
            s = out.setdefault("search", {"runs": {}, "metrics": {}})
            for name in r["search"].get("runs", {}):
                if name in s["runs"]:
                    raise SystemExit(f"--merge: search run {name} in two reports")
            s.update({k: v for k, v in r["search"].items() if k not in ("runs", "metrics", "curves", "methods")})
            s["runs"].update(r["search"].get("runs", {}))
            s["metrics"].update(r["search"].get("metrics", {}))
            s["methods"] = sorted({*s.get("methods", []), *r["search"].get("methods", [])})
            s["finished"] = all(x["search"].get("finished", False) for x in reports if "search" in x)
    prm = out.get("prm", {})
    f1 = {k: prm[k]["processbench"]["f1"] or 0.0 for k in KINDS if k in prm}
    if f1:
        prm["better_by_f1_at_0.5"] = max(f1, key=f1.get)
    if "search" in out:
        curves: dict = {}
        for key, value in out["search"]["metrics"].items():
            method, n = key.rsplit("@", 1)
            curves.setdefault(method, {})[int(n)] = value
        out["search"]["curves"] = {m: dict(sorted(c.items())) for m, c in curves.items()}
    out["complete"] = bool(f1) and out.get("search", {}).get("finished", False)
    return out


# --------------------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------------------
def plot(report: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = os.path.splitext(out)[0]
    prm = report.get("prm", {})
    kinds = [k for k in KINDS if k in prm]
    if kinds:
        fig, ax = plt.subplots(figsize=(7.5, 4))
        bars = [
            ("all, threshold 0.5", "f1"),
            ("all, threshold\ntuned on 'short'", "f1_at_best_threshold"),
            ("'long' only,\nthe same threshold", "long_f1_at_best_threshold"),
        ]
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            pb = prm[kind]["processbench"]
            vals = [pb.get(key) or 0.0 for _, key in bars]
            xs = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(bars))]
            label = f"{kind} ({prm[kind]['max_steps']} steps, {prm[kind]['train_runtime_s']:.0f} s)"
            rects = ax.bar(xs, vals, width, label=label)
            ax.bar_label(rects, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(len(bars)), [b for b, _ in bars])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("ProcessBench F1 (held-out)")
        ax.set_title(
            f"SmolLM2-135M PRMs, same labels, same training wall time; {prm[kinds[0]]['processbench']['all'].get('eval_processbench_correct', 0) + prm[kinds[0]]['processbench']['all'].get('eval_processbench_erroneous', 0):.0f} ProcessBench records",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(stem + "_f1.png", dpi=110)
        plt.close(fig)
    curves = report.get("search", {}).get("curves")
    if curves:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        styles = {"pass": ":", "majority_vote": "--", "weighted_vote": "-."}
        markers = iter("osD^vx*")
        top = 0.0
        for method, c in curves.items():
            ns = sorted(int(n) for n in c)
            ys = [c[n] if n in c else c[str(n)] for n in ns]
            top = max(top, *ys)
            ax.plot(ns, ys, styles.get(method, "-"), marker=next(markers, "o"), alpha=0.8, label=method)
        ax.set_xscale("log", base=2)
        ticks = sorted({int(n) for c in curves.values() for n in c})
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.set_ylim(-0.02, max(0.3, 1.15 * top))
        ax.set_xlabel("N (generations per step; best-of-N: solutions)")
        ax.set_ylabel("accuracy (held-out problems)")
        s = report["search"]
        policy = "SmolLM2-135M after SFT" if "policy_sft" in s.get("policy", "") else "SmolLM2-135M"
        ax.set_title(f"{policy} policy, {s['prm']} PRM, {s['problems']} held-out problems", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(stem + "_search.png", dpi=110)
        plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few minutes")
    p.add_argument("--stages", default="prm,search", help="comma-separated: prm, policy, search ('' only redraws)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="the PRM kinds the prm stage trains (comma-separated); one kind: the other's results kept from --out",
    )
    p.add_argument("--records", type=int, default=6000, help="the training pool: the first N of prm_train")
    p.add_argument("--train-minutes", type=float, default=5.0, help="training wall time per PRM kind")
    p.add_argument("--pilot-steps", type=int, default=6)
    p.add_argument("--s-per-step", type=float, default=None, help="seconds per training step: no pilot run")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--pb-records", type=int, default=60, help="the first N processbench_dev records evaluated (of 120)")
    p.add_argument(
        "--critique-tokens",
        type=int,
        default=8,
        help="generative PRM scoring: max_critique_tokens (the template critiques are 5-6 SmolLM2 tokens)",
    )
    p.add_argument("--search-prm", default="auto", choices=("auto", *KINDS))
    p.add_argument(
        "--policy", default="base", choices=("base", "sft"), help="the search's policy (sft: --stages policy)"
    )
    p.add_argument("--policy-sft-steps", type=int, default=40, help="policy stage: SFT steps (1024-token packed rows)")
    p.add_argument("--policy-sft-lr", type=float, default=2e-5)
    p.add_argument("--search-methods", default="best_of_n,beam_search,dvts", help="comma-separated, a subset")
    p.add_argument(
        "--merge",
        help="comma-separated reports of runs split across processes (e.g. the two PRM kinds, the search methods): "
        "merged into --out, then the PNGs redrawn; nothing is run",
    )
    p.add_argument("--problems", type=int, default=12)
    p.add_argument("--budgets", default="1,2,4,8,16")
    p.add_argument("--beam-width", type=int, default=2, help="beam search / DVTS: M (their N from M up)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-step-tokens", type=int, default=32)
    p.add_argument("--search-max-steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--workdir", default=os.path.join(ROOT, "output", "bench_genprm_search"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "genprm_search_smollm2.json"))
    if "--quick" in sys.argv[1:]:  # tiny sizes unless given on the command line
        workdir = os.path.join(p.get_default("workdir"), "quick")
        p.set_defaults(
            records=300,
            train_minutes=0.5,
            pilot_steps=2,
            pb_records=16,
            problems=3,
            budgets="1,2,4",
            max_new_tokens=48,
            max_step_tokens=24,
            search_max_steps=3,
            workdir=workdir,
            out=os.path.join(workdir, "quick.json"),
        )
    a = p.parse_args()
    if a.merge:
        report = merge_reports([read_json(path) for path in a.merge.split(",")])
        harness.write_report(a.out, report)
        plot(report, a.out)
        print("merged into", a.out, "plots:", os.path.splitext(a.out)[0] + "_{f1,search}.png")
        return
    a.workdir = os.path.abspath(a.workdir)
    os.makedirs(a.workdir, exist_ok=True)
    stages = [s for s in a.stages.split(",") if s]
    fresh = "prm" in stages and set(a.kinds.split(",")) >= set(KINDS)
    report = read_json(a.out) if os.path.isfile(a.out) and not fresh else {}
    if stages:
        from llm.utils.gguf import smollm2_dir

        print("model:", smollm2_dir(), flush=True)  # converts the GGUF once (or waits for the conversion)
        environment = harness.environment("bench/bench_genprm_search.py", sys.argv[1:], a)
        environment.update(threads=a.threads, stages=stages, load_at_start=load())
        report.setdefault("environments", []).append(environment)  # one per invocation (prm, then search)
        report["quick"] = a.quick
        report["complete"] = False

    def save() -> None:
        harness.write_report(a.out, report)

    t = time.perf_counter()
    if "prm" in stages:
        stage_prm(a, report, save)
    if "policy" in stages:
        stage_policy(a, report, save)
    if "search" in stages:
        stage_search(a, report, save)
    if stages:
        report["complete"] = "prm" in report and report.get("search", {}).get("finished", False)
        environment["total_s"] = round(time.perf_counter() - t, 1)
        environment["load_at_end"] = load()
        save()
    plot(report, a.out)
    print("plots:", os.path.splitext(a.out)[0] + "_{f1,search}.png")


if __name__ == "__main__":
    main()
