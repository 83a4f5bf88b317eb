"""Build everything ``run_dpo.py`` needs: tokenizer, packed pairs, policy, reference, trainer."""

from __future__ import annotations

import copy
import functools
import logging

from transformers import PreTrainedTokenizerBase

from llm.alignment.dpo.loss import loss_spec
from llm.alignment.dpo.trainer import DPOTrainer, collate_pairs
from llm.alignment.lm import load_causal_lm
from llm.alignment.sft.build import encode_config
from llm.data.pipeline import PackedData, load_packed, plan_summary, train_and_dev
from llm.data.tokenize import resolve_chat_template
from llm.data.tokenize_lm import encode_pair_for_lm
from llm.settings.dpo import DPOModelArgument, DPOTrainingArguments
from llm.settings.flat import DataArgument, recompute_mode
from llm.utils.attention import kernel_for
from llm.utils.errors import UserError
from llm.utils.lora import apply_lora, check_lora_arguments, quantization_config
from llm.utils.modeling import count_parameters, load_tokenizer
from llm.utils.preemption import SaveOnSignal

logger = logging.getLogger(__name__)


def build_pair_data(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    data_args: DataArgument,
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
        cfg=encode_config(data_args),
        prompt_targets=loss_spec(loss_type).nll_term,  # ORPO's NLL term also covers the prompt tokens
    )
    return load_packed(path, "pair", encode, data_args, batch_size, seed, probs, lazy, max_records)


def build_reference(model_args: DPOModelArgument, training_args: DPOTrainingArguments, tokenizer, policy):
    """The frozen reference: ``ref_model_name_or_path``, else a copy of the initial policy; None if unused, or
    with a LoRA policy (its base with the adapter disabled is the reference, ``llm.utils.lora.reference_model``)."""
    if not training_args.uses_reference:
        return None
    if model_args.ref_model_name_or_path:
        return load_causal_lm(model_args.ref_model_name_or_path, training_args, tokenizer, init_from_config=False)
    if model_args.lora:
        return None
    if not training_args.do_train:
        raise UserError(
            f"evaluation-only run with loss_type={training_args.loss_type!r}: set ref_model_name_or_path to the "
            "reference model (usually the SFT model); without it the reference would be the evaluated model itself"
        )
    if training_args.precompute_ref_log_probs:
        return None  # the initial policy computes them before the first step
    return copy.deepcopy(policy)


def build_dpo_trainer(
    model_args: DPOModelArgument, data_args: DataArgument, training_args: DPOTrainingArguments
) -> tuple[DPOTrainer, PackedData | None, PackedData | None]:
    if training_args.precompute_ref_log_probs and data_args.lazy:
        raise UserError("precompute_ref_log_probs needs the data in memory: set lazy false (or precompute false)")
    check_lora_arguments(model_args, training_args)
    tokenizer = load_tokenizer(model_args.tokenizer_name_or_path or model_args.model_name_or_path)
    # the effective choice, for the encoders and the run fingerprint (which reads data_args)
    data_args.use_chat_template = resolve_chat_template(data_args.use_chat_template, tokenizer)
    recompute = recompute_mode(model_args, training_args)
    model = load_causal_lm(
        model_args.model_name_or_path,
        training_args,
        tokenizer,
        model_args.init_from_config,
        recompute,
        quantization_config(model_args, training_args),
    )
    if model_args.lora:
        model = apply_lora(model, model_args, "causal_lm")
    ref_model = build_reference(model_args, training_args, tokenizer, model)
    data = functools.partial(
        build_pair_data,
        tokenizer=tokenizer,
        data_args=data_args,
        seed=training_args.seed,
        loss_type=training_args.loss_type,
    )
    train, dev = train_and_dev(data_args, training_args, data)
    plan = plan_summary(train, data_args)
    logger.info(
        "DPO (%s) %s: %.2fM parameters; %s",
        training_args.loss_type,
        type(model).__name__,
        count_parameters(model) / 1e6,
        plan,
    )
    trainer = DPOTrainer(
        model=model,
        args=training_args,
        train_dataset=train.rows if train else None,
        eval_dataset=dev.rows if dev else None,
        data_collator=functools.partial(
            collate_pairs,
            pad_token_id=tokenizer.pad_token_id,
            kernel=kernel_for(model_args.use_flash_attention, model_args.flash_mask),
        ),
        processing_class=tokenizer,
        loss_type=training_args.loss_type,
        beta=training_args.beta,
        label_smoothing=training_args.label_smoothing,
        simpo_gamma=training_args.simpo_gamma,
        sft_loss_weight=training_args.sft_loss_weight,
        reference_free=training_args.reference_free,
        ref_model=ref_model,
        callbacks=[SaveOnSignal()],
    )
    trainer.lora_merge = model_args.lora_merge  # AlignmentTrainer.save_model writes output_dir/merged too
    if training_args.precompute_ref_log_probs:
        trainer.precompute_reference_log_probs()
        logger.info("reference log-probs precomputed for every pair; no reference model is kept")
    return trainer, train, dev
