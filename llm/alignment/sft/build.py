"""Build everything ``run_finetune.py`` needs from parsed arguments: the SFT recipe (``llm.alignment.recipe``)."""

from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

from llm.alignment.recipe import Recipe, build_trainer
from llm.alignment.sft.trainer import SFTTrainer
from llm.data.encode_lm import encode_sft
from llm.data.encoding import EncodeConfig
from llm.data.prepare import PackedData, load_packed
from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments


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


class SFTRecipe(Recipe):
    """A causal LM on conversations, cross-entropy on the response tokens."""

    task = "SFT"
    trainer_class = SFTTrainer

    def read_split(self, path, tokenizer, batch_size, probs=None, lazy=False, max_records=None) -> PackedData:
        seed = self.training_args.seed
        return build_sft_data(path, tokenizer, self.data_args, batch_size, seed, probs, lazy, max_records)


def build_sft_trainer(
    model_args: ModelArgument, data_args: DataArgument, training_args: TrainingArguments
) -> tuple[SFTTrainer, PackedData | None, PackedData | None]:
    return build_trainer(SFTRecipe(model_args, data_args, training_args))
