"""The records the readers return, the data kinds, and the formats and fields each kind accepts."""

from __future__ import annotations

from dataclasses import dataclass, field

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

KINDS = ("prm", "pair", "prompt", "sft", "orm_eval", "problem")
ROLES = ("system", "user", "assistant")
SUPPORTED_FORMATS = (
    ".json (a JSON list of objects, or JSON lines), .jsonl (JSON lines), .parquet, "
    "or a Hugging Face dataset directory written by save_to_disk (Dataset, or DatasetDict with a 'train' split)"
)
FORMATS = {
    "prm": 'PaddleNLP {"src", "tgt", "responses": [steps], "labels": [reward tokens]} '
    '(src [""] when the question starts the first step), TRL stepwise {"prompt", "completions": [steps], '
    '"labels": [true/false]} or Math-Shepherd {"input": "<steps, each ending with the placeholder>", '
    '"label": "<input with a reward token in place of each placeholder>"}',
    "pair": 'PaddleNLP {"src", "tgt", "response": [r0, r1], "sort": [s0, s1]} or TRL {"prompt", "chosen", "rejected"}',
    "prompt": 'PaddleNLP {"src", "tgt" (optional reference)} or {"prompt", "reference" or "answer" (optional)}',
    "sft": 'PaddleNLP {"src": [user turns], "tgt": [one answer per user turn]} '
    'or TRL conversational {"messages": [{"role", "content"}, ...]}',
}
FORMATS["problem"] = (
    'a prompt with its reference answer (PaddleNLP {"src", "tgt"} or {"prompt", "reference" or "answer"}), '
    'optionally with a given solution "responses": [steps]'
)
# an ORM's dev split: either kind, record by record (llm/data/readers/orm_eval.py)
FORMATS["orm_eval"] = (
    f'a preference pair ({FORMATS["pair"]}) or a best-of-N candidate (a PRM layout with "answer" and '
    f'"correct": true/false; "group" when the record has no separate question, "labels" not needed): {FORMATS["prm"]}'
)

# The fields each kind reads (the names map_keys may map onto).
FIELDS = {
    "prm": (
        "src",
        "tgt",
        "system",
        "responses",
        "labels",
        "soft_labels",
        "prompt",
        "completions",
        "input",
        "label",
        "problem",
        "steps",
        "id",
        "generator",
        "subset",
        "final_answer_correct",
        "answer",
        "correct",
        "group",
        "critiques",
    ),
    "pair": ("src", "tgt", "system", "response", "sort", "prompt", "chosen", "rejected"),
    "prompt": ("src", "tgt", "system", "prompt", "reference", "answer"),
    "sft": ("src", "tgt", "system", "messages"),
}
FIELDS["problem"] = FIELDS["prompt"] + ("responses",)
FIELDS["orm_eval"] = tuple(dict.fromkeys(FIELDS["pair"] + FIELDS["prm"]))


@dataclass
class PRMRecord:
    """Process reward (Math-Shepherd) record."""

    # conversation before the answer, in order, ends with a user turn; empty when the record has no
    # separate prompt (Math-Shepherd layouts: the question starts the first step)
    prompt: list[Message]
    steps: list[str]
    labels: list[str | None]  # each one of reward_tokens, or None (unlabelled); len == len(steps)
    source: str  # file path it came from
    index: int  # 0-based record number in that file
    first_error: int | None = None  # ProcessBench: the earliest wrong step, -1 when all are right
    subset: str | None = None  # ProcessBench subset (gsm8k, math, ...)
    generator: str | None = None  # the model that wrote the solution
    group: str | None = None  # best-of-N: the problem this candidate answers
    answer: str | None = None  # best-of-N: its final answer
    correct: bool | None = None  # best-of-N: whether that answer is right
    # Monte Carlo step values in [0, 1] (llm/run_label.py's soft labels), None where a step has none; or None
    soft_labels: list[float | None] | None = None
    # a generative PRM's training text: one critique per step (llm/run_critiques.py writes them), or None
    critiques: list[str] | None = None


@dataclass
class PairRecord:
    """Preference pair (ORM / DPO)."""

    prompt: list[Message]
    chosen: str
    rejected: str
    source: str
    index: int


@dataclass
class PromptRecord:
    """PPO prompt with an optional reference answer."""

    prompt: list[Message]
    reference: str | None
    source: str
    index: int
    fields: dict = field(default_factory=dict)  # the record as read (after map_keys): an environment's task


@dataclass
class SFTRecord:
    """Supervised fine-tuning conversation; every assistant message is a training target."""

    messages: list[Message]  # optional system message, then starts with a user turn, ends with an assistant turn
    source: str
    index: int


@dataclass
class ProblemRecord:
    """A problem to label (``llm/run_label.py``): the prompt, its reference answer, and a given solution's steps
    (None: the policy writes the solutions)."""

    prompt: list[Message]
    reference: str
    steps: list[str] | None
    source: str
    index: int


Record = ProblemRecord | PRMRecord | PairRecord | PromptRecord | SFTRecord
