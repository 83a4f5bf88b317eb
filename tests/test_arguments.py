"""JSON + command-line arguments: strict keys, Paddle names mapped, fields that cannot act refused."""

import functools
import glob
import json
import os

import pytest

from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments, validate_arguments
from llm.settings.load import parse_arguments
from llm.settings.reward import REWARD_ARGUMENT_TYPES, RewardModelArgument, RewardTrainingArguments
from llm.utils.distributed import parse_layout
from llm.utils.errors import UserError
from tests.helpers import ROOT

# Most configs here are reward configs: run_reward.py's parser (the shared fields plus the reward-only ones).
parse_reward = functools.partial(parse_arguments, types=REWARD_ARGUMENT_TYPES)


def write(tmp_path, **fields):
    fields.setdefault("output_dir", str(tmp_path / "out"))
    fields.setdefault("model_name_or_path", "llm/assets/tiny-llama")
    path = tmp_path / "args.json"
    path.write_text(json.dumps(fields))
    return str(path)


def parse(tmp_path, cli=(), **fields):
    return parse_reward([write(tmp_path, **fields), *cli])


def test_every_config_in_tree_parses_strictly():
    files = sorted(glob.glob(os.path.join(ROOT, "llm", "config", "*", "*_argument.json")))
    reward_files = [f for f in files if os.path.basename(f) in ("rm_argument.json", "prm_argument.json")]
    assert len(reward_files) >= 8, reward_files
    for path in reward_files:
        model_args, _data_args, training_args = parse_reward([path])
        assert model_args.model_name_or_path, path
        assert training_args.output_dir, path


def test_json_values_and_command_line_override(tmp_path):
    _model_args, data_args, training_args = parse(
        tmp_path,
        cli=["--learning_rate", "3e-4", "--zero_padding", "false", "--max_seq_len=512"],
        learning_rate=1e-5,
        zero_padding=True,
        max_seq_len=1024,
        max_prompt_len=256,
        process_reward=True,
    )
    assert training_args.learning_rate == 3e-4
    assert data_args.zero_padding is False and data_args.max_seq_len == 512
    assert training_args.process_reward is True


def test_unknown_key_names_file_and_closest(tmp_path):
    with pytest.raises(UserError) as err:
        parse(tmp_path, learnig_rate=1e-5)
    msg = str(err.value)
    assert "args.json" in msg and "'learnig_rate'" in msg and "'learning_rate'" in msg


def test_unknown_command_line_option(tmp_path):
    with pytest.raises(UserError, match="unknown option --max_seq_length.*'max_seq_len'"):
        parse(tmp_path, cli=["--max_seq_length", "10"])


def test_paddle_names_map_to_torch_mechanisms(tmp_path):
    _, _, t = parse(
        tmp_path,
        evaluation_strategy="steps",
        eval_steps=5,
        recompute=True,
        warmup_ratio=0.1,
        sharding="stage1",
        unified_checkpoint=True,
    )
    assert t.eval_strategy == "steps"
    assert t.activation_checkpointing is True
    assert t.warmup_steps == 0.1  # HF reads a float < 1 as a ratio
    _, _, t = parse(tmp_path, warmup_ratio=0.1, warmup_steps=7)
    assert t.warmup_steps == 7  # warmup_steps wins, as in PaddleNLP


def test_bad_json_is_one_clear_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"learning_rate": 1e-5,}')
    with pytest.raises(UserError, match=r"bad.json: not valid JSON .* line 1"):
        parse_reward([str(path)])


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"tensor_parallel_degree": 4},
            r"tensor_parallel_degree=4 must be >= 1 and divide the number of processes \(1\)",
        ),
        ({"virtual_pp_degree": 2}, "virtual_pp_degree"),
        ({"recompute_granularity": "attn"}, "recompute_granularity must be full, full_attn or core_attn"),
        ({"use_flash_attention": True}, "use_flash_attention needs a CUDA device"),
        ({"fp16_opt_level": "O2"}, "'O2' .* needs bf16 or fp16"),
        ({"sharding": "stage2", "sharding_parallel_degree": 4}, "sharding_parallel_degree=4 must divide"),
        ({"sharding_parallel_degree": 2}, "sharding_parallel_degree=2 needs sharding set"),
        ({"sharding": "offload"}, "'offload' needs a stage"),
        ({"sharding": "stage9"}, "sharding: unknown value"),
        ({"fp16_opt_level": "O3"}, "fp16_opt_level must be"),
        ({"overlong_policy": "drop"}, "overlong_policy must be"),
        ({"max_seq_len": 128, "max_prompt_len": 128}, "max_prompt_len .* must be smaller"),
    ],
)
def test_fields_that_cannot_take_effect_stop_the_run(tmp_path, fields, message):
    with pytest.raises(UserError, match=message):
        model_args, data_args, training_args = parse(tmp_path, **fields)
        validate_arguments(model_args, data_args, training_args)


