"""The fields of ``llm/run_critiques.py``: a generative PRM's training data (``critiques``, one per step) made from
step-labelled PRM records (``llm.alignment.critique``), by a template or by a judge model told each step's label.

One flat dataclass, read by the one configuration path (``llm.settings.load.parse_arguments``) from a JSON file
and ``--field value`` overrides; ``validate_critique_arguments`` adds the checks on the files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from llm.settings.fields import help_field as _f
from llm.settings.shared import reward_token_pair
from llm.utils.errors import UserError
from llm.utils.paths import resolve_paths
from llm.utils.rundir import check_output_dir

ENGINES = ("hf", "vllm")
DEFAULT_JUDGE_PROMPT = (
    "Problem: {problem}\nSolution so far:\n{previous}\nNext step: {step}\n"
    "This step is {verdict}. In one sentence, say why.\nReason:"
)


@dataclass
class CritiqueArguments:
    script: ClassVar[str] = "critiques"
    # --- the data ------------------------------------------------------------------------------------------
    data_path: str | None = _f(
        None,
        "Step-labelled PRM records (PaddleNLP, TRL stepwise, Math-Shepherd, ProcessBench; run_label.py's "
        "labels.jsonl); required. Steps from the first unlabelled one on are left out.",
    )
    map_keys: dict | None = field(
        default=None, metadata={"help": 'Rename columns as they are read: {"src": "question"}.'}
    )
    max_records: int | None = _f(None, "The first N records only; null: all.", 1)
    placeholder_token: str = _f("ки", "The PRM step placeholder the records may use (Math-Shepherd layouts).")
    reward_tokens: str = _f("+,-", "The verdict tokens 'positive,negative', as the labels write them.")
    # --- the critiques -------------------------------------------------------------------------------------
    positive_template: str = _f(
        "The step is right.", "The critique of a step labelled positive when no judge writes one."
    )
    negative_template: str = _f(
        "The step has an error.", "The critique of a step labelled negative when no judge writes one."
    )
    judge_model_name_or_path: str | None = _f(
        None,
        "A causal LM that writes each critique, told the step's label (judge_prompt); null: the templates. A judge "
        "critique that is empty or holds a reward token is replaced by the template (counted in the report).",
    )
    tokenizer_name_or_path: str | None = _f(None, "The judge's tokenizer; null: judge_model_name_or_path.")
    init_from_config: bool = _f(False, "Random judge weights (seeded) from its config.json: tests, demos.")
    engine: str = _f("hf", "The judge's generation engine: hf (transformers) or vllm.")
    bf16: bool = _f(False, "bfloat16 judge weights.")
    vllm_gpu_memory_utilization: float = _f(0.8, "engine vllm on CUDA: the share of device memory vLLM takes.")
    use_chat_template: bool | None = _f(
        None, "Render the judge prompt with the judge tokenizer's chat template; null: when it has one."
    )
    judge_prompt: str = _f(
        DEFAULT_JUDGE_PROMPT,
        "The judge's prompt for one step, with {problem}, {previous} (the earlier steps, one a line), {step}, "
        "{number} (1-based) and {verdict} (correct or wrong, from the label).",
    )
    max_new_tokens: int = _f(64, "Most tokens of one judge critique (its first line is kept).", 1)
    temperature: float = _f(0.0, "The judge's sampling temperature; 0: greedy.", 0)
    generation_batch_size: int = _f(64, "Most judge prompts per generate call.", 1)
    # --- output --------------------------------------------------------------------------------------------
    output_dir: str = _f(
        "output/critiques",
        "Writes critiques.jsonl (PaddleNLP PRM records with critiques, appended per finished record) and "
        "report.json; a rerun with the same settings resumes after the records written.",
    )
    overwrite_output_dir: bool = _f(False, "Delete the critiques of other settings in output_dir and start afresh.")
    seed: int = _f(42, "Seeds the judge's sampling (per record).", 0)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise UserError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        tokens = reward_token_pair(self.reward_tokens)
        for name in ("positive_template", "negative_template"):
            found = [t for t in tokens if t in getattr(self, name)]
            if found:
                raise UserError(
                    f"{name} {getattr(self, name)!r} holds the verdict token {found[0]!r} (reward_tokens): the "
                    "trained model would end its critique there. Fix: rephrase it without that token"
                )
        for key in ("{step}",):
            if key not in self.judge_prompt:
                raise UserError(f"judge_prompt has no {key}: the judge must see the step it critiques")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise UserError(f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")

    @property
    def label_tokens(self) -> tuple[str, str]:
        return reward_token_pair(self.reward_tokens)


def validate_critique_arguments(args: CritiqueArguments, source: str) -> None:
    """The checks on files, before any model loads: the data exists, the output directory is writable."""
    if not args.data_path:
        raise UserError(f"{source}: data_path is required: the step-labelled PRM records to write critiques for")
    resolve_paths(args.data_path, "data_path", source)
    check_output_dir(args.output_dir)


CRITIQUE_ARGUMENT_TYPES = (CritiqueArguments,)
