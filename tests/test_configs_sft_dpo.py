"""Every sft/dpo argument file in the tree parses strictly (unknown keys are errors) with its entry point's
dataclasses; the real-model ones train in bf16 with flash attention, the tiny ones point at bundled files, the
smollm2 ones (the real model on a CPU) train in fp32 on bundled data from the converted model directory."""

import glob
import os

import pytest

from llm.settings.dpo import DPO_ARGUMENT_TYPES
from llm.settings.flat import ARGUMENT_TYPES
from llm.settings.load import parse_arguments
from llm.utils.errors import UserError
from llm.utils.gguf import smollm2_dir
from tests.helpers import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "llm", "config", "*", "*_argument.json")))
SFT = [f for f in CONFIGS if os.path.basename(f) == "sft_argument.json"]
DPO = [f for f in CONFIGS if os.path.basename(f) == "dpo_argument.json"]


def test_found_every_model_folder():
    assert len(SFT) >= 4 and len(DPO) >= 4, (SFT, DPO)
    folders = {os.path.basename(os.path.dirname(f)) for f in SFT + DPO}
    assert {"llama", "mistral", "qwen2", "tiny"} <= folders


@pytest.mark.parametrize("path", SFT + DPO, ids=lambda p: os.path.relpath(p, ROOT))
def test_config_parses_strictly(path):
    types = DPO_ARGUMENT_TYPES if path in DPO else ARGUMENT_TYPES
    model_args, data_args, training_args = parse_arguments([path], types)
    assert model_args.model_name_or_path and training_args.output_dir and data_args.train_dataset_path
    folder = os.path.basename(os.path.dirname(path))
    if folder == "tiny":
        assert model_args.init_from_config and not training_args.bf16
        for p in (model_args.model_name_or_path, model_args.tokenizer_name_or_path, data_args.train_dataset_path):
            assert os.path.exists(os.path.join(ROOT, p)), p
    elif folder == "smollm2":
        assert not model_args.init_from_config and not training_args.bf16 and not model_args.use_flash_attention
        assert model_args.model_name_or_path == os.path.relpath(smollm2_dir(), ROOT)
        assert data_args.use_chat_template and os.path.exists(os.path.join(ROOT, data_args.train_dataset_path))
    else:
        assert training_args.bf16 and model_args.use_flash_attention and data_args.use_chat_template
    if path in DPO:
        assert training_args.loss_type == "sigmoid" and training_args.beta > 0


def test_dpo_fields_are_unknown_to_the_sft_parser(tmp_path):
    """The DPO fields are declared on run_dpo's dataclasses only: an SFT config that sets one is refused."""
    with open(DPO[0], encoding="utf-8") as f:
        text = f.read()
    path = tmp_path / "sft_with_beta.json"
    path.write_text(text)
    with pytest.raises(UserError, match="unknown key"):
        parse_arguments([str(path)], ARGUMENT_TYPES)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--loss_type", "kto"], "loss_type must be one of"),
        (["--loss_type", "ipo", "--label_smoothing", "0.1"], "label_smoothing has no effect"),
        (["--loss_type", "orpo", "--sft_loss_weight", "1"], "orpo already includes its NLL"),
        (["--loss_type", "simpo", "--precompute_ref_log_probs", "true"], "uses no reference model"),
        (["--reference_free", "true", "--precompute_ref_log_probs", "true"], "with reference_free uses no reference"),
        (["--beta", "0"], "beta must be > 0"),
    ],
)
def test_dpo_field_checks_name_the_field(overrides, needle):
    tiny = next(f for f in DPO if os.path.basename(os.path.dirname(f)) == "tiny")
    with pytest.raises(UserError, match=needle):
        parse_arguments([tiny, *overrides], DPO_ARGUMENT_TYPES)
