"""One recipe shape for the SFT, reward-model and DPO trainers, and the one build sequence that runs it.

A ``Recipe`` holds what differs per task: which trainer class, which model loader, which reader and encoder
(``read_split``), which collator, which LoRA task, and the task's extra checks and objects. ``build_trainer``
runs the sequence they share, over the run's ``RunContext`` (``llm.alignment.context``: the arguments as
validated, the tokenizer loaded once, the effective ``use_chat_template``; nothing is written back into the
arguments):

1. the recipe's checks (``check``: the task's own; ``validate_arguments`` made the shared ones, LoRA's included);
2. the recipe's changes to the tokenizer (a PRM's added placeholder);
3. the model (``load_model``), then LoRA adapters when ``lora`` is set; with ``lora`` or ``recompute`` (on by
   default with LoRA) glibc's freed heap is handed back between decoder layers (``llm.utils.memory``);
4. the objects built from the model (``model_objects``: DPO's reference);
5. the training and dev splits (``llm.data.prepare.train_and_dev`` over ``read_split``, told which split it reads),
   their checks and the objects built from them (``data_objects``: a reward model's dev records);
6. the trainer: ``trainer_class(model, args=training_args, model_args=model_args, run=run, ...)``, reading its
   hyper-parameters from those arguments; then ``finish`` (DPO's precomputed reference log-probs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm.alignment.context import RunContext
from llm.alignment.lm import load_causal_lm
from llm.alignment.trainer import AlignmentTrainer
from llm.data.packing import collate
from llm.data.prepare import PackedData, Split, plan_summary, train_and_dev
from llm.settings.flat import recompute_mode
from llm.utils.attention import kernel_for
from llm.utils.lora import apply_lora, quantization_config
from llm.utils.memory import keep_freed_memory, release_between_layers
from llm.utils.modeling import RESUMING, count_parameters
from llm.utils.precision import cpu_bf16_hint
from llm.utils.preemption import SaveOnSignal

logger = logging.getLogger(__name__)


class Recipe:
    """What one task's trainer is built from. The defaults are a causal LM trained on packed rows (SFT);
    a task overrides the attributes and hooks that differ."""

    task = "SFT"  # the task's name in the build's log line
    trainer_class: type[AlignmentTrainer] = AlignmentTrainer
    collate: Callable = staticmethod(collate)  # rows -> batch, with pad_token_id and kernel
    lora_task = "causal_lm"  # llm.utils.lora.apply_lora's task: causal_lm or seq_cls

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.model_args, self.data_args, self.training_args = run.model_args, run.data_args, run.training_args

    def check(self) -> None:
        """Stops a run whose arguments do not fit together, before anything is loaded (the task's own checks;
        ``validate_arguments`` made the shared ones)."""

    def prepare_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Changes to the tokenizer before the model is loaded (none by default)."""

    def load_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        """A causal LM with the packed attention kernel, its activation recompute and QLoRA quantization."""
        m, t = self.model_args, self.training_args
        return load_causal_lm(
            m.model_name_or_path,
            t,
            tokenizer,
            m.init_from_config,
            recompute_mode(m, t),
            quantization_config(m, t),
        )

    def lora_head_rows(self) -> list[int] | None:
        """The LM-head rows trained with ``lora_train_head`` (a PRM's reward tokens); None: the head stays frozen."""
        return None

    def model_objects(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict:
        """Trainer keywords built from the (LoRA-wrapped) model; none by default."""
        return {}

    def read_split(
        self,
        path: str,
        split: Split,
        batch_size: int,
        probs: str | None = None,
        lazy: bool = False,
        max_records: int | None = None,
    ) -> PackedData:
        """One split (``split``: "train" or "eval") read, validated, tokenised with ``self.run.tokenizer`` and packed
        (``lazy``: streamed; ``max_records``: the first ones)."""
        raise NotImplementedError

    def data_objects(self, train: PackedData | None, dev: PackedData | None) -> dict:
        """Checks of the splits read, and trainer keywords built from them; none by default."""
        return {}

    def finish(self, trainer: AlignmentTrainer) -> None:
        """Work on the built trainer before it is returned; none by default."""


def build_trainer(recipe: Recipe) -> tuple[AlignmentTrainer, PackedData | None, PackedData | None]:
    """The trainer of ``recipe``, with its training and dev splits (None when not read)."""
    run = recipe.run
    model_args, data_args, training_args, tokenizer = run.model_args, run.data_args, run.training_args, run.tokenizer
    recipe.check()
    recipe.prepare_tokenizer(tokenizer)
    resume = str(training_args.resume_from_checkpoint or "").lower() not in ("", "false", "none")
    token = RESUMING.set(resume and training_args.do_train)
    try:
        model = recipe.load_model(tokenizer)
    finally:
        RESUMING.reset(token)
    if model_args.lora:
        model = apply_lora(model, model_args, recipe.lora_task, recipe.lora_head_rows())
    if training_args.recompute or model_args.lora:  # glibc's freed heap goes back between layers (memory.py)
        release_between_layers(model)
    else:  # not saving memory: freed memory is kept for reuse, not faulted in again each step (memory.py)
        keep_freed_memory(recipe.task)
    objects = recipe.model_objects(model, tokenizer)
    train, dev = train_and_dev(data_args, training_args, recipe.read_split)
    objects.update(recipe.data_objects(train, dev))
    logger.info(
        "%s %s: %.2fM parameters; %s",
        recipe.task,
        type(model).__name__,
        count_parameters(model) / 1e6,
        plan_summary(train, data_args),
    )
    hint = cpu_bf16_hint(training_args.bf16, training_args.fp16, training_args.use_cpu)
    if hint and training_args.do_train:
        logger.info(hint)
    trainer = recipe.trainer_class(
        model=model,
        args=training_args,
        model_args=model_args,
        run=run,
        train_dataset=train.rows if train else None,
        eval_dataset=dev.rows if dev else None,
        data_collator=functools.partial(
            recipe.collate,
            pad_token_id=tokenizer.pad_token_id,
            kernel=kernel_for(model_args.use_flash_attention, model_args.flash_mask),
        ),
        processing_class=tokenizer,
        callbacks=[SaveOnSignal()],
        **objects,
    )
    recipe.finish(trainer)
    return trainer, train, dev
