"""The fields of ``llm/run_label.py``: PRM step labels made from rollouts (``llm.alignment.label``).

One flat dataclass, read by the one configuration path (``llm.settings.load.parse_arguments``) from a JSON file
and ``--field value`` overrides; ``validate_label_arguments`` adds the checks across fields and on the files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from llm.settings.fields import help_field as _f
from llm.settings.shared import reward_token_pair
from llm.utils.errors import UserError
from llm.utils.paths import resolve_paths
from llm.utils.rundir import check_output_dir

METHODS = ("math_shepherd", "omegaprm")
ENGINES = ("hf", "vllm")
DEFAULT_SOLUTIONS = 4  # policy-written solutions per problem (math_shepherd) when num_solutions is unset


@dataclass
class LabelArguments:
    script: ClassVar[str] = "label"
    # --- the problems --------------------------------------------------------------------------------------
    problems_path: str | None = _f(
        None,
        "Problems to label, one per record: {src, tgt: the reference answer} or {prompt, reference | answer}, each "
        "with an optional given solution responses: [steps] (else the policy writes the solutions). A record "
        "without a reference answer stops the run.",
    )
    map_keys: dict | None = field(
        default=None, metadata={"help": 'Rename columns as they are read: {"src": "question", "tgt": "answer"}.'}
    )
    max_problems: int | None = _f(None, "Label the first N problems only (a smoke run); null: all.", 1)
    use_chat_template: bool | None = _f(
        None, "Render the question with the tokenizer's chat template; null: when the tokenizer has one."
    )
    # --- the models ----------------------------------------------------------------------------------------
    model_name_or_path: str | None = _f(
        None, "The policy: writes the solutions of problems that give none (and completes them by default)."
    )
    tokenizer_name_or_path: str | None = _f(None, "Tokenizer of every model; default each model's own directory.")
    init_from_config: bool = _f(False, "Random weights (seeded) from the config.json of each model: tests, demos.")
    completer_model_name_or_path: str | None = _f(
        None, "The completer: completes every solution prefix num_completions times; default the policy."
    )
    engine: str = _f("hf", "Generation engine of the policy and the completer: hf (transformers) or vllm.")
    bf16: bool = _f(False, "bfloat16 weights for every model (half the memory; sampling in bf16).")
    vllm_gpu_memory_utilization: float = _f(0.8, "engine vllm on CUDA: the share of device memory vLLM takes.")
    # --- sampling ------------------------------------------------------------------------------------------
    num_solutions: int | None = _f(
        None,
        f"math_shepherd: solutions the policy writes per problem without a given one (null: {DEFAULT_SOLUTIONS}); "
        "omegaprm starts its search from num_completions rollouts of the question instead.",
        1,
    )
    num_completions: int = _f(
        8, "Completions per estimated prefix: Math-Shepherd's N (8 in the paper), OmegaPRM's k (openr: 16).", 1
    )
    temperature: float = _f(0.7, "Sampling temperature of solutions and completions (> 0).")
    top_p: float = _f(1.0, "Nucleus sampling (1.0: off).")
    top_k: int = _f(0, "Top-k sampling (0: off).", 0)
    max_new_tokens: int = _f(512, "Most new tokens of a solution or a completion.", 1)
    generation_batch_size: int = _f(
        64, "Most sequences per generate call (engine hf: the samples depend on it, as on the seed).", 1
    )
    completion_timeout: float = _f(
        600.0, "Seconds one batch of completions (or solutions) may take; a completer that never finishes stops.", 0
    )
    step_separator: str = _f(
        "\n",
        "What splits a written solution into steps, and joins the steps of a prefix before it is completed.",
    )
    max_solution_steps: int = _f(
        32, "A solution (given or written) with more steps is not labelled (counted in the report).", 1
    )
    # --- checking ------------------------------------------------------------------------------------------
    verifier: str = _f(
        "llm.alignment.ppo.rewards.rule_functions:math_exact_match",
        "The rule checking a full solution, 'module:function' called as function(question, solution, reference) "
        "-> float, as PPO's rule rewards; a score of 0.5 or more reaches the answer.",
    )
    # --- the method ----------------------------------------------------------------------------------------
    method: str = _f(
        "math_shepherd",
        "math_shepherd: every step estimated (hard label + when any completion is right, soft = the fraction "
        "right); omegaprm: binary search for the first wrong step (about log2 M estimates for M steps), and "
        "OmegaPRM's tree search when the policy writes the solutions.",
    )
    omega_alpha: float = _f(0.5, "omegaprm: alpha of Q(s, r) = alpha^(1 - MC(s)) * beta^(len(r) / L).", 0)
    omega_beta: float = _f(0.9, "omegaprm: beta of Q(s, r), the length penalty.", 0)
    omega_length_scale: float = _f(500.0, "omegaprm: L of Q(s, r), in words.", 1)
    omega_c_puct: float = _f(0.125, "omegaprm: exploration constant of U(s) = c_puct sqrt(sum N) / (1 + N(s)).", 0)
    omega_max_search_count: int = _f(20, "omegaprm tree search: most binary searches per problem.", 1)
    omega_rollout_budget: int = _f(200, "omegaprm tree search: most rollouts per problem.", 1)
    # --- consensus with a judge ----------------------------------------------------------------------------
    judge: str | None = _f(
        None,
        "Consensus filter: 'module:function' called as function(question, steps, reference) -> the index of the "
        "first wrong step, -1 for none, or null (no answer); a solution is kept only where it agrees with the "
        "Monte Carlo labels' first '-' step.",
    )
    judge_model_name_or_path: str | None = _f(
        None,
        "Consensus filter with a judge model, asked ProcessBench's critique prompt (greedy): its \\boxed{index} is "
        "the first wrong step.",
    )
    judge_max_new_tokens: int = _f(1024, "Most new tokens of the judge model's critique.", 1)
    # --- output --------------------------------------------------------------------------------------------
    output_dir: str = _f(
        "output/labels",
        "Writes labels.jsonl (PaddleNLP PRM records with soft_labels), report.json, and parts/ while it runs; a "
        "run with the same settings resumes there.",
    )
    overwrite_output_dir: bool = _f(False, "Delete the labels of other settings in output_dir and start afresh.")
    placeholder_token: str = _f("ки", "The PRM's step placeholder: a written step containing it is not labelled.")
    reward_tokens: str = _f("+,-", "How a right and a wrong step are written in labels ('positive,negative').")
    seed: int = _f(42, "Seeds every generation (per problem: the same labels under any number of processes).", 0)
    # --- scaling out ---------------------------------------------------------------------------------------
    ray_workers: int = _f(0, "Label in this many Ray workers (each a share of the problems); 0: this process.", 0)
    ray_address: str | None = _f(None, "Ray cluster to join (e.g. 'auto'); null: start a local one.")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.engine not in ENGINES:
            raise UserError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.temperature <= 0:
            raise UserError(f"temperature must be > 0 (the estimates need samples), got {self.temperature}")
        if self.completion_timeout <= 0:
            raise UserError(f"completion_timeout must be > 0 seconds, got {self.completion_timeout}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise UserError(f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        if not self.step_separator:
            raise UserError('step_separator is empty: give the text between steps, e.g. "\\n"')
        if not self.placeholder_token:
            raise UserError('placeholder_token is empty: give the PRM\'s step placeholder, e.g. "ки"')
        reward_token_pair(self.reward_tokens)
        if self.method == "omegaprm" and self.num_solutions is not None:
            raise UserError(
                "num_solutions is math_shepherd's: omegaprm's tree search starts from num_completions rollouts of "
                "the question; remove num_solutions"
            )
        if self.judge and self.judge_model_name_or_path:
            raise UserError("judge and judge_model_name_or_path are both set: give one judge")
        for name in ("verifier", "judge"):
            spec = getattr(self, name)
            if spec is not None and (":" not in spec or not all(spec.partition(":")[::2])):
                raise UserError(f"{name} {spec!r}: must be 'package.module:function'")

    @property
    def solutions_per_problem(self) -> int:
        return self.num_solutions or DEFAULT_SOLUTIONS

    @property
    def positive_token(self) -> str:
        return reward_token_pair(self.reward_tokens)[0]

    @property
    def negative_token(self) -> str:
        return reward_token_pair(self.reward_tokens)[1]


def validate_label_arguments(args: LabelArguments, source: str) -> None:
    """The checks on files, before any model loads: the problems file and the model directories exist, the
    output directory is writable."""
    if not args.problems_path:
        raise UserError(f"{source}: problems_path is required: the problems to label ({{src, tgt}} records)")
    resolve_paths(args.problems_path, "problems_path", source)
    if args.completer_model_name_or_path is None and args.model_name_or_path is None:
        raise UserError(
            f"{source}: model_name_or_path (the policy) or completer_model_name_or_path is required: the completions "
            "come from one of them"
        )
    check_output_dir(args.output_dir)


LABEL_ARGUMENT_TYPES = (LabelArguments,)