@pytest.mark.parametrize("granularity, per_layer", [("full", True), ("full_attn", False), ("core_attn", False)])
def test_recompute_granularity(tmp_path, granularity, per_layer):
    from llm.settings.flat import recompute_mode

    model_args, data_args, training_args = parse(tmp_path, recompute=True, recompute_granularity=granularity)
    validate_arguments(model_args, data_args, training_args)
    # full: transformers checkpoints each decoder layer; finer ones are applied to the attention blocks at load
    assert training_args.activation_checkpointing is per_layer
    assert recompute_mode(model_args, training_args) == (None if per_layer else granularity)


def test_stage1_on_one_process_runs(tmp_path):
    # PaddleNLP's own example configs set stage1; with one process it is a group of one.
    model_args, data_args, training_args = parse(tmp_path, sharding="stage1")
    validate_arguments(model_args, data_args, training_args)


@pytest.mark.parametrize(
    "world, sharding, degree, tp, expected",
    [
        # (tp, shard, stage, offload, replicate, dp)
        (2, "", -1, 1, (1, 1, 0, False, 2, 2)),  # plain data parallel
        (2, "stage1", 1, 1, (1, 1, 0, False, 2, 2)),  # a sharding group of one: data parallel
        (2, "stage3 offload", -1, 1, (1, 2, 3, True, 1, 2)),
        (8, "stage1,stage2", 2, 2, (2, 2, 2, False, 2, 4)),  # HSDP: 2 replicas of 2-way FSDP, each rank TP 2
        (4, "stage3", -1, 2, (2, 2, 3, False, 1, 2)),  # the 2 x 2 mesh
        (2, "", -1, 2, (2, 1, 0, False, 1, 1)),
    ],
)
def test_parallel_layout(world, sharding, degree, tp, expected):
    layout = parse_layout(sharding, degree, tp, world)
    assert (layout.tp, layout.shard, layout.stage, layout.offload, layout.replicate, layout.dp) == expected
    assert layout.replicate * layout.shard * layout.tp == world


def test_benchmark_mode_turns_off_eval_and_saving(tmp_path):
    model_args, data_args, training_args = parse(tmp_path, benchmark=True, do_eval=True)
    validate_arguments(model_args, data_args, training_args)
    assert training_args.do_eval is False and training_args.save_strategy == "no"


def test_reference_fields_are_declared():
    declared = {f for t in (RewardModelArgument, DataArgument, RewardTrainingArguments) for f in t.__dataclass_fields__}
    reference = [
        "output_dir",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "per_device_eval_batch_size",
        "num_train_epochs",
        "max_steps",
        "learning_rate",
        "warmup_steps",
        "warmup_ratio",
        "logging_steps",
        "evaluation_strategy",
        "eval_strategy",
        "save_strategy",
        "eval_steps",
        "save_steps",
        "save_total_limit",
        "bf16",
        "fp16_opt_level",
        "do_train",
        "do_eval",
        "load_best_model_at_end",
        "tensor_parallel_degree",
        "sharding_parallel_degree",
        "sharding",
        "recompute",
        "unified_checkpoint",
        "process_reward",
        "seed",
        "disable_tqdm",
        "train_dataset_path",
        "dev_dataset_path",
        "max_seq_len",
        "max_prompt_len",
        "zero_padding",
        "greedy_zero_padding",
        "lazy",
        "benchmark",
        "autotuner_benchmark",
        "model_name_or_path",
        "tokenizer_name_or_path",
        "use_flash_attention",
        "flash_mask",
        "recompute_granularity",
        "virtual_pp_degree",
        "placeholder_token",
        "reward_tokens",
    ]
    assert not [f for f in reference if f not in declared]


