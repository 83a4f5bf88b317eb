"""PRM-guided search (``run_search.py``), the schema: ``policy`` (the model that writes the steps), ``prm`` (the
model that scores them, any kind of ``prm.kind``), ``data`` (the problems) and ``search`` (the methods, budgets and
outputs). Sections as PPO's (``{"policy": {...}, "prm": {...}, ...}``; ``--section.field value`` on the command
line, a bare ``--field`` is one of ``search``), read by ``llm.settings.load.parse_search_config``.

The search follows Hugging Face's search-and-learn (``src/sal/search/``): a budget N is N generations per step;
beam search keeps the N / beam_width best partial solutions and expands each beam_width ways; DVTS runs
N / beam_width independent greedy subtrees, each expanded beam_width ways; best-of-N samples N whole solutions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llm.settings.registry import STEP_SCORERS
from llm.settings.shared import reward_token_pair
from llm.utils.errors import UserError

METHODS = ("beam_search", "dvts", "best_of_n")
# how a solution's step scores make its score (llm.alignment.rm.evaluation.AGGREGATIONS; a test keeps them equal)
AGGREGATIONS = ("last", "min", "product", "mean")
ENGINES = ("hf", "vllm")
DTYPES = ("float32", "bfloat16")
DEFAULT_ANSWER = "llm.alignment.ppo.rewards.rule_functions:last_number"


def _f(default: Any, text: str, low: float | None = None) -> Any:
    metadata: dict[str, Any] = {"help": text}
    if low is not None:
        metadata["min"] = low
    return field(default=default, metadata=metadata)


def _one_of(value: str, valid: tuple[str, ...], name: str) -> None:
    if value not in valid:
        raise UserError(f"{name} must be one of {', '.join(valid)}, got {value!r}")


@dataclass(frozen=True)
class PolicySection:
    model_name_or_path: str | None = _f(None, "the policy: a causal LM (directory or hub id); required")
    tokenizer_name_or_path: str | None = _f(None, "its tokenizer; null: model_name_or_path")
    init_from_config: bool = _f(False, "random weights from model_name_or_path/config.json (tiny tests)")
    dtype: str = _f("float32", "weights: float32 or bfloat16")
    engine: str = _f("hf", "what generates: hf (Hugging Face generate) or vllm (a vLLM engine; requirements-vllm.txt)")
    temperature: float = _f(0.8, "sampling temperature of every step (search-and-learn's default); 0: greedy", 0)
    top_p: float = _f(1.0, "nucleus sampling", 0)
    max_step_tokens: int = _f(
        256, "the most tokens of one step: a step without the step marker by then ends there (a step cap, logged)", 1
    )
    max_new_tokens: int = _f(1024, "the most tokens of a whole solution: a longer one ends there, finished", 1)
    max_prompt_length: int = _f(512, "the longest prompt in tokens; a longer one stops the run naming it", 1)
    batch_size: int = _f(64, "hf: sequences per generate call", 1)
    vllm_gpu_memory_utilization: float = _f(0.5, "vllm on CUDA: the share of the device the engine may take", 0)

    def __post_init__(self) -> None:
        _one_of(self.engine, ENGINES, "policy.engine")
        _one_of(self.dtype, DTYPES, "policy.dtype")
        if self.top_p > 1:
            raise UserError(f"policy.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class PRMSection:
    kind: str = _f(
        STEP_SCORERS.default,
        "the kind of reward model, a registered step scorer (llm.settings.registry STEP_SCORERS): discriminative "
        "(a PRM trained by run_reward.py with process_reward), generative (one trained with prm_kind generative: "
        "it writes a critique of every step, then its verdict), orm (an ORM's score after every step) or implicit "
        "(an implicit PRM, prm_kind implicit: beta and its reference from its implicit_prm.json)",
    )
    model_name_or_path: str | None = _f(None, "the reward model (a directory); required")
    tokenizer_name_or_path: str | None = _f(None, "its tokenizer; null: model_name_or_path")
    init_from_config: bool = _f(False, "random weights from model_name_or_path/config.json (tiny tests)")
    dtype: str = _f("float32", "weights: float32 or bfloat16")
    placeholder_token: str = _f("ки", "discriminative: the step placeholder it was trained with (one token)")
    reward_tokens: str = _f("+,-", "discriminative: its label tokens 'positive,negative'")
    micro_batch_size: int = _f(8, "solutions per forward (generative: critique passes written together)", 1)
    critique_samples: int = _f(1, "generative: critiques per solution, their verdict probabilities averaged", 1)
    max_critique_tokens: int = _f(64, "generative: the most tokens of one step's critique", 0)
    critique_temperature: float = _f(0.0, "generative: sampling temperature of the critiques; 0: greedy", 0)

    def __post_init__(self) -> None:
        STEP_SCORERS.lookup(self.kind, "prm.kind: ")
        _one_of(self.dtype, DTYPES, "prm.dtype")
        reward_token_pair(self.reward_tokens, "prm.reward_tokens")
        if self.critique_samples > 1 and self.critique_temperature == 0:
            raise UserError(
                "prm.critique_samples > 1 with prm.critique_temperature 0: greedy critiques are all the same; set "
                "prm.critique_temperature > 0 or prm.critique_samples 1"
            )


@dataclass(frozen=True)
class SearchDataSection:
    problems_path: str | None = _f(
        None, "the problems: prompt records ({src, tgt} or {prompt, answer}; tgt / answer the reference); required"
    )
    map_keys: dict[str, str] | None = field(
        default=None, metadata={"help": "rename the records' columns as they are read ({theirs: ours})"}
    )
    max_problems: int | None = _f(None, "the first this many problems only; null: all", 1)
    use_chat_template: bool | None = _f(
        None, "render the prompts with the policy tokenizer's chat template; null: exactly when it has one (logged)"
    )


@dataclass(frozen=True)
class SearchSection:
    methods: list[str] = field(
        default_factory=lambda: list(METHODS), metadata={"help": f"which searches to run, any of {', '.join(METHODS)}"}
    )
    budgets: list[int] = field(
        default_factory=lambda: [4, 8, 16],
        metadata={"help": "the budgets N (generations per step; best-of-N: solutions), each a multiple of beam_width"},
    )
    beam_width: int = _f(4, "M: beam search expands each of its N / M beams M ways; DVTS runs N / M subtrees", 1)
    step_marker: str = _f("\n\n", "the text that ends a step of the policy's output (search-and-learn: a blank line)")
    max_steps: int = _f(40, "the most steps of a solution; the last one is generated to the end", 1)
    aggregation: str = _f("last", f"how a solution's step scores rank it: {', '.join(AGGREGATIONS)}")
    answer: str = _f(
        DEFAULT_ANSWER,
        "'module:function' text -> final answer (None: none); right when it equals the function's answer of the "
        "reference (tgt), or the reference itself when that gives None",
    )
    seed: int = _f(42, "seeds the sampling (and init_from_config weights)", 0)
    output_dir: str = _f("output/search", "where search_results.jsonl and search_metrics.json are written")

    def __post_init__(self) -> None:
        for method in self.methods:
            _one_of(method, METHODS, "each of search.methods")
        if not self.methods:
            raise UserError(f"search.methods is empty: name at least one of {', '.join(METHODS)}")
        _one_of(self.aggregation, AGGREGATIONS, "search.aggregation")
        if not self.step_marker:
            raise UserError('search.step_marker is empty: give the text between steps, e.g. "\\n\\n"')
        if not self.budgets:
            raise UserError("search.budgets is empty: give the budgets N, e.g. [4, 8, 16]")
        for n in self.budgets:
            if n < self.beam_width:
                raise UserError(
                    f"search.budgets: {n} is smaller than search.beam_width {self.beam_width}: a budget N keeps "
                    f"N / beam_width beams, so each N must be at least beam_width; raise the budget or lower "
                    "search.beam_width"
                )
            if n % self.beam_width:
                raise UserError(
                    f"search.budgets: {n} is not a multiple of search.beam_width {self.beam_width} (N / beam_width "
                    f"beams or subtrees); use {n - n % self.beam_width} or {n + self.beam_width - n % self.beam_width}"
                )
        if ":" not in self.answer:
            raise UserError(f"search.answer {self.answer!r}: must be 'package.module:function'")


SEARCH_SECTIONS: dict[str, type] = {
    "policy": PolicySection,
    "prm": PRMSection,
    "data": SearchDataSection,
    "search": SearchSection,
}


@dataclass(frozen=True)
class SearchConfig:
    policy: PolicySection
    prm: PRMSection
    data: SearchDataSection
    search: SearchSection
    source: str | None = None
    notes: tuple[str, ...] = ()


def validate_search_config(c: SearchConfig, path: str) -> None:
    """What one section cannot check alone: the required models and problems."""
    for name in ("policy.model_name_or_path", "prm.model_name_or_path", "data.problems_path"):
        section, _, key = name.partition(".")
        if not getattr(getattr(c, section), key):
            raise UserError(f"{path}: {name} is required: give it in the {section} section")
