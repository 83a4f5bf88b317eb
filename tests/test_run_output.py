"""What a run prints is true: no "Training completed" line from transformers after a stop, the results once at the
end (the process of rank 0), no progress bars into a log file, no DDP search for unused parameters (and its
warning) that our losses never need."""

from __future__ import annotations

import logging
import types

from llm.alignment.runner import summary_line, train_and_evaluate
from llm.settings.flat import DataArgument, TrainingArguments
from llm.utils.logging import configure_logging


def test_transformers_training_completed_line_is_dropped(capsys):
    configure_logging(logging.INFO)
    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.info("\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n")
    trainer_logger.info("a line that stays")
    err = capsys.readouterr().err
    assert "Training completed" not in err and "a line that stays" in err


def test_progress_bars_off_without_a_terminal_and_no_ddp_unused_search(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")  # pytest's stderr is not a terminal
    assert args.disable_tqdm is True and args.ddp_find_unused_parameters is False
    chosen = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", disable_tqdm=False, ddp_find_unused_parameters=True
    )
    assert chosen.disable_tqdm is False and chosen.ddp_find_unused_parameters is True


def test_summary_line_by_hand():
    line = summary_line({"eval_loss": 0.123456, "epoch": 2, "train_runtime": 9.5, "eval_samples_per_second": 3.0})
    assert line == "epoch 2, eval_loss 0.1235"


def test_results_are_printed_once_at_the_end(tmp_path, caplog):
    """An evaluation-only run: the metrics go to eval_results.json / all_results.json and one log line."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", do_train=False, do_eval=True)
    trainer = types.SimpleNamespace(
        evaluate_with_outputs=lambda: ({"eval_loss": 0.5, "eval_accuracy": 0.75}, []),
        is_world_process_zero=lambda: True,
    )
    with caplog.at_level(logging.INFO, logger="llm.alignment.runner"):
        train_and_evaluate(trainer, DataArgument(), args)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("results (")]
    assert lines == [f"results ({tmp_path}/all_results.json): eval_accuracy 0.75, eval_loss 0.5"]
    not_main = types.SimpleNamespace(**{**vars(trainer), "is_world_process_zero": lambda: False})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llm.alignment.runner"):
        train_and_evaluate(not_main, DataArgument(), args)
    assert not [r for r in caplog.records if r.getMessage().startswith("results (")]


def test_no_initialised_randomly_line_before_a_resume(caplog):
    """A config-built model of a resumed run takes its checkpoint's weights at once: the log says that, not
    "initialised randomly"; a fresh run still says how its random weights were made."""
    from transformers import AutoModelForCausalLM

    from llm.utils.modeling import RESUMING, load_model
    from tests.helpers import ROOT

    tiny_llama = f"{ROOT}/llm/assets/tiny-llama"

    with caplog.at_level(logging.INFO, logger="llm.utils.modeling"):
        load_model(AutoModelForCausalLM, tiny_llama, init_from_config=True, seed=1)
        token = RESUMING.set(True)
        try:
            load_model(AutoModelForCausalLM, tiny_llama, init_from_config=True, seed=1)
        finally:
            RESUMING.reset(token)
    lines = [r.getMessage() for r in caplog.records if r.name == "llm.utils.modeling"]
    assert "randomly" in lines[0] and "(seed 1)" in lines[0]
    assert "randomly" not in lines[1] and "checkpoint resumed" in lines[1]


def test_the_recipe_marks_a_resuming_build(tmp_path, monkeypatch):
    from llm.alignment import recipe as recipe_module
    from llm.alignment.context import RunContext
    from llm.alignment.sft.build import build_sft_trainer
    from llm.settings.load import parse_arguments
    from tests.helpers import ROOT

    seen = []

    def stop(self, tokenizer):
        seen.append(recipe_module.RESUMING.get())
        raise RuntimeError("stop after the model step")

    monkeypatch.setattr(recipe_module.Recipe, "load_model", stop)
    monkeypatch.chdir(ROOT)
    for resume in ("false", "auto"):
        args = parse_arguments(
            ["llm/config/tiny/sft_argument.json", "--output_dir", str(tmp_path), "--resume_from_checkpoint", resume]
        )
        try:
            build_sft_trainer(RunContext.load(*args))
        except RuntimeError:
            pass
    assert seen == [False, True]


def test_data_summary_and_step_pad_ratio_say_what_they_measure():
    """The data summary's figure is the rows' fill of max_seq_len (packing quality); the steps' pad_ratio is the
    padding actually computed (rows padded to each batch's longest). The summary names both, so a 1.2% there
    and a 0 at every step (one row per batch) no longer read as a contradiction."""
    from llm.data.packing import PackStats

    text = PackStats(examples=10, rows=2, real_tokens=90, capacity=100).summary("greedy", 50)
    assert "90 real tokens fill 90.0% of rows x max_seq_len" in text and "pad_ratio is the padding computed" in text


def test_whole_run_results_after_a_resume():
    from llm.alignment.runner import whole_run_results

    history = [
        {"loss": 4.0, "step": 1},
        {"loss": 2.0, "step": 2},
        {"eval_loss": 9.0, "step": 2},
        {"loss": 0.0, "step": 3},
    ]
    assert whole_run_results(history, "out/checkpoint-2") == {"train_resumed_from": 2, "train_loss_whole_run": 2.0}
    assert whole_run_results([], "out/checkpoint-10/") == {"train_resumed_from": 10}
