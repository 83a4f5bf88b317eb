"""Problems to label (``kind="problem"``, ``llm/run_label.py``): a prompt with its reference answer and, optionally,
a given solution.

Schema (``kind``)
    ``"problem"``: a PPO prompt record (``llm.data.readers.prompts``: ``{"src", "tgt"}`` or ``{"prompt",
    "reference" | "answer"}``) whose reference answer is required, with an optional ``responses`` list of
    solution steps (checked as a PRM record's steps). Without ``responses`` the policy writes the solutions.
"""

from __future__ import annotations

from llm.data.readers.common import is_present
from llm.data.readers.prm import solution_steps
from llm.data.readers.prompts import parse_prompt
from llm.data.readers.records import ProblemRecord
from llm.data.readers.sources import RecordPlace


def parse_problem(rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str) -> ProblemRecord:
    prompt = parse_prompt(rec, where, tokens, placeholder)
    if prompt.reference is None:
        field = "tgt" if is_present(rec, "src") else "reference"
        where.fail(
            field,
            "has no reference answer, so no completion can be checked",
            "give the answer as the last tgt turn (PaddleNLP: tgt has as many turns as src), or a 'reference' or "
            "'answer' field, or leave the problem out",
        )
    steps = solution_steps(rec["responses"], "responses", where, placeholder) if is_present(rec, "responses") else None
    return ProblemRecord(prompt.prompt, prompt.reference, steps, where.path, where.index)
