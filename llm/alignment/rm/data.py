"""A reward model's data: each split read, tokenised and packed (``build_reward_data``).

PRM splits are solutions with a placeholder after every step (``encode_prm``); ORM training splits are preference
pairs (``encode_pair_for_scores``), and an ORM's dev split may also hold best-of-N candidates
(``encode_orm_candidate``: one readout each, part ``CANDIDATE``).
"""

from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

from llm.data.encode_genprm import encode_genprm
from llm.data.encode_implicit import encode_implicit_pair, encode_implicit_solution
from llm.data.encode_reward import encode_pair_for_scores, encode_prm
from llm.data.encoding import (
    EncodeConfig,
    OverlongCounter,
    fit_prompt,
    placeholder_token_id,
    render_prompt,
    single_token_id,
    start_ids,
)
from llm.data.packing import Example, causal_example
from llm.data.prepare import PackedData, Split, load_packed
from llm.data.readers import PRMRecord
from llm.settings.flat import DataArgument
from llm.settings.reward import RewardModelArgument

CANDIDATE = 2  # readout_part of an ORM best-of-N candidate's one readout (a pair's: 0 chosen, 1 rejected)
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
    split: Split,
    tokenizer: PreTrainedTokenizerBase,
    model_args: RewardModelArgument,
    data_args: DataArgument,
    cfg: EncodeConfig,
    process_reward: bool,
    batch_size: int,
    seed: int,
    probs: str | None = None,
    lazy: bool = False,
    max_records: int | None = None,
    prm_kind: str = "discriminative",
) -> PackedData:
    """Read, validate, tokenise and pack one split (``split``: "train" or "eval"; ``lazy``: a stream packed on the
    fly; ``max_records``: the first ones only). An ORM reads its splits as ``orm_eval`` records (pairs and best-of-N
    candidates): the dev split may hold both, and in the training split (in memory) a candidate is then refused by
    name (``check_orm_training_records``: an ORM trains on pairs) rather than as a malformed pair; a streamed
    training split is read as pairs. A generative PRM (``prm_kind``) reads PRM records with their critiques
    (``encode_genprm``)."""
    tokens = model_args.label_tokens
    if process_reward and prm_kind == "generative":  # critiques and verdicts (llm.data.encode_genprm)
        ids = tuple(single_token_id(tokenizer, t, "reward_tokens") for t in tokens)
        encode = functools.partial(
            encode_genprm,
            tokenizer=tokenizer,
            cfg=cfg,
            reward_ids=ids,
            reward_tokens=tokens,
            require_critiques=split == "train",
        )
        kind = "prm"
    elif process_reward:
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
    elif split == "eval" or not lazy:
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


def build_implicit_data(
    path: str,
    split: Split,
    tokenizer: PreTrainedTokenizerBase,
    model_args: RewardModelArgument,
    data_args: DataArgument,
    cfg: EncodeConfig,
    pairs: bool,
    batch_size: int,
    seed: int,
    probs: str | None = None,
    lazy: bool = False,
    max_records: int | None = None,
) -> PackedData:
    """One split of an implicit PRM (``llm.data.encode_implicit``): PRM records, each solution with its outcome (the
    ``ce`` form's training split, and every dev split: ProcessBench, best-of-N, labelled solutions); with ``pairs``
    (the ``dpo`` form's training split) preference pairs of solutions, one step per line."""
    tokens = model_args.label_tokens
    if pairs and split == "train":
        encode = functools.partial(encode_implicit_pair, tokenizer=tokenizer, cfg=cfg)
        kind = "pair"
    else:
        encode = functools.partial(encode_implicit_solution, tokenizer=tokenizer, cfg=cfg, reward_tokens=tokens)
        kind = "prm"
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
