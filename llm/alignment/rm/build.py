"""Build everything ``run_reward.py`` needs from parsed arguments: tokenizer, packed data, model, trainer."""

from __future__ import annotations

import functools
import logging

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerBase

from llm.alignment.lm import weights_dtype
from llm.settings.reward import RewardModelArgument, RewardTrainingArguments
from llm.alignment.rm.evaluation import AGGREGATIONS
from llm.alignment.rm.trainer import CANDIDATE, RewardTrainer
from llm.data.packing import Example, causal_example, collate
from llm.data.pipeline import PackedData, load_packed, plan_summary, train_and_dev
from llm.data.readers import PRMRecord
from llm.data.tokenize import (
    EncodeConfig,
    OverlongCounter,
    fit_prompt,
    add_placeholder_token,
    encode_pair_for_scores,
    encode_prm,
    placeholder_token_id,
    render_prompt,
    resolve_chat_template,
    single_token_id,
    start_ids,
)
from llm.settings.flat import DataArgument, recompute_mode
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


ORM_STEP_JOIN = "\n"  # an ORM candidate's steps joined as the bundled pairs join a solution's steps


def orm_candidate_text(steps: list[str]) -> str:
    """The answer text an ORM scores for a best-of-N candidate: its steps joined with a newline."""
    return ORM_STEP_JOIN.join(steps)


def encode_orm_candidate(
    record: PRMRecord,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EncodeConfig,
    record_index: int,
    counter: OverlongCounter,
) -> Example | None:
    """A best-of-N candidate for an ORM: ``[prompt | ids(orm_candidate_text(steps)) + eos]`` with one readout
    (part ``CANDIDATE``) at its last token. Exactly the chosen side of a pair (``encode_pair_for_scores``)
    whose chosen answer is that text, so the candidate's score is the score the ORM gives that answer in a
    pair; a record without a separate prompt (Math-Shepherd layouts: the question starts the first step)
    is ``[BOS] + ids(text) + eos``. Too long: the answer's end is cut (``truncate``) or the record skipped."""
    if record.prompt:
        full_prompt = render_prompt(record.prompt, tokenizer, cfg.use_chat_template)
    else:
        full_prompt = start_ids(tokenizer)
    prompt = fit_prompt(full_prompt, cfg)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    answer = tokenizer(orm_candidate_text(record.steps), add_special_tokens=False)["input_ids"] + eos
    if prompt is None:
        counter["skipped"] += 1
        return None
    room = cfg.max_seq_len - len(prompt)
    status = "ok" if len(prompt) == len(full_prompt) else "truncated"
    if len(answer) > room:
        if cfg.overlong_policy == "skip" or room < 1:
            counter["skipped"] += 1
            return None
        answer, status = answer[:room], "truncated"
    counter[status] += 1
    ids = prompt + answer
    return causal_example(ids, [len(ids) - 1], [0], [CANDIDATE], record=record_index)


def encode_orm_eval(record, tokenizer: PreTrainedTokenizerBase, cfg: EncodeConfig, record_index: int, counter):
    """An ORM dev record: a pair (two readouts, parts 0 and 1) or a best-of-N candidate (one, ``CANDIDATE``)."""
    encode = encode_orm_candidate if isinstance(record, PRMRecord) else encode_pair_for_scores
    return encode(record, tokenizer=tokenizer, cfg=cfg, record_index=record_index, counter=counter)


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
    dev_path: str | None = None,
    max_records: int | None = None,
) -> PackedData:
    """Read, validate, tokenise and pack one split (``lazy``: a stream packed on the fly; ``max_records``: the
    first ones only). An ORM reads its dev split (``path == dev_path``) as ``orm_eval`` records: pairs and
    best-of-N candidates."""
    tokens = reward_tokens(model_args)
    cfg = EncodeConfig(
        data_args.max_seq_len, data_args.max_prompt_len, data_args.overlong_policy, bool(data_args.use_chat_template)
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
        kind = "prm"
    elif path == dev_path and not lazy:
        encode, kind = functools.partial(encode_orm_eval, tokenizer=tokenizer, cfg=cfg), "orm_eval"
    else:
        encode, kind = functools.partial(encode_pair_for_scores, tokenizer=tokenizer, cfg=cfg), "pair"
    return load_packed(
        path,
        kind,
        encode,
        data_args,
        batch_size,
        seed,
        probs,
        lazy,
        max_records,
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


def check_orm_training_records(train: PackedData | None, training_args: RewardTrainingArguments) -> None:
    """An ORM trains on pairs only: a best-of-N candidate in its training data (read as ``orm_eval`` when the
    training and dev paths are the same) stops the run."""
    if train is None or training_args.process_reward:
        return
    found = next((r for r in train.records if isinstance(r, PRMRecord)), None)
    if found is not None:
        raise UserError(
            f"{found.source}: record {found.index}: is a best-of-N candidate (a solution with answer/correct) in "
            "the training data of an ORM, which trains on preference pairs only. Fix: train on pairs "
            "(train_dataset_path) and give the candidates as dev_dataset_path only"
        )


def build_reward_trainer(
    model_args: RewardModelArgument, data_args: DataArgument, training_args: RewardTrainingArguments
):
    check_evaluation_settings(training_args)
    check_lora_arguments(model_args, training_args)
    tokenizer = load_tokenizer(model_args.tokenizer_name_or_path or model_args.model_name_or_path)
    # the effective choice, for the encoders and the run fingerprint (which reads data_args)
    data_args.use_chat_template = resolve_chat_template(data_args.use_chat_template, tokenizer)
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
        dev_path=data_args.dev_dataset_path,
    )
    train, dev = train_and_dev(data_args, training_args, data)
    check_orm_training_records(train, training_args)
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
