"""PPO/GRPO prompts from a reasoning-gym dataset (``pip install reasoning-gym``): procedurally generated tasks
with verifiable answers, for the environment ``llm.alignment.ppo.agent.adapters.reasoning_gym:ReasoningGymTask``
(which scores a reply with the dataset's own ``score_answer``).

Run from the repository root::

    python -m llm.data.make_reasoning_gym --dataset basic_arithmetic --seed 1 --out-dir DIR
        [--train 512] [--dev 128] [--config '{"min_terms": 2, "max_terms": 3}'] [--instruction TEXT]

Writes ``<dataset>_train.jsonl`` and ``<dataset>_dev.jsonl``, records ``{"src": question + instruction, "tgt":
answer, "metadata": the entry's metadata}``. Train is the dataset drawn with ``seed``, dev with ``seed + 1``
without the questions train has. The same seed, size and config give the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llm.utils.errors import UserError, closest, run_cli

INSTRUCTION = "Give your final answer between <answer> and </answer>."


def _jsonable(value):
    """reasoning-gym metadata holds tuples (JSON lists) and sometimes sets; anything else is an error."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(f"a {type(value).__name__} in the metadata is not JSON: {value!r:.80}")


def records(dataset: str, seed: int, size: int, config: dict, instruction: str) -> list[dict]:
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            "make_reasoning_gym needs the reasoning-gym package: pip install reasoning-gym==0.1.25"
        ) from None
    if dataset not in reasoning_gym.factory.DATASETS:
        raise UserError(
            f"--dataset {dataset!r}: reasoning-gym has no such dataset (closest: "
            f"{closest(dataset, reasoning_gym.factory.DATASETS)}); one of reasoning_gym.factory.DATASETS"
        )
    try:
        data = reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(f"--config {json.dumps(config)} for reasoning-gym dataset {dataset!r}: {err}") from None
    out = []
    for entry in data:
        metadata = json.loads(json.dumps(entry["metadata"], default=_jsonable))
        metadata.setdefault("source_dataset", dataset)
        src = f"{entry['question']}\n{instruction}" if instruction else entry["question"]
        answer = entry["answer"]
        out.append({"src": src, "tgt": None if answer is None else str(answer), "metadata": metadata})
    return out


def make(dataset: str, seed: int, n_train: int, n_dev: int, config: dict | None = None, instruction: str = INSTRUCTION):
    """(train, dev) records; dev holds no question of train (so it may be shorter than ``n_dev``)."""
    train = records(dataset, seed, n_train, config or {}, instruction)
    seen = {r["src"] for r in train}
    dev = [r for r in records(dataset, seed + 1, n_dev, config or {}, instruction) if r["src"] not in seen]
    return train, dev


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--dev", type=int, default=128)
    parser.add_argument("--config", default="{}", help="the dataset's configuration fields as a JSON object")
    parser.add_argument("--instruction", default=INSTRUCTION, help="appended to each question on its own line")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as err:
        raise UserError(f"--config {args.config!r} is not JSON ({err}); give the fields as a JSON object") from None
    if not isinstance(config, dict):
        raise UserError(f"--config must be a JSON object of the dataset's fields, got {args.config!r}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in zip(
        ("train", "dev"), make(args.dataset, args.seed, args.train, args.dev, config, args.instruction)
    ):
        path = out / f"{args.dataset}_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} records")


if __name__ == "__main__":
    run_cli(main)
