"""PaddleNLP-style arguments: one flat JSON file, overridden by ``--field value`` on the command line.

Each JSON key is routed to the dataclass that declares it (``ModelArgument``, ``DataArgument``,
``TrainingArguments``). Paddle names are mapped onto the PyTorch mechanism that does the same job;
a field that cannot take effect in this build stops the run at start-up with a message saying what
to change, instead of being silently ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import transformers

from llm.settings.shared import LoraFields, OptimizerFields
from llm.utils.distributed import Layout, has_accelerator, parse_layout
from llm.utils.errors import UserError
from llm.utils.lora import check_lora_arguments
from llm.utils.paths import resolve_paths
from llm.utils.rundir import check_output_dir


@dataclass
class ModelArgument(LoraFields):
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hugging Face checkpoint directory (or hub id already in the local cache)."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer directory; defaults to model_name_or_path."}
    )
    init_from_config: bool = field(
        default=False,
        metadata={
            "help": "Build the model with random weights (seeded by `seed`) from the config.json in "
            "model_name_or_path instead of loading weights. For tests and the bundled tiny demo."
        },
    )
    eval_random_init: bool = field(
        default=False,
        metadata={
            "help": "Allow an evaluation-only run (do_train false) of a model built with random weights "
            "(init_from_config true), e.g. a baseline; without it such a run stops: it would measure nothing."
        },
    )
    use_flash_attention: bool = field(
        default=False, metadata={"help": "CUDA only: flash-attn varlen kernel for packed rows (needs flash-attn)."}
    )
    flash_mask: bool = field(
        default=False,
        metadata={"help": "Sparse packed-sequence mask: FlexAttention on CUDA, segment-wise SDPA on CPU."},
    )
    recompute_granularity: str = field(
        default="full", metadata={"help": "Activation checkpointing granularity: full | full_attn | core_attn."}
    )
    virtual_pp_degree: int = field(
        default=1, metadata={"help": "Virtual pipeline stages (pipeline parallel).", "min": 1}
    )
    # LoRA / QLoRA with peft: the shared fields (llm.settings.shared), checked and applied in llm/utils/lora.py
    lora_train_head: bool = field(
        default=False,
        metadata={
            "help": "With lora: also train the LM head, saved in the adapter. PRM: only the reward-token rows it "
            "reads; SFT/DPO: the whole head. (An ORM's new score head is always trained.)"
        },
    )
    weight_quantize_algo: str | None = field(
        default=None,
        metadata={
            "help": "QLoRA (PaddleNLP's name): nf4 | fp4 loads the frozen base in 4 bits with bitsandbytes; "
            "needs lora and a CUDA device."
        },
    )
    weight_double_quant: bool = field(
        default=False, metadata={"help": "QLoRA: also quantize the 4-bit quantization constants (double quant)."}
    )


@dataclass
class DataArgument:
    train_dataset_path: str | None = field(
        default=None,
        metadata={"help": "Training data: .json/.jsonl/.parquet file or HF dataset dir; comma-separate to mix."},
    )
    dev_dataset_path: str | None = field(default=None, metadata={"help": "Evaluation data (same formats)."})
    map_keys: dict | None = field(
        default=None,
        metadata={
            "help": "Rename fields of every record as it is read (MindSpeed's --map-keys): "
            '{"field this project reads": "column in your data"}, e.g. {"src": "question", "tgt": "answer"}.'
        },
    )
    dataset_probs: str | None = field(
        default=None, metadata={"help": "Sampling probabilities for mixed training files, e.g. '0.7,0.3'."}
    )
    max_seq_len: int = field(default=4096, metadata={"help": "Maximum tokens per (packed) row.", "min": 2})
    max_prompt_len: int | None = field(
        default=None,
        metadata={
            "help": "Maximum prompt tokens (prompt kept from the right); default min(2048, max_seq_len // 2).",
            "min": 1,
        },
    )
    zero_padding: bool = field(default=False, metadata={"help": "Pack several examples into one row."})
    greedy_zero_padding: bool = field(
        default=False, metadata={"help": "Bin-pack examples (best-fit decreasing) to cut the pad ratio."}
    )
    overlong_policy: str = field(
        default="truncate",
        metadata={"help": "Examples longer than max_seq_len: 'truncate' (at a step boundary for PRM) or 'skip'."},
    )
    lazy: bool = field(
        default=False, metadata={"help": "Stream the training file instead of loading it (no shuffling)."}
    )
    use_chat_template: bool | None = field(
        default=None,
        metadata={
            "help": "Format prompts with the tokenizer's chat template (true) or as plain text (false); null "
            "(default): on exactly when the tokenizer has a chat template. The choice is logged."
        },
    )
    max_eval_samples: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate on the first N dev records only (every evaluation: during training, the final one, "
            "ProcessBench and best-of-N); null: all. A best-of-N group the cut splits is left out whole.",
            "min": 1,
        },
    )
    benchmark: bool = field(default=False, metadata={"help": "Timing run: train only, no evaluation, no saving."})
    autotuner_benchmark: bool = field(default=False, metadata={"help": "Same as benchmark (PaddleNLP autotuner)."})

    def __post_init__(self) -> None:
        if self.overlong_policy not in ("truncate", "skip"):
            raise UserError(f"overlong_policy must be 'truncate' or 'skip', got {self.overlong_policy!r}")
        if self.max_prompt_len is None:  # follows max_seq_len when the user did not set it
            self.max_prompt_len = min(2048, self.max_seq_len // 2)
        if self.max_prompt_len >= self.max_seq_len:
            raise UserError(
                f"max_prompt_len ({self.max_prompt_len}) must be smaller than max_seq_len ({self.max_seq_len}): "
                "lower max_prompt_len or raise max_seq_len"
            )

    @property
    def pack(self) -> str | None:
        """Packing strategy: None (one example per row), 'sequential' or 'greedy'."""
        if self.greedy_zero_padding:
            return "greedy"
        return "sequential" if self.zero_padding else None


@dataclass
class TrainingArguments(OptimizerFields, transformers.TrainingArguments):
    report_to: None | str | list[str] = field(
        default="tensorboard", metadata={"help": "Loggers: tensorboard (default), none, wandb, ..."}
    )
    evaluation_strategy: str | None = field(
        default=None, metadata={"help": "PaddleNLP/old HF name of eval_strategy (no | steps | epoch)."}
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Warmup as a ratio of total steps; warmup_steps wins.", "min": 0}
    )
    fp16_opt_level: str = field(
        default="O1",
        metadata={
            "help": "O1: fp32 weights, bf16/fp16 autocast; O2: bf16/fp16 weights, the same autocast, AdamW on fp32 "
            "master weights; fp16 adds dynamic loss scaling (llm/utils/precision.py)."
        },
    )
    tensor_parallel_degree: int = field(
        default=1, metadata={"help": "Processes per tensor-parallel group (DTensor, the model's tp_plan).", "min": 1}
    )
    sharding_parallel_degree: int = field(
        default=-1,
        metadata={"help": "Processes per FSDP2 sharding group; -1: all data-parallel processes (HSDP when smaller)."},
    )
    sharding: str = field(
        default="",
        metadata={"help": "stage1 | stage2 | stage3 [offload]: FSDP2 sharding of optimizer state/grads/params."},
    )
    recompute: bool | None = field(
        default=None,
        metadata={
            "help": "Activation checkpointing; null (the default): on with lora (LoRA's memory default: a LoRA step "
            "then holds one layer's activations, not every layer's), off without."
        },
    )
    unified_checkpoint: bool = field(
        default=True,
        metadata={
            "help": "Checkpoints also hold the model as one Hugging Face safetensors file (the sharded state is "
            "always written; the final output_dir always holds the model)."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train in an output_dir that holds another run's results (checkpoint-*, a model): files of the "
            "same name are written over, nothing is deleted. Without it (or resume_from_checkpoint) such a "
            "directory stops the run at start-up."
        },
    )
    script: ClassVar[str] = "sft"  # which run_*.py reads these arguments (an OpenRLHF launch script must match)
    # Lines about the config for the log (PaddleNLP names with no effect here, ...), filled by parse_arguments.
    config_notes: list[str] = field(default_factory=list, init=False, repr=False)
    # save_only_model as given: whether checkpoints hold the optimizer, scheduler and RNG state (derived below)
    save_training_state: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.evaluation_strategy is not None:
            if self.eval_strategy not in ("no", self.evaluation_strategy):
                raise UserError(
                    f"evaluation_strategy={self.evaluation_strategy!r} and eval_strategy={self.eval_strategy!r} "
                    "disagree: keep one of them"
                )
            self.eval_strategy = self.evaluation_strategy
        if not self.warmup_steps and self.warmup_ratio:
            if not 0 <= self.warmup_ratio < 1:
                raise UserError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
            self.warmup_steps = self.warmup_ratio
        if self.fp16_opt_level not in ("O1", "O2"):
            raise UserError(f"fp16_opt_level must be 'O1' or 'O2', got {self.fp16_opt_level!r}")
        if self.recompute:
            self.activation_checkpointing = True
            self.activation_checkpointing_kwargs = {"use_reentrant": False}
        if not has_accelerator():
            # bf16 autocast works on CPU; HF refuses it unless told it is a CPU run.
            self.use_cpu = True
        # Our collators build typed packed batches; HF must not drop "unused" columns.
        self.remove_unused_columns = False
        # Checkpoints are written by llm.alignment.checkpointing for every layout (transformers' own code refuses
        # the optimizer of a model placed by DistributedConfig): transformers is told to save the model only, and
        # the setting as given says whether ours hold the training state.
        self.save_training_state, self.save_only_model = not self.save_only_model, True
        if self.disable_tqdm is None and not sys.stderr.isatty():
            self.disable_tqdm = True  # a log file gets the logged steps, not 100s of KB of carriage returns
        if self.ddp_find_unused_parameters is None:
            # every trained parameter takes part in each loss here: DDP's search (and its warning) is not needed
            self.ddp_find_unused_parameters = False
        try:
            super().__post_init__()
        except ValueError as err:
            raise UserError(str(err)) from None

    @property
    def layout(self) -> Layout:
        """How the processes split into data-parallel replicas, FSDP2 shard groups and tensor-parallel groups."""
        return parse_layout(self.sharding, self.sharding_parallel_degree, self.tensor_parallel_degree)


def validate_arguments(model_args: ModelArgument, data_args: DataArgument, training_args: TrainingArguments) -> None:
    """Cross-field checks. Every accepted field either takes effect or stops the run here."""
    if model_args.model_name_or_path is None:
        raise UserError("model_name_or_path is required: point it at a Hugging Face checkpoint directory")
    if model_args.recompute_granularity not in ("full", "full_attn", "core_attn"):
        raise UserError(
            f"recompute_granularity must be full, full_attn or core_attn, got {model_args.recompute_granularity!r}"
        )
    if training_args.recompute is None:
        lora_default(model_args, training_args)
    if training_args.recompute and model_args.recompute_granularity != "full":
        # finer than a whole layer: applied to the attention blocks at load time (llm.utils.modeling)
        training_args.activation_checkpointing = False
    if model_args.virtual_pp_degree != 1:
        raise UserError("virtual_pp_degree: pipeline parallelism is not available in this build; set it to 1")
    if model_args.use_flash_attention:
        if not torch.cuda.is_available():
            raise UserError(
                "use_flash_attention needs a CUDA device and the flash-attn package; on CPU set it to false "
                "(the CPU packed path gives exact results)"
            )
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise UserError("use_flash_attention: flash-attn is not installed; pip install flash-attn or set it false")
    if training_args.fp16_opt_level == "O2" and not (training_args.bf16 or training_args.fp16):
        raise UserError("fp16_opt_level 'O2' (half-precision weights) needs bf16 or fp16 set to true")
    optim = str(getattr(training_args.optim, "value", training_args.optim))
    if training_args.fp16 and training_args.fp16_opt_level == "O2" and not optim.startswith("adamw_torch"):
        raise UserError(
            f"fp16_opt_level 'O2' with fp16 needs AdamW (optim adamw_torch or adamw_torch_fused) for its fp32 "
            f"master weights; optim={optim!r} would step on the fp16 weights. Use bf16, or O1"
        )
    layout = training_args.layout  # validates sharding / degrees against the world size
    check_lora_arguments(model_args, training_args)  # (lora_path found here: read-only once validated)
    if layout.tp > 1 and data_args.lazy:
        raise UserError(
            "lazy streaming with tensor_parallel_degree > 1 is not available (streamed rows are split over all "
            "processes, not over the data-parallel ranks): set lazy false, or shard with sharding instead"
        )
    if data_args.dataset_probs and not data_args.train_dataset_path:
        raise UserError("dataset_probs needs train_dataset_path with several comma-separated files")
    if data_args.lazy and training_args.max_steps <= 0 and training_args.do_train:
        raise UserError("lazy streaming has no length: set max_steps > 0")
    if training_args.do_train:
        # each would save an untrained model and exit 0 (train_loss 0): say so instead
        if training_args.max_steps == 0:
            raise UserError(
                "max_steps is 0: nothing would be trained; set max_steps > 0, or -1 to train for num_train_epochs"
            )
        if training_args.max_steps < 0 and training_args.num_train_epochs == 0:
            raise UserError("num_train_epochs is 0 (and max_steps unset): nothing would be trained; set either above 0")
        if training_args.learning_rate == 0:
            raise UserError(
                "learning_rate is 0: training would change nothing; give a positive learning_rate, or set do_train "
                "false to only evaluate"
            )
    source = getattr(training_args, "config_source", "config")
    evaluates_only = training_args.do_eval and not training_args.do_train
    if evaluates_only and model_args.init_from_config and not model_args.eval_random_init:
        raise UserError(
            f"{source}: an evaluation-only run (do_train false) of a model with random weights (init_from_config "
            f"true) would measure nothing: evaluate a trained model with --model_name_or_path DIR "
            f"--init_from_config false (the tiny demo's: its output_dir), or set eval_random_init true for a "
            f"random baseline on purpose"
        )
    for name, read in (("train_dataset_path", training_args.do_train), ("dev_dataset_path", training_args.do_eval)):
        if read and getattr(data_args, name):  # a missing data file stops here, before any model loads
            resolve_paths(getattr(data_args, name), name, source)
    check_output_dir(training_args.output_dir)  # a file there or an unwritable directory: stop now, not at a save
    if data_args.benchmark or data_args.autotuner_benchmark:
        training_args.do_eval = False
        training_args.eval_strategy = "no"
        training_args.save_strategy = "no"
    if data_args.lazy:
        # accelerate would read a streamed data set on rank 0 only and broadcast whole collated batches, which must
        # be plain tensors; instead every rank reads the (deterministic) stream and keeps its share of the rows
        training_args.accelerator_config.dispatch_batches = False


def lora_default(model_args: ModelArgument, training_args: TrainingArguments) -> None:
    """``recompute`` left unset: on with LoRA (a line in the log says so), off without. LoRA drops the gradients
    and optimizer state of the base, so what is left of a step's peak is mostly activations (bench/README.md,
    "LoRA memory")."""
    training_args.recompute = bool(model_args.lora)
    if training_args.recompute:
        training_args.activation_checkpointing = True
        training_args.activation_checkpointing_kwargs = {"use_reentrant": False}
        training_args.config_notes.append(
            "lora: activation checkpointing on (recompute, the LoRA default: the step keeps one decoder layer's "
            "activations at a time, at about a third more compute); recompute false turns it off"
        )


def recompute_mode(model_args: ModelArgument, training_args: TrainingArguments) -> str | None:
    """The attention-level recompute to apply at load time; None when off or done per layer by transformers."""
    if training_args.recompute and model_args.recompute_granularity != "full":
        return model_args.recompute_granularity
    return None


ARGUMENT_TYPES = (ModelArgument, DataArgument, TrainingArguments)


# Input paths: looked up from the working directory, then the repository root (both launch habits).
INPUT_PATHS = (
    "model_name_or_path",
    "tokenizer_name_or_path",
    "ref_model_name_or_path",
    "train_dataset_path",
    "dev_dataset_path",
    "problems_path",  # llm/run_label.py
    "completer_model_name_or_path",
    "judge_model_name_or_path",
)

# Lower bounds of transformers' own fields (ours, and the shared optimizer fields, declare theirs as metadata
# {"min": ...}).
TRAINING_BOUNDS = {
    "per_device_train_batch_size": 1,
    "per_device_eval_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "warmup_steps": 0,
    "num_train_epochs": 0,
    "max_steps": -1,
    "logging_steps": 0,
    "save_steps": 0,
    "eval_steps": 0,
    "dataloader_num_workers": 0,
    "save_total_limit": 0,
    "seed": 0,
}
