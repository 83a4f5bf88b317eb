"""Deterministic generator of the guessing game's prompts in ``llm/data/sample_guessing/``.

Run from the repository root::

    python -m llm.data.make_guessing [--out-dir DIR]

Each record is a game ``{"src": "I am thinking of an integer from low to high. ...", "tgt": "<secret>", "low",
"high"}`` for the environment ``llm.alignment.ppo.agent.envs.guessing:GuessingGame``: the range starts at 0-50
and holds 16, 32, 64 or 100 integers (at most 7 guesses by halving), the secret is drawn uniformly from it.
Train and dev games share no (low, high, secret) triple.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATE = (
    "I am thinking of an integer from {low} to {high}. Guess it: answer with one integer. After each guess I "
    "tell you whether the number is higher or lower."
)
SEED = 20270128
SIZES = (16, 32, 64, 100)


def make(n_train: int = 512, n_dev: int = 128) -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    games: list[tuple[int, int, int]] = []
    seen = set()
    while len(games) < n_train + n_dev:
        low = rng.randint(0, 50)
        high = low + rng.choice(SIZES) - 1
        game = (low, high, rng.randint(low, high))
        if game not in seen:
            seen.add(game)
            games.append(game)
    rows = [
        {"src": TEMPLATE.format(low=low, high=high), "tgt": str(secret), "low": low, "high": high}
        for low, high, secret in games
    ]
    return rows[:n_train], rows[n_train:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "sample_guessing"))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("guessing_train.jsonl", "guessing_dev.jsonl"), make()):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
