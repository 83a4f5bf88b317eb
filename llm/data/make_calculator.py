"""Deterministic generator of the calculator tool task's prompts in ``llm/data/sample_calculator/``.

Run from the repository root::

    python -m llm.data.make_calculator [--out-dir DIR]

Each record is a prompt ``{"src": "What is a * b? ...", "tgt": "<a*b>"}`` with a 4-digit ``a`` and a 3-digit
``b``: products a small model does not know by heart (SmolLM2-135M-Instruct gets almost none right), which the
``calculator`` tool computes exactly. The environment
``llm.alignment.ppo.agent.envs.calculator:CalculatorTask`` rewards a final answer whose last number is ``tgt``.
Train and dev prompts share no (a, b) pair.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATE = "What is {a} * {b}? You can use the calculator tool. Give the final answer as just the number."
SEED = 20270127


def make(n_train: int = 512, n_dev: int = 128) -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    pairs: list[tuple[int, int]] = []
    seen = set()
    while len(pairs) < n_train + n_dev:
        pair = (rng.randint(1000, 9999), rng.randint(100, 999))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    rows = [{"src": TEMPLATE.format(a=a, b=b), "tgt": str(a * b)} for a, b in pairs]
    return rows[:n_train], rows[n_train:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "sample_calculator"))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("calculator_train.jsonl", "calculator_dev.jsonl"), make()):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
