"""Build everything ``run_dpo.py`` needs from parsed arguments: the DPO recipe (``llm.alignment.recipe``), whose
trainer also gets the frozen reference model."""

from __future__ import annotations

import copy
import functools
import logging

from transformers import PreTrainedTokenizerBase

from llm.alignment.context import RunContext
from llm.alignment.dpo.loss import loss_spec
from llm.alignment.dpo.trainer import DPOTrainer, collate_pairs
from llm.alignment.lm import load_causal_lm
from llm.alignment.recipe import Recipe, build_trainer
from llm.data.encode_lm import encode_pair_for_lm
from llm.data.encoding import EncodeConfig
from llm.data.prepare import PackedData, load_packed
from llm.settings.dpo import DPOModelArgument, DPOTrainingArguments
from llm.settings.flat import DataArgument
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)


def build_pair_data(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    data_args: DataArgument,
    cfg: EncodeConfig,
    loss_type: str,
    batch_size: int,
    seed: int,
    probs: str | None = None,
    lazy: bool = False,
    max_records: int | None = None,
) -> PackedData:
    encode = functools.partial(
        encode_pair_for_lm,
        tokenizer=tokenizer,
        cfg=cfg,
        prompt_targets=loss_spec(loss_type).nll_term,  # ORPO's NLL term also covers the prompt tokens
    )
    return load_packed(path, "pair", encode, data_args, batch_size, seed, probs, lazy, max_records)


def load_reference(path: str | None, training_args, tokenizer, policy):
    """A reference model: the model at ``path``, else a copy of ``policy`` as loaded (the initial model: a resume
    loads the checkpoint into the policy only later, so it gets the same reference)."""
    if path:
        return load_causal_lm(path, training_args, tokenizer, init_from_config=False)
    return copy.deepcopy(policy)


def build_reference(model_args: DPOModelArgument, training_args: DPOTrainingArguments, tokenizer, policy):
    """The frozen reference: ``ref_model_name_or_path``, else a copy of the initial policy; None if unused, or
    with a LoRA policy (its base with the adapter disabled is the reference, ``llm.utils.lora.reference_model``)."""
    if not training_args.uses_reference:
        return None
    if model_args.ref_model_name_or_path:
        return load_reference(model_args.ref_model_name_or_path, training_args, tokenizer, policy)
    if model_args.lora:
        return None
    if not training_args.do_train:
        raise UserError(
            f"evaluation-only run with loss_type={training_args.loss_type!r}: set ref_model_name_or_path to the "
            "reference model (usually the SFT model); without it the reference would be the evaluated model itself"
        )
    if training_args.precompute_ref_log_probs:
        return None  # the initial policy computes them before the first step
    return load_reference(None, training_args, tokenizer, policy)


class DPORecipe(Recipe):
    """A causal LM on packed preference pairs ``[prompt | chosen | rejected]``, against a frozen reference."""

    trainer_class = DPOTrainer
    collate = staticmethod(collate_pairs)  # plus the precomputed reference log-probs

    @property
    def task(self) -> str:
        return f"DPO ({self.training_args.loss_type})"

    def check(self) -> None:
        if self.training_args.precompute_ref_log_probs and self.data_args.lazy:
            raise UserError("precompute_ref_log_probs needs the data in memory: set lazy false (or precompute false)")
        super().check()

    def model_objects(self, model, tokenizer) -> dict:
        return {"ref_model": build_reference(self.model_args, self.training_args, tokenizer, model)}

    def read_split(self, path, split, batch_size, probs=None, lazy=False, max_records=None) -> PackedData:
        t, run = self.training_args, self.run
        return build_pair_data(
            path, run.tokenizer, self.data_args, run.encoding, t.loss_type, batch_size, t.seed, probs, lazy, max_records
        )

    def finish(self, trainer: DPOTrainer) -> None:
        if self.training_args.precompute_ref_log_probs:
            trainer.precompute_reference_log_probs()
            logger.info("reference log-probs precomputed for every pair; no reference model is kept")


def build_dpo_trainer(run: RunContext) -> tuple[DPOTrainer, PackedData | None, PackedData | None]:
    """``run``: ``RunContext.load(model_args, data_args, training_args)`` of DPO's argument types."""
    return build_trainer(DPORecipe(run))
