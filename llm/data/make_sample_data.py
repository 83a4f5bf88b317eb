"""Deterministic generator of the small bundled data sets in ``llm/data/sample/``.

Run from the repository root::

    python -m llm.data.make_sample_data [--out-dir DIR]

Everything comes from arithmetic word problems made here (standard library only, fixed
seeds), so the files are byte-identical on every run and every machine. Numbers stay small
(question operands 1-9, every result 0-99) so that a 2-layer transformer trained for a few
CPU minutes can learn to spot a wrong step.

A solution is a list of steps; each computational step shows one equation ``a op b = c``
and the last step is ``The answer is c.``. A wrong solution carries exactly one error and
then follows the wrong value honestly, which gives Math-Shepherd style labels: a step is
``+`` only if it and every earlier step are right, so the first wrong step and every later
step are ``-``. Error kinds:

- ``echo``: the result just repeats the number before ``=`` (``3 * 4 = 4``; PRM files only);
- ``result``: the equation's result is off by 1-3 (``3 * 4 = 13``);
- ``carry``: an earlier result is copied wrongly into the equation (the operand matches no
  number of the question and no earlier result), the arithmetic itself is right;
- ``answer``: the final answer does not repeat the last result.

The pair files draw ``result`` (at any step), ``carry`` and ``answer`` errors. The PRM files
use their own mix, ``PRM_ERROR_MIX``, chosen so that the tiny CPU demo model visibly learns
in minutes: mostly ``echo`` errors, at any step whose second operand is a (one-digit) number
of the question, so spotting one compares two digits a fixed three tokens apart, which a
2-layer model learns quickly (multiplication tables and comparisons across steps take it far
longer); and some ``result``, ``carry`` (both in the last equation) and ``answer`` errors,
which it mostly does not learn to detect in that time.

Files (formats in docs REFERENCE section 2): ``prm_train.jsonl`` / ``prm_dev.jsonl``
(PRM steps and labels), ``pairs_train.jsonl`` / ``pairs_dev.jsonl`` (chosen / rejected full
solutions for outcome reward models, ~10% multi-turn), ``prompts.jsonl`` (PPO prompts with
the reference answer) and ``README.md`` with the counts and label statistics.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from llm.data.sample_problems import (  # noqa: F401 - PLACEHOLDER and PRM_ERROR_MIX: this generator's public constants
    PLACEHOLDER,
    PRM_ERROR_MIX,
    SEED_ERROR,
    SEED_PROBLEM,
    TEMPLATES,
    Error,
    Problem,
    draw_problem,
    follow_up,
    render_problem,
    solve,
    solve_prm,
)

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SEED = 20240611

N_PRM_TRAIN = 6000
N_PRM_DEV = 300
N_PAIRS_TRAIN = 800
N_PAIRS_DEV = 200
N_PROMPTS = 300
N_PROCESSBENCH = 120  # the first prm_dev records in ProcessBench's format
N_BON_GROUPS, N_BON_PER_GROUP = 24, 8  # best-of-N: problems x sampled solutions
P_WRONG = 0.5  # share of PRM solutions that carry an error
P_MULTI_TURN = 0.1  # share of pair records with a two-turn history
# prm_train: the first records are drawn before the pair files (which skip their questions), the
# rest after every other file, so that a larger PRM set leaves the pair and prompt files unchanged.
N_PRM_TRAIN_FIRST = 1500


# --- the files -------------------------------------------------------------------------------


def make_prm(
    rng: random.Random, errors_rng: random.Random, n: int, seen: set[str], with_seed: bool
) -> tuple[list[dict], Counter]:
    records, kinds = [], Counter()
    if with_seed:
        steps, labels, _ = render_problem(SEED_PROBLEM, SEED_ERROR)
        records.append(
            {
                "src": [SEED_PROBLEM.question],
                "tgt": [],
                "responses": steps,
                "labels": labels,
            }
        )
        seen.add(SEED_PROBLEM.question)
        kinds[SEED_ERROR.kind] += 1
    while len(records) < n:
        # ``rng`` draws the questions exactly as the pair files were first made against (an
        # error of the pair mix included); ``errors_rng`` draws the PRM error.
        drawn = draw_problem(rng, seen, wrong=rng.random() < P_WRONG)
        if drawn is None:
            continue
        problem, (steps, labels, _, error) = drawn
        if error is not None:  # an error of the pair mix: replaced by one of the PRM mix
            steps, labels, _, error = solve_prm(errors_rng, problem)
        seen.add(problem.question)
        kinds[error.kind if error else "none"] += 1
        records.append({"src": [problem.question], "tgt": [], "responses": steps, "labels": labels})
    return records, kinds


def make_processbench(prm_records: list[dict], n: int) -> list[dict]:
    """``prm_records`` in ProcessBench's format: ``label`` is the index of the first ``-`` step (-1 when
    there is none); the subset, in the ``id`` (``short-3``), is ``short`` for at most three steps and ``long``
    above; two made-up generator names alternate."""
    out = []
    for i, rec in enumerate(prm_records[:n]):
        label = next((j for j, lab in enumerate(rec["labels"]) if lab == "-"), -1)
        subset = "short" if len(rec["responses"]) <= 3 else "long"
        out.append(
            {
                "id": f"{subset}-{i}",
                "generator": ("sampler-a", "sampler-b")[i % 2],
                "problem": rec["src"][0],
                "steps": rec["responses"],
                "final_answer_correct": label == -1,
                "label": label,
            }
        )
    return out


def make_best_of_n(rng: random.Random, groups: int, per_group: int, seen: set[str]) -> list[dict]:
    """``groups`` problems with ``per_group`` sampled solutions each, every one right or wrong at random
    (an error of the PRM mix), as unlabelled PaddleNLP PRM records with ``group``, ``answer`` (the shown
    final answer) and ``correct`` (that answer equals the right one)."""
    out: list[dict] = []
    while len(out) < groups * per_group:
        problem = rng.choice(TEMPLATES)(rng)
        right = render_problem(problem, None)
        if problem.question in seen or right is None:
            continue
        group = []
        for _ in range(per_group * 20):
            # wrong ones with an error of the PRM mix, the kind the tiny demo PRM learns to spot
            steps, _, answer = solve_prm(rng, problem)[:3] if rng.random() < 0.5 else right
            group.append({"responses": steps, "answer": str(answer), "correct": answer == right[2]})
            if len(group) == per_group:
                break
        if len(group) < per_group:
            continue
        seen.add(problem.question)
        k = len(out) // per_group
        out += [{"src": [problem.question], "tgt": [], "group": f"problem-{k}", **c} for c in group]
    return out


def make_pairs(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    records = []
    while len(records) < n:
        drawn = draw_problem(rng, seen, wrong=False)
        if drawn is None:
            continue
        problem, (good, _, answer, _) = drawn
        src, tgt = [problem.question], []
        if rng.random() < P_MULTI_TURN:
            second = follow_up(rng, answer)
            solved = solve(rng, second, wrong=False)
            if solved is None:
                continue
            src, tgt = [problem.question, second.question], ["\n".join(good)]
            problem, good = second, solved[0]
        bad = solve(rng, problem, wrong=True)
        if bad is None:
            continue
        seen.add(src[0])
        chosen_first = rng.random() < 0.5
        response = ["\n".join(good), "\n".join(bad[0])]
        records.append(
            {
                "src": src,
                "tgt": tgt,
                "response": response if chosen_first else response[::-1],
                "sort": [1, 0] if chosen_first else [0, 1],
            }
        )
    return records


def make_prompts(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    records = []
    while len(records) < n:
        drawn = draw_problem(rng, seen, wrong=False)
        if drawn is None:
            continue
        problem, (_, _, answer, _) = drawn
        seen.add(problem.question)
        records.append({"src": problem.question, "tgt": str(answer)})
    return records


def _label_stats(records: list[dict]) -> tuple[int, float]:
    labels = [lab for r in records for lab in r["labels"]]
    return len(labels), labels.count("-") / len(labels)


def _readme(files: dict[str, list[dict]], kinds: dict[str, Counter]) -> str:
    n_steps = {name: _label_stats(files[name]) for name in ("prm_train", "prm_dev")}
    dev_minus = n_steps["prm_dev"][1]
    majority = "-" if dev_minus > 0.5 else "+"
    lengths = Counter(len(r["responses"]) for r in files["prm_train"])
    multi = {name: sum(len(r["src"]) > 1 for r in files[name]) for name in ("pairs_train", "pairs_dev")}
    lines = [
        "# Sample data",
        "",
        "Small arithmetic word-problem data sets for tests, smoke runs and tiny CPU training.",
        "Generated by `python -m llm.data.make_sample_data` (standard library only, fixed seed",
        f"{SEED}; byte-identical on every run). Do not edit by hand: change the generator and",
        "re-run it, then re-run `python -m llm.utils.tokenizer_assets` for the tiny tokenizer.",
        "",
        "Question operands are 1-9 and every shown number is 0-99. A solution is 2-5 steps:",
        "equations such as `Cheese costs 3 * 4 = 12 dollars.` and a last step",
        "`The answer is 22.`. A wrong solution has one error and then follows the wrong value:",
        "`echo` (the result just repeats the number before `=`: `3 * 4 = 4`), `result` (a result",
        "off by 1-3), `carry` (an earlier result copied wrongly) or `answer` (a final answer that",
        "does not repeat the last result). Dev questions never occur in any train file.",
        "",
        "| file | records | format |",
        "|---|---|---|",
        f"| `prm_train.jsonl` | {len(files['prm_train'])} | PRM: `{{src: [q], tgt: [], responses: [steps], labels: [+/-]}}` |",
        f"| `prm_dev.jsonl` | {len(files['prm_dev'])} | same, disjoint questions |",
        f"| `pairs_train.jsonl` | {len(files['pairs_train'])} ({multi['pairs_train']} two-turn) | ORM/DPO pairs: `{{src, tgt, response: [r0, r1], sort: [s0, s1]}}` |",
        f"| `pairs_dev.jsonl` | {len(files['pairs_dev'])} ({multi['pairs_dev']} two-turn) | same, disjoint questions |",
        f"| `prompts.jsonl` | {len(files['prompts'])} | PPO prompts: `{{src: q, tgt: answer}}` |",
        (
            f"| `processbench_dev.jsonl` | {len(files['processbench_dev'])} | the first `prm_dev` records in ProcessBench's "
            "format: `{id: short-3 / long-7, generator, problem, steps, label: first wrong step or -1, "
            "final_answer_correct}` |"
        ),
        (
            f"| `bon_dev.jsonl` | {len(files['bon_dev'])} ({N_BON_GROUPS} problems x {N_BON_PER_GROUP}) | best-of-N "
            "candidates, unlabelled PRM records with `group`, `answer`, `correct` |"
        ),
        "",
        "PRM labels: a step is `+` if its arithmetic is right and every earlier step was right;",
        "the first wrong step and every later step are `-`. Record 0 of `prm_train.jsonl` is the",
        "seed example (Tony, cheese and beef; labels `+ + - -`). About half of the PRM solutions",
        "carry an error, mostly `echo` errors (at any step), the others `result` and `carry`",
        "errors in the last equation and `answer` errors: spotting an echo is a comparison of two",
        "nearby numbers, which the tiny CPU demo model (`llm/config/tiny/prm_argument.json`)",
        "learns in minutes; multiplication tables and comparisons across steps take it far longer.",
        f"Error kinds in `prm_train`: {_fmt_counter(kinds['prm_train'])};",
        f"in `prm_dev`: {_fmt_counter(kinds['prm_dev'])}.",
        "(The wrong solutions of the pair files have `result` errors at any step, `carry` and",
        "`answer` errors.)",
        "",
        "| file | steps | fraction of `-` steps |",
        "|---|---|---|",
        *(f"| `{name}.jsonl` | {n} | {frac:.3f} |" for name, (n, frac) in n_steps.items()),
        "",
        f"Majority-class baseline on `prm_dev` (always `{majority}`): step accuracy "
        + f"{max(dev_minus, 1 - dev_minus):.3f},",
        f"solution accuracy (every step of a solution right) {_all_same(files['prm_dev'], majority):.3f}.",
        f"Steps per solution in `prm_train`: {_fmt_counter(lengths)}.",
        "",
        "Pairs: the higher `sort` marks the correct full solution (steps joined with a newline);",
        "which index is chosen is random. Two-turn records hold `src[0], tgt[0], src[1]` in",
        "order, and the responses answer `src[1]`, a follow-up on the first answer.",
        "",
    ]
    return "\n".join(lines)


def _all_same(records: list[dict], label: str) -> float:
    """Share of the solutions whose every step is labelled ``label``."""
    return sum(all(lab == label for lab in r["labels"]) for r in records) / len(records)


def _fmt_counter(counter: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items()))


def generate(out_dir: Path) -> dict[str, list[dict]]:
    """Write all sample files into ``out_dir``; return the records by file stem."""
    train_seen: set[str] = set()
    kinds: dict[str, Counter] = {}
    files: dict[str, list[dict]] = {}
    # One random stream per file, so changing one file's count leaves the others unchanged
    # (string seeds hash with SHA-512: stable across runs and Python versions).
    files["prm_train"], kinds["prm_train"] = make_prm(
        random.Random(f"{SEED}-prm_train"),
        random.Random(f"{SEED}-prm_train-errors"),
        N_PRM_TRAIN_FIRST,
        train_seen,
        with_seed=True,
    )
    files["pairs_train"] = make_pairs(random.Random(f"{SEED}-pairs_train"), N_PAIRS_TRAIN, train_seen)
    files["prompts"] = make_prompts(random.Random(f"{SEED}-prompts"), N_PROMPTS, train_seen)
    # Dev questions must not occur in any train file; dev files dedupe among themselves too.
    dev_seen = set(train_seen)
    files["prm_dev"], kinds["prm_dev"] = make_prm(
        random.Random(f"{SEED}-prm_dev"),
        random.Random(f"{SEED}-prm_dev-errors"),
        N_PRM_DEV,
        dev_seen,
        with_seed=False,
    )
    files["pairs_dev"] = make_pairs(random.Random(f"{SEED}-pairs_dev"), N_PAIRS_DEV, dev_seen)
    # The rest of prm_train: questions of no file above (dev_seen holds them all).
    more, more_kinds = make_prm(
        random.Random(f"{SEED}-prm_train-more"),
        random.Random(f"{SEED}-prm_train-more-errors"),
        N_PRM_TRAIN - N_PRM_TRAIN_FIRST,
        dev_seen,
        with_seed=False,
    )
    files["prm_train"] += more
    kinds["prm_train"] += more_kinds
    # Evaluation-only files (issue: PRM evaluation): ProcessBench's format, and best-of-N candidate groups.
    files["processbench_dev"] = make_processbench(files["prm_dev"], N_PROCESSBENCH)
    files["bon_dev"] = make_best_of_n(random.Random(f"{SEED}-bon_dev"), N_BON_GROUPS, N_BON_PER_GROUP, dev_seen)

    out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in files.items():
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    (out_dir / "README.md").write_text(_readme(files, kinds), encoding="utf-8", newline="\n")
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=SAMPLE_DIR, help="where to write the files")
    args = parser.parse_args(argv)
    files = generate(args.out_dir)
    for name, records in files.items():
        print(f"{args.out_dir / name}.jsonl: {len(records)} records")


if __name__ == "__main__":
    main()
