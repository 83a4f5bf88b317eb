"""Deterministic generator of the bundled SFT data: ``llm/data/sample_sft/sft_{train,dev}.jsonl``.

Run from the repository root::

    python -m llm.data.make_sft_data [--out-dir DIR]

Standard library only, fixed seeds: the files are byte-identical on every run. The problems and
their correct step-by-step solutions come from the arithmetic generator of ``make_sample_data``
(imported, not changed), so they share the tiny tokenizer's vocabulary. A solution is its steps
joined by newlines, as in the pair files. About 10% of the records are two-turn (a follow-up on
the first answer); about a quarter are written in TRL's conversational form, the rest in
PaddleNLP's, so both reader formats are exercised:

- PaddleNLP: ``{"src": [q1, q2], "tgt": [a1, a2]}`` (one answer per user turn);
- TRL: ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}``.

Dev questions never occur in the SFT train file. The files live next to ``sample/`` rather than in it:
``sample/`` holds exactly what ``make_sample_data`` writes (its determinism test checks the listing).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from llm.data.make_sample_data import P_MULTI_TURN, SEED
from llm.data.sample_problems import draw_problem, follow_up, solve

SFT_SAMPLE_DIR = Path(__file__).resolve().parent / "sample_sft"
N_SFT_TRAIN = 800
N_SFT_DEV = 200
P_MESSAGES = 0.25  # share of records written as TRL "messages"


def make_sft(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    records = []
    while len(records) < n:
        drawn = draw_problem(rng, seen, wrong=False)
        if drawn is None:
            continue
        problem, (steps, _, answer, _) = drawn
        src, tgt = [problem.question], ["\n".join(steps)]
        if rng.random() < P_MULTI_TURN:
            second = follow_up(rng, answer)
            solved = solve(rng, second, wrong=False)
            if solved is None:
                continue
            src.append(second.question)
            tgt.append("\n".join(solved[0]))
        seen.add(problem.question)
        if rng.random() < P_MESSAGES:
            turns = [(role, text) for q, a in zip(src, tgt) for role, text in (("user", q), ("assistant", a))]
            records.append({"messages": [{"role": role, "content": text} for role, text in turns]})
        else:
            records.append({"src": src, "tgt": tgt})
    return records


def generate(out_dir: Path) -> dict[str, list[dict]]:
    """Write the SFT sample files into ``out_dir``; return the records by file stem."""
    seen: set[str] = set()
    files = {
        "sft_train": make_sft(random.Random(f"{SEED}-sft_train"), N_SFT_TRAIN, seen),
        "sft_dev": make_sft(random.Random(f"{SEED}-sft_dev"), N_SFT_DEV, seen),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in files.items():
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=SFT_SAMPLE_DIR, help="where to write the files")
    args = parser.parse_args(argv)
    for name, records in generate(args.out_dir).items():
        print(f"{args.out_dir / name}.jsonl: {len(records)} records")


if __name__ == "__main__":
    main()