# --- strict types: one message naming the file and field, never a setting turned the wrong way ----------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"do_train": "false"}, r"field 'do_train' must be true or false, got the string 'false' \(write false"),
        ({"do_train": "no"}, r"field 'do_train' must be true or false, got the string 'no'"),
        ({"max_steps": "2"}, r"field 'max_steps' must be a whole number, got the string '2' \(write 2 without"),
        ({"max_steps": 2.5}, r"field 'max_steps' must be a whole number, got 2.5"),
        ({"learning_rate": "abc"}, r"field 'learning_rate' must be a number, got the string 'abc'"),
        ({"learning_rate": "1e-5"}, r"got the string '1e-5' \(write 1e-05 without quotes\)"),
        ({"learning_rate": -1e-5}, r"field 'learning_rate' must be a number >= 0, got -1e-05"),
        ({"per_device_train_batch_size": -2}, r"field 'per_device_train_batch_size' must be a positive number"),
        ({"per_device_train_batch_size": 0}, r"field 'per_device_train_batch_size' must be a positive number"),
        ({"gradient_accumulation_steps": 0}, r"field 'gradient_accumulation_steps' must be a positive number"),
        ({"max_seq_len": True}, r"field 'max_seq_len' must be a whole number, got true"),
        ({"max_seq_len": None}, r"field 'max_seq_len' must be a whole number, got null"),
        ({"zero_padding": 1}, r"field 'zero_padding' must be true or false, got 1"),
        ({"placeholder_token": 5}, r"field 'placeholder_token' must be a string, got 5"),
        ({"map_keys": ["src"]}, r"field 'map_keys' must be an object"),
        ({"eval_strategy": "sometimes"}, r"field 'eval_strategy' must be one of 'no', 'steps', 'epoch'"),
        ({"tensor_parallel_degree": 0}, r"field 'tensor_parallel_degree' must be a positive number"),
        ({"warmup_ratio": -0.1}, r"field 'warmup_ratio' must be a number >= 0"),
    ],
)
def test_type_errors_name_the_file_and_field(tmp_path, fields, message):
    with pytest.raises(UserError, match=message) as err:
        parse(tmp_path, **fields)
    assert "args.json" in str(err.value)


@pytest.mark.parametrize(
    "cli, message",
    [
        (["--do_train", "yes"], r"--do_train must be true or false, got 'yes'"),
        (["--max_steps", "two"], r"--max_steps must be a whole number, got 'two'"),
        (["--max_steps", "2.5"], r"--max_steps must be a whole number"),
        (["--learning_rate", "fast"], r"--learning_rate must be a number, got 'fast'"),
        (["--max_seq_len"], r"--max_seq_len needs a value"),
        (["max_seq_len", "5"], r"expected --field value, got 'max_seq_len'"),
    ],
)
def test_command_line_values_are_parsed_strictly(tmp_path, cli, message):
    with pytest.raises(UserError, match=message):
        parse(tmp_path, cli=cli)


def test_command_line_booleans_numbers_and_bare_flags(tmp_path):
    _, data_args, t = parse(
        tmp_path,
        cli=["--do_train", "--do_eval", "False", "--max_steps", "3", "--lazy=true", "--map_keys", '{"src": "q"}'],
        do_train=False,
        do_eval=True,
        max_steps=100,
    )
    assert (t.do_train, t.do_eval, t.max_steps) == (True, False, 3)
    assert data_args.lazy is True and data_args.map_keys == {"src": "q"}


def test_max_prompt_len_default_follows_max_seq_len(tmp_path):
    # An eval-only run that sets only max_seq_len must not trip over a default it never set.
    _, data_args, _ = parse(tmp_path, max_seq_len=1024, do_train=False, do_eval=True)
    assert data_args.max_prompt_len == 512
    _, data_args, _ = parse(tmp_path)
    assert (data_args.max_seq_len, data_args.max_prompt_len) == (4096, 2048)  # PaddleNLP's defaults
    _, data_args, _ = parse(tmp_path, max_seq_len=1024, max_prompt_len=100)
    assert data_args.max_prompt_len == 100


# --- PaddleNLP's names -------------------------------------------------------------------------------------


def test_paddle_sft_names(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.json").write_text('{"src": "q", "tgt": "a"}\n')
    (data / "dev.json").write_text('{"src": "q", "tgt": "a"}\n')
    _, d, t = parse(
        tmp_path,
        dataset_name_or_path=str(data),
        src_length=100,
        max_length=300,
        eval_with_do_generation=False,
        pipeline_parallel_degree=1,
        pipeline_parallel_config="disable_p2p_cache_shape",
        tensor_parallel_output=True,
    )
    assert d.train_dataset_path == str(data / "train.json") and d.dev_dataset_path == str(data / "dev.json")
    assert (d.max_prompt_len, d.max_seq_len) == (100, 300)
    notes = " | ".join(t.config_notes)
    assert "pipeline_parallel_config" in notes and "tensor_parallel_output" in notes


def test_paddle_dataset_dir_with_only_train_json(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.json").write_text('{"src": "q", "tgt": "a"}\n')
    _, d, _ = parse(tmp_path, dataset_name_or_path=str(data))
    assert d.train_dataset_path == str(data / "train.json") and d.dev_dataset_path is None


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"dataset_name_or_path": "no/such/dir"},
            r"dataset_name_or_path: 'no/such/dir' is not a directory \(looked in",
        ),
        ({"eval_with_do_generation": True}, "evaluation by generation .* set it false"),
        ({"pipeline_parallel_degree": 2}, "pipeline parallelism is not available"),
        ({"max_length": 512, "max_seq_len": 512}, "max_length .* and max_seq_len both set max_seq_len"),
        ({"src_length": "64"}, r"src_length must be a whole number, got the string '64'"),
        ({"train_datasets": "PKU-SafeRLHF-30K/train"}, "registered hub data sets are not downloaded here"),
        ({"train_datasets": "pairs:0.5:llm/data/sample/pairs_train.jsonl"}, "proportion 0.5"),
    ],
)
def test_paddle_names_that_cannot_take_effect(tmp_path, fields, message):
    with pytest.raises(UserError, match=message):
        parse(tmp_path, **fields)


