"""Build everything ``run_reward.py`` needs from parsed arguments: tokenizer, packed data, model, trainer."""

from __future__ import annotations

import functools
import logging

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerBase

from llm.alignment.lm import weights_dtype
from llm.alignment.rm.arguments import RewardModelArgument, RewardTrainingArguments
from llm.alignment.rm.evaluation import AGGREGATIONS
from llm.alignment.rm.trainer import RewardTrainer
from llm.data.packing import collate
from llm.data.pipeline import PackedData, load_packed, plan_summary, train_and_dev
from llm.data.tokenize import (
    EncodeConfig,
    add_placeholder_token,
    encode_pair_for_scores,
    encode_prm,
    placeholder_token_id,
    single_token_id,
)
from llm.utils.arguments import DataArgument, recompute_mode
from llm.utils.attention import kernel_for
from llm.utils.errors import UserError
from llm.utils.lora import apply_lora, check_lora_arguments, quantization_config
from llm.utils.modeling import count_parameters, load_model, load_tokenizer
from llm.utils.preemption import SaveOnSignal

logger = logging.getLogger(__name__)


def reward_tokens(model_args: RewardModelArgument) -> tuple[str, str]:
    tokens = tuple(t.strip() for t in model_args.reward_tokens.split(","))
    if len(tokens) != 2 or not all(tokens) or tokens[0] == tokens[1]:
        raise UserError(
            f"reward_tokens must be two different tokens 'positive,negative', got {model_args.reward_tokens!r}"
        )
    return tokens  # type: ignore[return-value]


def build_reward_data(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    model_args: RewardModelArgument,
    data_args: DataArgument,
    process_reward: bool,
    batch_size: int,
    seed: int,
    probs: str | None = None,
    lazy: bool = False,
) -> PackedData:
    """Read, validate, tokenise and pack one split (``lazy``: a stream packed on the fly)."""
    tokens = reward_tokens(model_args)
    cfg = EncodeConfig(
        data_args.max_seq_len, data_args.max_prompt_len, data_args.overlong_policy, data_args.use_chat_template
    )
    if process_reward:
        placeholder_id = placeholder_token_id(tokenizer, model_args.placeholder_token, "placeholder_token")
        encode = functools.partial(
            encode_prm,
            tokenizer=tokenizer,
            cfg=cfg,
            placeholder_id=placeholder_id,
            placeholder=model_args.placeholder_token,
            reward_tokens=tokens,
        )
    else:
        encode = functools.partial(encode_pair_for_scores, tokenizer=tokenizer, cfg=cfg)
    kind = "prm" if process_reward else "pair"
    return load_packed(
        path,
        kind,
        encode,
        data_args,
        batch_size,
        seed,
        probs,
        lazy,
        reward_tokens=tokens,
        placeholder=model_args.placeholder_token,
    )


