"""Build everything ``run_reward.py`` needs from parsed arguments: the ORM or PRM recipe (``llm.alignment.recipe``),
picked by ``process_reward``, and the reward model itself (``build_reward_model``, also what ``serve.py`` loads)."""

from __future__ import annotations

import logging

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerBase

from llm.alignment.context import RunContext
from llm.alignment.dpo.build import load_reference
from llm.alignment.lm import weights_dtype
from llm.alignment.recipe import Recipe, build_trainer
from llm.alignment.rm.data import build_implicit_data, build_reward_data
from llm.alignment.rm.evaluation import AGGREGATIONS
from llm.alignment.rm.genprm_trainer import GenPRMTrainer
from llm.alignment.rm.implicit import read_implicit_prm
from llm.alignment.rm.implicit_trainer import ImplicitPRMTrainer
from llm.alignment.rm.orm_trainer import ORMTrainer
from llm.alignment.rm.prm_trainer import PRMTrainer
from llm.alignment.rm.trainer import RewardTrainer
from llm.data.encoding import add_placeholder_token, single_token_id
from llm.data.prepare import PackedData
from llm.data.readers import PRMRecord
from llm.settings.flat import recompute_mode
from llm.settings.reward import RewardModelArgument, RewardTrainingArguments
from llm.utils.errors import UserError
from llm.utils.lora import quantization_config
from llm.utils.modeling import load_model

logger = logging.getLogger(__name__)


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
    """The reward model and, for a PRM, its reward tokens' ids ``(positive, negative)`` (None for an ORM): a causal
    LM (PRM) or a sequence classifier with one label (ORM)."""
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
        tokens = model_args.label_tokens
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


def check_orm_training_records(train: PackedData | None) -> None:
    """An ORM trains on pairs only: a best-of-N candidate in its training data (read as ``orm_eval`` records)
    stops the run."""
    found = next((r for r in train.records if isinstance(r, PRMRecord)), None) if train is not None else None
    if found is not None:
        raise UserError(
            f"{found.source}: record {found.index}: is a best-of-N candidate (a solution with answer/correct) in "
            "the training data of an ORM, which trains on preference pairs only. Fix: train on pairs "
            "(train_dataset_path) and give the candidates as dev_dataset_path only"
        )


def check_soft_labels(train: PackedData | None, training_args: RewardTrainingArguments, data_args) -> None:
    """``soft_labels`` on training records that hold none would train on the hard labels without a word: stop."""
    if not training_args.soft_labels or train is None or not train.records:  # streamed: nothing to look at first
        return
    if all(getattr(r, "soft_labels", None) is None for r in train.records):
        raise UserError(
            f"soft_labels is true but no record of train_dataset_path {data_args.train_dataset_path} has "
            "'soft_labels': train on labels written by llm/run_label.py, or set soft_labels false"
        )


class RewardRecipe(Recipe):
    """What ORM and PRM share: the reward model's loader, reader and evaluation checks; the dev records go to the
    trainer (ProcessBench / best-of-N fields)."""

    trainer_class: type[RewardTrainer] = RewardTrainer

    def check(self) -> None:
        check_evaluation_settings(self.training_args)
        super().check()

    def load_model(self, tokenizer):
        model, self.reward_token_ids = build_reward_model(self.model_args, self.training_args, tokenizer)
        return model

    def read_split(self, path, split, batch_size, probs=None, lazy=False, max_records=None) -> PackedData:
        t, run = self.training_args, self.run
        return build_reward_data(
            path,
            split,
            run.tokenizer,
            self.model_args,
            self.data_args,
            run.encoding,
            t.process_reward,
            batch_size,
            t.seed,
            probs,
            lazy,
            max_records,
        )

    def data_objects(self, train, dev) -> dict:
        return {"eval_records": dev.records if dev else []}  # ProcessBench / best-of-N fields of each dev record


class ORMRecipe(RewardRecipe):
    """A sequence classifier's score head on preference pairs; the head is trained under LoRA (modules_to_save)."""

    task = "ORM"
    trainer_class = ORMTrainer
    lora_task = "seq_cls"

    def data_objects(self, train, dev) -> dict:
        check_orm_training_records(train)
        return super().data_objects(train, dev)


