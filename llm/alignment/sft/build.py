"""Build everything ``run_finetune.py`` needs from parsed arguments: the SFT recipe (``llm.alignment.recipe``)."""

from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

from llm.alignment.context import RunContext
from llm.alignment.recipe import Recipe, build_trainer
from llm.alignment.sft.trainer import SFTTrainer
from llm.data.encode_lm import encode_sft
from llm.data.encoding import EncodeConfig
from llm.data.prepare import PackedData, load_packed
from llm.settings.flat import DataArgument


def build_sft_data(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    data_args: DataArgument,
    cfg: EncodeConfig,
    batch_size: int,
    seed: int,
    probs: str | None = None,
    lazy: bool = False,
    max_records: int | None = None,
) -> PackedData:
    encode = functools.partial(encode_sft, tokenizer=tokenizer, cfg=cfg)
    return load_packed(path, "sft", encode, data_args, batch_size, seed, probs, lazy, max_records)


class SFTRecipe(Recipe):
    """A causal LM on conversations, cross-entropy on the response tokens."""

    task = "SFT"
    trainer_class = SFTTrainer

    def read_split(self, path, split, batch_size, probs=None, lazy=False, max_records=None) -> PackedData:
        run = self.run
        seed = self.training_args.seed
        return build_sft_data(
            path, run.tokenizer, self.data_args, run.encoding, batch_size, seed, probs, lazy, max_records
        )


def build_sft_trainer(run: RunContext) -> tuple[SFTTrainer, PackedData | None, PackedData | None]:
    """``run``: ``RunContext.load(model_args, data_args, training_args)``."""
    return build_trainer(SFTRecipe(run))
