"""Build everything ``run_finetune.py`` needs from parsed arguments: tokenizer, packed data, model, trainer."""

from __future__ import annotations

import functools
import logging

from transformers import PreTrainedTokenizerBase

from llm.alignment.lm import load_causal_lm
from llm.alignment.sft.trainer import SFTTrainer
from llm.data.packing import collate
from llm.data.pipeline import PackedData, load_packed, plan_summary, train_and_dev
from llm.data.tokenize import EncodeConfig, resolve_chat_template
from llm.data.tokenize_lm import encode_sft
from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments, recompute_mode
from llm.utils.attention import kernel_for
from llm.utils.lora import apply_lora, check_lora_arguments, quantization_config
from llm.utils.modeling import count_parameters, load_tokenizer
from llm.utils.preemption import SaveOnSignal

logger = logging.getLogger(__name__)


def encode_config(data_args: DataArgument) -> EncodeConfig:
    """The encoders' settings; ``use_chat_template`` as the build resolved it (unset: off, the encoders' default)."""
    return EncodeConfig(
        data_args.max_seq_len, data_args.max_prompt_len, data_args.overlong_policy, bool(data_args.use_chat_template)
    )


def build_sft_data(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    data_args: DataArgument,
    batch_size: int,
    seed: int,
    probs: str | None = None,
    lazy: bool = False,
    max_records: int | None = None,
) -> PackedData:
    encode = functools.partial(encode_sft, tokenizer=tokenizer, cfg=encode_config(data_args))
    return load_packed(path, "sft", encode, data_args, batch_size, seed, probs, lazy, max_records)


def build_sft_trainer(
    model_args: ModelArgument, data_args: DataArgument, training_args: TrainingArguments
) -> tuple[SFTTrainer, PackedData | None, PackedData | None]:
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
    data = functools.partial(build_sft_data, tokenizer=tokenizer, data_args=data_args, seed=training_args.seed)
    train, dev = train_and_dev(data_args, training_args, data)
    logger.info(
        "SFT %s: %.2fM parameters; %s",
        type(model).__name__,
        count_parameters(model) / 1e6,
        plan_summary(train, data_args),
    )
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train.rows if train else None,
        eval_dataset=dev.rows if dev else None,
        data_collator=functools.partial(
            collate,
            pad_token_id=tokenizer.pad_token_id,
            kernel=kernel_for(model_args.use_flash_attention, model_args.flash_mask),
        ),
        processing_class=tokenizer,
        callbacks=[SaveOnSignal()],
    )
    trainer.lora_merge = model_args.lora_merge  # AlignmentTrainer.save_model writes output_dir/merged too
    return trainer, train, dev
