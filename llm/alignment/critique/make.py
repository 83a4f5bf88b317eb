"""The critique of every labelled step: a template by label, or a judge model's (told the label), kept only when it
fits the generative PRM's layout (``llm.data.encode_genprm``: not empty, no verdict token in it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from llm.data.readers import PRMRecord

VERDICT_WORDS = ("correct", "wrong")  # {verdict} of the judge prompt for a positive / negative label


def labelled_steps(record: PRMRecord) -> tuple[list[str], list[str]]:
    """The steps up to the first unlabelled one, and their labels (ProcessBench's later steps have none)."""
    steps, labels = [], []
    for step, label in zip(record.steps, record.labels):
        if label is None:
            break
        steps.append(step)
        labels.append(label)
    return steps, labels


def problem_of(record: PRMRecord) -> str:
    return "\n".join(m["content"] for m in record.prompt if m["role"] != "system")


def judge_prompts(record: PRMRecord, labels: list[str], tokens: tuple[str, str], template: str) -> list[str]:
    """One judge prompt per labelled step (``judge_prompt``'s fields filled)."""
    steps = record.steps[: len(labels)]
    return [
        template.format(
            problem=problem_of(record),
            previous="\n".join(steps[:k]) or "(none)",
            step=step,
            number=k + 1,
            verdict=VERDICT_WORDS[tokens.index(label)],
        )
        for k, (step, label) in enumerate(zip(steps, labels))
    ]


def clean(text: str, tokens: tuple[str, str]) -> str | None:
    """A judge's critique as kept: its first non-empty line, stripped; None when empty or holding a verdict token."""
    line = next((piece.strip() for piece in text.splitlines() if piece.strip()), "")
    if not line or any(t in line for t in tokens):
        return None
    return line


def critiques_for(
    record: PRMRecord,
    tokens: tuple[str, str],
    templates: tuple[str, str],
    judge: Callable[[list[str]], list[str]] | None,
    judge_prompt: str,
    counts: Counter,
) -> dict | None:
    """The record with its labelled steps and their critiques, in the PaddleNLP PRM layout with ``critiques``;
    None when its first step is unlabelled. ``judge``: prompts -> texts (None: the templates)."""
    steps, labels = labelled_steps(record)
    if not steps:
        counts["records_without_labelled_steps"] += 1
        return None
    critiques = [templates[tokens.index(label)] for label in labels]
    if judge is not None:
        for k, text in enumerate(judge(judge_prompts(record, labels, tokens, judge_prompt))):
            kept = clean(text, tokens)
            counts["judge_critiques" if kept is not None else "judge_critiques_replaced_by_template"] += 1
            critiques[k] = kept if kept is not None else critiques[k]
    else:
        counts["template_critiques"] += len(steps)
    users = [m["content"] for m in record.prompt if m["role"] == "user"]
    out: dict = {
        "src": users or [""],
        "tgt": [m["content"] for m in record.prompt if m["role"] == "assistant"],
        "responses": steps,
        "labels": labels,
        "critiques": critiques,
    }
    system = [m["content"] for m in record.prompt if m["role"] == "system"]
    if system:
        out["system"] = system[0]
    if record.soft_labels is not None:
        out["soft_labels"] = record.soft_labels[: len(steps)]
    counts["records"] += 1
    counts["steps"] += len(steps)
    return out