def fit_embeddings(model, tokenizer: PreTrainedTokenizerBase, training_args: RewardTrainingArguments) -> None:
    """After ``add_placeholder_token``: give the new token id an embedding row (resize when the model has none)."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) <= rows:  # e.g. Qwen2: 151,936 rows for 151,646 tokens
        logger.info("the added token takes a spare row of the model's %d embedding rows: no resize", rows)
        return
    if training_args.layout.native:
        raise UserError(
            f"add_placeholder_token: the tokenizer now has {len(tokenizer)} tokens and the model {rows} embedding "
            "rows, and a model sharded across processes (FSDP2 / tensor parallel) cannot be resized: resize it "
            "once in one process (a run without sharding), then train from the saved checkpoint"
        )
    model.resize_token_embeddings(len(tokenizer))
    logger.info("model embeddings resized from %d to %d rows for the added placeholder token", rows, len(tokenizer))


def build_reward_model(
    model_args: RewardModelArgument, training_args: RewardTrainingArguments, tokenizer: PreTrainedTokenizerBase
):
    dtype = weights_dtype(training_args)
    if training_args.process_reward:
        model = load_model(
            AutoModelForCausalLM,
            model_args.model_name_or_path,
            init_from_config=model_args.init_from_config,
            seed=training_args.seed,
            dtype=dtype,
            pad_token_id=tokenizer.pad_token_id,
            layout=training_args.layout,
            recompute=recompute_mode(model_args, training_args),
            quantization_config=quantization_config(model_args, training_args),
        )
        tokens = reward_tokens(model_args)
        ids = (
            single_token_id(tokenizer, tokens[0], "reward_tokens"),
            single_token_id(tokenizer, tokens[1], "reward_tokens"),
        )
        vocab = model.get_output_embeddings().weight.shape[0]
        if max(ids) >= vocab:
            raise UserError(
                f"reward_tokens ids {ids} are outside the model's vocabulary ({vocab}): tokenizer and model differ"
            )
        return model, ids
    model = load_model(
        AutoModelForSequenceClassification,
        model_args.model_name_or_path,
        init_from_config=model_args.init_from_config,
        seed=training_args.seed,
        dtype=dtype,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
        layout=training_args.layout,
        recompute=recompute_mode(model_args, training_args),
        quantization_config=quantization_config(model_args, training_args),
    )
    if not hasattr(model, "score"):
        raise UserError(
            f"{type(model).__name__} has no `score` head: use a decoder with a sequence-classification class"
        )
    return model, None


def check_evaluation_settings(training_args: RewardTrainingArguments) -> None:
    unknown = [a for a in training_args.bon_aggregations.split(",") if a.strip() not in AGGREGATIONS]
    if unknown or not training_args.bon_aggregations.strip():
        raise UserError(
            f"bon_aggregations: {', '.join(map(repr, unknown)) or 'empty'}; each must be one of {', '.join(AGGREGATIONS)}"
        )


def build_reward_trainer(
    model_args: RewardModelArgument, data_args: DataArgument, training_args: RewardTrainingArguments
):
    check_evaluation_settings(training_args)
    check_lora_arguments(model_args, training_args)
    tokenizer = load_tokenizer(model_args.tokenizer_name_or_path or model_args.model_name_or_path)
    added = training_args.process_reward and model_args.add_placeholder_token
    added = added and add_placeholder_token(tokenizer, model_args.placeholder_token)
    if added and model_args.lora:
        raise UserError(
            f"add_placeholder_token with lora: the new token {model_args.placeholder_token!r} would get an untrained, "
            "frozen embedding row. Add it and train once without lora, or pick a placeholder_token the tokenizer has"
        )
    model, token_ids = build_reward_model(model_args, training_args, tokenizer)
    if added:
        fit_embeddings(model, tokenizer, training_args)
    if model_args.lora:
        # ORM: the new score head is trained (modules_to_save); PRM with lora_train_head: the reward-token head rows
        task = "causal_lm" if training_args.process_reward else "seq_cls"
        model = apply_lora(model, model_args, task, list(token_ids) if training_args.process_reward else None)
    data = functools.partial(
        build_reward_data,
        tokenizer=tokenizer,
        model_args=model_args,
        data_args=data_args,
        process_reward=training_args.process_reward,
        seed=training_args.seed,
    )
    train, dev = train_and_dev(data_args, training_args, data)
    mode = "PRM" if training_args.process_reward else "ORM"
    logger.info(
        "%s %s: %.2fM parameters; %s",
        mode,
        type(model).__name__,
        count_parameters(model) / 1e6,
        plan_summary(train, data_args),
    )
    trainer = RewardTrainer(
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
        process_reward=training_args.process_reward,
        reward_token_ids=token_ids,
        reward_tokens=reward_tokens(model_args),
        margin=training_args.margin,
        center_rewards_coefficient=training_args.center_rewards_coefficient,
        score_regularization=training_args.score_regularization,
        callbacks=[SaveOnSignal()],
    )
    trainer.eval_records = dev.records if dev else []  # ProcessBench / best-of-N fields of each dev record
    trainer.lora_merge = model_args.lora_merge  # AlignmentTrainer.save_model writes output_dir/merged too
    return trainer, train, dev