def test_reward_only_paddle_names(tmp_path):
    from llm.settings.dialects.paddle import PADDLE_REWARD_NAMES

    path = write(
        tmp_path,
        train_datasets="pairs:1:llm/data/sample/pairs_train.jsonl",
        eval_datasets="llm/data/sample/pairs_dev.jsonl",
        loss_type="sequence-wise",
        regularization=0.001,
        normalize_score_during_training=False,
        normalizer_type="ExponentialMovingAverage",
        normalizer_momentum=0.9,
    )
    _, d, t = parse_reward([path], paddle=PADDLE_REWARD_NAMES)
    assert d.train_dataset_path.endswith("llm/data/sample/pairs_train.jsonl")
    assert d.dev_dataset_path.endswith("llm/data/sample/pairs_dev.jsonl")
    assert t.score_regularization == 0.001
    for bad, message in (
        ({"loss_type": "token-wise"}, "only 'sequence-wise'"),
        ({"normalize_score_during_training": True}, "score normalisation .* not available"),
    ):
        with pytest.raises(UserError, match=message):
            parse_reward([write(tmp_path, **bad)], paddle=PADDLE_REWARD_NAMES)
    # The SFT / DPO parsers do not know the reward scripts' names.
    with pytest.raises(UserError, match="unknown key 'regularization'"):
        parse(tmp_path, regularization=0.001)


# --- both launch habits: from the repository root and from llm/ -------------------------------------------


def test_relative_paths_resolve_from_llm_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.join(ROOT, "llm"))
    model_args, data_args, _ = parse_reward(["config/tiny/prm_argument.json", "--output_dir", str(tmp_path / "out")])
    assert model_args.model_name_or_path == os.path.join(ROOT, "llm/assets/tiny-prm")
    assert os.path.isfile(data_args.train_dataset_path)
    # the repository-root form of the config path works from llm/ too
    parse_reward(["llm/config/tiny/prm_argument.json"])


def test_missing_config_names_the_places_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"nope.json: no such file \(looked in: .*nope.json, .*nope.json\)"):
        parse_reward(["nope.json"])


def test_metric_for_best_model_is_checked_against_the_trainer(tmp_path):
    from llm.alignment.rm.orm_trainer import ORMTrainer
    from llm.alignment.rm.prm_trainer import PRMTrainer

    class Args:
        metric_for_best_model = "eval_acuracy"

    trainer = ORMTrainer.__new__(ORMTrainer)
    trainer.args = Args()
    with pytest.raises(UserError, match=r"'eval_acuracy' is not a metric of ORMTrainer; it reports loss, accuracy"):
        trainer.check_metric_for_best_model()
    Args.metric_for_best_model = "accuracy"
    trainer.check_metric_for_best_model()
    trainer = PRMTrainer.__new__(PRMTrainer)
    trainer.args = Args()
    with pytest.raises(UserError, match="step_accuracy"):
        trainer.check_metric_for_best_model()


def test_reward_only_fields_are_refused_by_the_shared_parser(tmp_path):
    """SFT / DPO (the shared dataclasses) do not declare the reward model's fields: a config that sets them
    stops naming the key, instead of parsing silently."""
    for key, value in (("process_reward", True), ("margin", 5.0), ("placeholder_token", "ки"), ("prm_threshold", 0.4)):
        with pytest.raises(UserError, match=f"unknown key '{key}'"):
            parse_arguments([write(tmp_path, **{key: value})])
    assert not {"process_reward", "margin", "reward_tokens"} & {
        *ModelArgument.__dataclass_fields__,
        *TrainingArguments.__dataclass_fields__,
    }
    m, _, t = parse_reward([write(tmp_path, process_reward=True, margin=0.5, reward_tokens="a,b")])
    assert (t.process_reward, t.margin, m.reward_tokens) == (True, 0.5, "a,b")
