"""Deterministic generator of the verifiable arithmetic prompts in ``llm/data/sample_arith/``.

Run from the repository root::

    python -m llm.data.make_arithmetic [--out-dir DIR]

Each record is a PPO/GRPO prompt ``{"src": "What is a+b? Answer with just the number.", "tgt": "<a+b>"}``
with two-digit operands, scored by the rule reward ``llm.alignment.ppo.rewards.rule_functions:math_exact_match`` (the last
number of the response equals ``tgt``). SmolLM2-135M-Instruct answers such sums right only some of the time
(it says 12+7 = 8), which makes them a task on which reinforcement learning can show progress on a CPU.
Train and dev prompts share no (a, b) pair.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATE = "What is {a}+{b}? Answer with just the number."
SEED = 20261203


def make(n_train: int = 512, n_dev: int = 128) -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    rows = [{"src": TEMPLATE.format(a=a, b=b), "tgt": str(a + b)} for a, b in pairs[: n_train + n_dev]]
    return rows[:n_train], rows[n_train:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "sample_arith"))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("arith_train.jsonl", "arith_dev.jsonl"), make()):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