class PRMRecipe(RewardRecipe):
    """A causal LM's reward-token logits at step placeholders; the placeholder may be added to the tokenizer."""

    task = "PRM"
    trainer_class = PRMTrainer

    def prepare_tokenizer(self, tokenizer) -> None:
        m = self.model_args
        self.added = m.add_placeholder_token and add_placeholder_token(tokenizer, m.placeholder_token)
        if self.added and m.lora:
            raise UserError(
                f"add_placeholder_token with lora: the new token {m.placeholder_token!r} would get an untrained, "
                "frozen embedding row. Add it and train once without lora, or pick a placeholder_token the tokenizer "
                "has"
            )

    def load_model(self, tokenizer):
        model = super().load_model(tokenizer)
        if self.added:
            fit_embeddings(model, tokenizer, self.training_args)
        return model

    def lora_head_rows(self) -> list[int]:
        return list(self.reward_token_ids)  # trained with lora_train_head

    def model_objects(self, model, tokenizer) -> dict:
        return {"reward_token_ids": self.reward_token_ids}

    def data_objects(self, train, dev) -> dict:
        check_soft_labels(train, self.training_args, self.data_args)
        return super().data_objects(train, dev)


class GenPRMRecipe(PRMRecipe):
    """A causal LM trained to write a critique and a verdict after every step (``prm_kind: generative``)."""

    task = "generative PRM"
    trainer_class = GenPRMTrainer

    def read_split(self, path, split, batch_size, probs=None, lazy=False, max_records=None) -> PackedData:
        t, run = self.training_args, self.run
        return build_reward_data(
            path,
            split,
            run.tokenizer,
            self.model_args,
            self.data_args,
            run.encoding,
            True,
            batch_size,
            t.seed,
            probs,
            lazy,
            max_records,
            prm_kind="generative",
        )

    def model_objects(self, model, tokenizer) -> dict:
        return {"reward_token_ids": self.reward_token_ids, "reward_tokens": self.model_args.label_tokens}


class ImplicitPRMRecipe(RewardRecipe):
    """A causal LM whose log-ratio to a frozen reference is the reward (``implicit_trainer.py``): DPO's reference
    machinery (``dpo.build.load_reference``: ``implicit_reference``, else a copy of the initial model)."""

    trainer_class = ImplicitPRMTrainer

    @property
    def task(self) -> str:
        return f"implicit PRM ({self.training_args.implicit_loss})"

    def check(self) -> None:
        if self.model_args.lora:
            raise UserError(
                "prm_kind implicit with lora: not supported yet (the reference would be the adapter-free base); "
                "set lora false"
            )
        super().check()

    def load_model(self, tokenizer):
        return Recipe.load_model(self, tokenizer)  # the causal LM itself, no reward tokens

    def reference_path(self) -> str | None:
        """The reference model's directory: ``implicit_reference``; in an evaluation-only run the one the evaluated
        model's ``implicit_prm.json`` names; None: a copy of the initial model."""
        m, t = self.model_args, self.training_args
        if m.implicit_reference or t.do_train:
            return m.implicit_reference
        return read_implicit_prm(m.model_name_or_path, "model_name_or_path")[1]

    def model_objects(self, model, tokenizer) -> dict:
        path = self.reference_path()
        reference = load_reference(path, self.training_args, tokenizer, model)
        return {"ref_model": reference, "reference_path": path if self.model_args.implicit_reference else None}

    def read_split(self, path, split, batch_size, probs=None, lazy=False, max_records=None) -> PackedData:
        t, run = self.training_args, self.run
        pairs = t.implicit_loss == "dpo"
        return build_implicit_data(
            path, split, run.tokenizer, self.model_args, self.data_args, run.encoding, pairs, batch_size, t.seed,
            probs, lazy, max_records,
        )  # fmt: skip


def build_reward_trainer(run: RunContext) -> tuple[RewardTrainer, PackedData | None, PackedData | None]:
    """``run``: ``RunContext.load(model_args, data_args, training_args)`` of the reward argument types."""
    t = run.training_args
    if run.model_args.implicit_reference and t.prm_kind != "implicit":
        raise UserError("implicit_reference is prm_kind implicit's: set prm_kind implicit, or remove it")
    prm = {"generative": GenPRMRecipe, "implicit": ImplicitPRMRecipe}.get(t.prm_kind, PRMRecipe)
    recipe = prm if t.process_reward else ORMRecipe
    return build_trainer(recipe(run))
