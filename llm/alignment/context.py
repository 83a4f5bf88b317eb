"""What a flat-script run (SFT, reward model, DPO) derives once from its validated arguments, and passes down.

``RunContext.load`` is called once, by the run script before the build (``run_finetune.py``): it loads the tokenizer
and resolves ``use_chat_template`` from it; the encoders' settings and the run fingerprint are derived from those on
first use, once. The builder (``recipe.build_trainer``), the trainer (its checkpoints' fingerprint), the resume
and the comparison of a torchrun's processes (``runner``) all read this record; the argument objects stay as
``validate_arguments`` left them: nothing derived is written back into them. PPO's counterpart:
``llm.alignment.ppo.context``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llm.data.encoding import EncodeConfig, resolve_chat_template
from llm.settings.fingerprint import Fingerprint, run_fingerprint
from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments
from llm.utils.modeling import load_tokenizer


@dataclass(frozen=True)
class RunContext:
    model_args: ModelArgument
    data_args: DataArgument
    training_args: TrainingArguments
    tokenizer: PreTrainedTokenizerBase  # loaded once (a PRM's recipe may add its placeholder token to it)
    use_chat_template: bool  # data_args.use_chat_template as the run uses it (unset: the tokenizer decides)

    @classmethod
    def load(cls, model_args: ModelArgument, data_args: DataArgument, training_args: TrainingArguments) -> RunContext:
        """The run's tokenizer and what it decides (the choice is logged)."""
        tokenizer = load_tokenizer(model_args.tokenizer_name_or_path or model_args.model_name_or_path)
        use_chat_template = resolve_chat_template(data_args.use_chat_template, tokenizer)
        return cls(model_args, data_args, training_args, tokenizer, use_chat_template)

    @functools.cached_property
    def encoding(self) -> EncodeConfig:
        """The encoders' settings."""
        d = self.data_args
        return EncodeConfig(d.max_seq_len, d.max_prompt_len, d.overlong_policy, self.use_chat_template)

    @functools.cached_property
    def fingerprint(self) -> Fingerprint:
        """``llm.settings.fingerprint.run_fingerprint`` of the run, computed (the data files hashed) at its first
        use, once: a checkpoint, a resume, the comparison of a torchrun's processes."""
        m, d, t = self.model_args, self.data_args, self.training_args
        return run_fingerprint(m, d, t, use_chat_template=self.use_chat_template)
