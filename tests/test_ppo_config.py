"""PPO configuration: MindSpeed-LLM's Ray PPO files as they are (YAML and JSON), every field typed, Megatron-only
settings refused, relative paths from the repository root or from llm/."""

import dataclasses
import json
import logging
import os
import string
import subprocess
import sys

import pytest
import yaml

from llm.alignment.ppo.build import PPOContext, load_prompts
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.settings.yaml_files import load_yaml
from llm.utils.errors import UserError, run_cli
from tests.helpers import ROOT
from tests.test_ppo_run import config, history

TINY_LLAMA = os.path.join(ROOT, "llm", "assets", "tiny-llama")
TINY_TOKENIZER = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")
PROMPTS = os.path.join(ROOT, "llm", "data", "sample", "prompts.jsonl")

# configs/rlxf/model/<name>.yaml in MindSpeed-LLM's layout (as model/llama32-1b.yaml), describing llm/assets/tiny-llama.
MODEL_FILE = """\
tiny-llama:
  use_mcore_models: true
  sequence_parallel: true
  use_mc2: true
  use_flash_attn: true
  use_rotary_position_embeddings: true
  use_fused_rmsnorm: true
  use_fused_swiglu: true
  max_position_embeddings: 2048
  num_layers: 4
  hidden_size: 128
  ffn_hidden_size: 256
  num_attention_heads: 4
  group_query_attention: true
  num_query_groups: 2
  make_vocab_size_divisible_by: 1
  padded_vocab_size: 648
  untie_embeddings_and_output_weights: true
  disable_bias_linear: true
  attention_dropout: 0.0
  init_method_std: 0.01
  hidden_dropout: 0.0
  position_embedding_type: rope
  rotary_base: 10000
  normalization: RMSNorm
  norm_epsilon: 1e-6
  swiglu: true
  no_masked_softmax_fusion: true
  attention_softmax_in_fp32: true
  no_gradient_accumulation_fusion: true
  bf16: true
"""

# The structure and values of MindSpeed-LLM's configs/rlxf/ppo_trainer_llama32_1b.yaml (at 7e6e3cca^), with the tiny
# model, tokenizer and the bundled prompts in place of its paths, seq_length 256 + 8 (8-token responses), and
# init_from_config (our name: the tiny model directory holds a config, no weights). Relative paths: found from
# the repository root whatever the working directory.
MINDSPEED_PPO = string.Template("""\
defaults:
  - model:
      - tiny-llama

training:
  global_batch_size: 8
  seq_length: 264
  tokenizer_type: PretrainedFromHF
  tokenizer_name_or_path: llm/assets/tiny_tokenizer
  train_iters: $train_iters
  distributed_backend: nccl
  no_shared_storage: true
  save_interval: 10000
  no_load_optim: true
  no_load_rng: true
  bf16: $bf16
  is_instruction_dataset: true
  variable_seq_lengths: true
  no_shuffle: true
  stage: ray_ppo

actor_rollout_ref:
  actor_rollout:
    model: tiny-llama
    do_sample: false
    micro_batch_size: 4
    ppo_mini_batch_size: 4
    num_samples_per_step: 2
    max_prompt_length: 256
    ppo_epochs: 1
    clip_ratio: 0.2
    entropy_coeff: 0.001
    shuffle_minibatch: false
    use_kv_cache: true
    tensor_model_parallel_size: 1
    pipeline_model_parallel_size: 1
    lr: 1e-7
    lr_decay_style: constant
    min_lr: 0.0
    weight_decay: 0.0
    lr_warmup_fraction: 0.0
    clip_grad: 10000.0
    adam_beta1: 0.9
    adam_beta2: 0.999
    initial_loss_scale: 4096
    finetune: true
    load: llm/assets/tiny-llama
    save: $save
    num_gpus_for_train: 1
    num_gpus_for_infer: $infer
    pad_to_multiple_of: 1
    data_path: llm/data/sample/prompts.jsonl
    split: 100,0,0
    init_from_config: true

  ref:
    model: tiny-llama
    tensor_model_parallel_size: 1
    pipeline_model_parallel_size: 1
    micro_batch_size: 8
    load: llm/assets/tiny-llama
    init_from_config: true

critic:
  model: tiny-llama
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  use_mcore_models: True
  micro_batch_size: 4
  sequence_parallel: False
  lr: 1e-7
  lr_decay_style: constant
  min_lr: 0.0
  weight_decay: 0.0
  lr_warmup_fraction: 0.0
  use_distributed_optimizer: true
  clip_grad: 10000.0
  adam_beta1: 0.9
  adam_beta2: 0.999
  initial_loss_scale: 4096
  no_load_optim: True
  no_load_rng: True
  is_instruction_dataset: true
  variable_seq_lengths: true
  load: llm/assets/tiny-llama
  save: $save
  cliprange_value: 0.2
  critic_mini_batch_size: 4
  critic_update_epochs: 1
  init_from_config: true

reward:
  model: tiny-llama
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  micro_batch_size: 8
  sequence_parallel: false
  load: llm/assets/tiny-llama
  init_from_config: true

algorithm:
  gamma: 1.0
  lam: 0.95
  adv_estimator: gae
  kl_penalty: kl
  kl_ctrl:
    type: fixed
    kl_coef: 0.05
  missing_eos_penalty: 0.0

resource_pool:
  actor_rollout: [$actor_devices]
  ref: [1]
  critic: [1]
  reward: [1]
""")
SHIPPED = {"train_iters": 1000, "bf16": "true", "infer": 1, "actor_devices": 2}  # llama32_1b's own values
IN_PROCESS = {"train_iters": 2, "bf16": "false", "infer": 0, "actor_devices": 1}  # one CPU process, 2 steps


def mindspeed(tmp_path, text: str | None = None, model: str = MODEL_FILE, name="ppo_trainer_tiny.yaml", **values):
    """The config and its defaults model file (model/tiny-llama.yaml beside it, as hydra's config group)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "tiny-llama.yaml").write_text(model)
    if text is None:
        text = MINDSPEED_PPO.substitute({**SHIPPED, "save": str(tmp_path / "ckpt"), **values})
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def edited(tmp_path, edit, **values) -> str:
    """The shipped-shape config with ``edit`` applied to its data, written back as YAML."""
    data = load_yaml(MINDSPEED_PPO.substitute({**SHIPPED, "save": str(tmp_path / "ckpt"), **values}), "template")
    edit(data)
    return mindspeed(tmp_path, yaml.safe_dump(data, sort_keys=False), name="edited.yaml")


def setter(dotted: str, value):
    def edit(data):
        *parents, key = dotted.split(".")
        node = data
        for p in parents:
            node = node[p]
        if value is DELETE:
            del node[key]
        else:
            node[key] = value

    return edit


DELETE = object()


def test_yaml_reads_numbers_as_hydra_does():
    data = load_yaml("lr: 1e-7\nb: 1.5E+3\neps: .5\nday: 2024-01-01\nflag: True\nkeep: '1e-7'\n", "x.yaml")
    assert data == {"lr": 1e-7, "b": 1500.0, "eps": 0.5, "day": "2024-01-01", "flag": True, "keep": "1e-7"}
    assert isinstance(data["lr"], float)
    with pytest.raises(UserError, match=r"x.yaml: not valid YAML \(key 'lr' is given twice at line 2"):
        load_yaml("lr: 1\nlr: 2\n", "x.yaml")


def test_mindspeed_file_maps_onto_our_fields(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        c = parse_ppo_config([mindspeed(tmp_path)])
    a, cr, t = c.actor_rollout, c.critic, c.training
    assert a.learning_rate == 1e-7 and type(a.learning_rate) is float and cr.learning_rate == 1e-7
    assert (t.max_steps, t.save_steps, t.seed, t.bf16, t.output_dir) == (
        1000,
        10000,
        1234,
        True,
        str(tmp_path / "ckpt"),
    )
    assert (c.data.rollout_batch_size, c.data.shuffle, c.data.train_dataset_path) == (8, False, PROMPTS)
    assert (a.max_prompt_length, a.max_response_length) == (256, 264 - 256)
    assert (a.do_sample, a.temperature, a.num_samples_per_step, a.ppo_mini_batch_size, a.ppo_epochs) == (
        False,
        1.0,
        1,  # MindSpeed's num_samples_per_step is prompts per generate call; n_samples_per_prompt (default 1) is ours
        4,
        1,
    )
    assert (a.shuffle_minibatch, a.entropy_coeff, a.clip_ratio) == (False, 0.0, 0.2)  # no entropy term in its loss
    for role in ("actor_rollout", "critic"):
        assert c.optim(role, "max_grad_norm") == 10000.0 and c.optim(role, "weight_decay") == 0.0
        assert (c.optim(role, "adam_beta1"), c.optim(role, "adam_beta2"), c.optim(role, "adam_epsilon")) == (
            0.9,
            0.999,
            1e-8,
        )
        assert c.optim(role, "lr_warmup_steps") == 0
    assert [c.micro(r) for r in ("actor_rollout", "ref", "critic", "reward")] == [4, 8, 4, 8]
    for role in ("actor_rollout", "ref", "critic", "reward"):
        assert getattr(c, role).model_name_or_path == TINY_LLAMA
    assert a.tokenizer_name_or_path == c.reward.tokenizer_name_or_path == TINY_TOKENIZER
    assert c.reward.type == "orm" and c.ref.dtype is None and c.reward.dtype is None
    assert (cr.cliprange_value, cr.critic_mini_batch_size, cr.critic_update_epochs) == (0.2, 4, 1)
    pool = c.resource_pool  # actor_rollout: [2] = num_gpus_for_train 1 + num_gpus_for_infer 1
    assert (pool.actor_rollout, pool.rollout, pool.ref, pool.critic, pool.reward, pool.use_ray) == (1, 1, 1, 1, 1, True)
    assert (c.algorithm.kl_ctrl.kl_coef, c.algorithm.missing_eos_penalty, c.algorithm.adv_estimator) == (
        0.05,
        0.0,
        "gae",
    )
    log = caplog.text
    assert "tiny-llama.sequence_parallel: True: off (Megatron turns it off at tensor_model_parallel_size 1)" in log
    assert "actor_rollout.num_samples_per_step: 2: prompts per generate call" in log
    assert "entropy_coeff: 0.001: MindSpeed's PPO loss (loss_func_ppo) has no entropy term" in log
    assert "initial_loss_scale: 4096: Megatron scales losses only with fp16" in log
    assert "training.seed: 1234 (Megatron default)" in log


def test_mindspeed_layout_in_json_parses_the_same(tmp_path):
    from_yaml = parse_ppo_config([mindspeed(tmp_path)])
    data = load_yaml((tmp_path / "ppo_trainer_tiny.yaml").read_text(), "x")
    path = tmp_path / "ppo_trainer_tiny.json"
    path.write_text(json.dumps(data))
    from_json = parse_ppo_config([str(path)])

    def strip(c):
        return {k: v for k, v in dataclasses.asdict(c).items() if k not in ("source", "notes")}

    assert strip(from_json) == strip(from_yaml)


def test_mindspeed_file_runs_two_steps_in_process(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # every role on one CPU device: no Ray needed
    path = mindspeed(tmp_path, **IN_PROCESS, save=str(tmp_path / "out"))
    main([path, "--training.report_to", "none", "--training.disable_tqdm", "true"])
    logs = history(tmp_path / "out")
    assert [h["step"] for h in logs] == [1, 2] and all(h["response_length"] <= 8 for h in logs)
    assert (tmp_path / "out" / "actor" / "model.safetensors").exists()
    assert (tmp_path / "out" / "critic" / "model.safetensors").exists()


def test_mindspeed_batch_sizes_per_rank_devices_and_warmup(tmp_path):
    def edit(data):
        actor, critic = data["actor_rollout_ref"]["actor_rollout"], data["critic"]
        actor.update(num_gpus_for_train=2, num_gpus_for_infer=2, lr_warmup_fraction=0.1)
        critic["lr_warmup_fraction"] = 0.1
        data["training"]["train_iters"] = 10
        data["resource_pool"].update(actor_rollout=[2, 2], critic=[2])

    c = parse_ppo_config([edited(tmp_path, edit)])
    pool = c.resource_pool
    assert (pool.actor_rollout, pool.rollout, pool.critic, pool.use_ray) == (2, 2, 2, True)
    # MindSpeed's mini-batches are per rank: 4 on each of 2 ranks is one optimizer step over 8 samples
    assert (c.actor_rollout.ppo_mini_batch_size, c.critic.critic_mini_batch_size) == (8, 8)
    # Megatron warms up over 0.1 x 10 iterations x 8 samples; the actor's scheduler advances 1 per optimizer
    # step, the critic's critic_mini_batch_size (4) per step
    assert (c.optim("actor_rollout", "lr_warmup_steps"), c.optim("critic", "lr_warmup_steps")) == (8, 2)


def bad_value(section: str, key: str, value):
    return {section: {"kl_ctrl": {key: value}} if section == "algorithm" else {key: value}}


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        (
            "actor_rollout",
            "learning_rate",
            "fast",
            "actor_rollout.learning_rate must be a number or null, got the string 'fast'",
        ),
        (
            "training",
            "max_steps",
            "2",
            "training.max_steps must be a whole number, got the string '2' (write 2 without",
        ),
        (
            "actor_rollout",
            "do_sample",
            "false",
            "actor_rollout.do_sample must be true or false, got the string 'false'",
        ),
        ("data", "rollout_batch_size", 0, "data.rollout_batch_size must be a positive number, got 0"),
        ("actor_rollout", "ppo_mini_batch_size", -4, "actor_rollout.ppo_mini_batch_size must be a positive number"),
        ("training", "micro_batch_size", 2.5, "training.micro_batch_size must be a whole number, got 2.5"),
        ("reward", "timeout", "3", "reward.timeout must be a number, got the string '3'"),
        ("reward", "timeout", 0, "reward.timeout must be > 0"),
        ("resource_pool", "use_ray", "yes", "resource_pool.use_ray must be true or false, got the string 'yes'"),
        ("data", "map_keys", ["src"], "data.map_keys must be an object {...} or null"),
        ("algorithm", "kl_coef", "0.1", "algorithm.kl_ctrl.kl_coef must be a number, got the string '0.1'"),
        ("critic", "cliprange_value", -0.1, "critic.cliprange_value must be a number >= 0"),
    ],
)
def test_each_type_error_has_its_message(tmp_path, capsys, section, key, value, message):
    path = config(tmp_path, **bad_value(section, key, value))
    with pytest.raises(SystemExit) as e:
        run_cli(main, [path])
    assert e.value.code == 2
    assert f"error: {path}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "dotted, value, message",
    [
        ("actor_rollout_ref.actor_rollout.lr", "fast", "actor_rollout_ref.actor_rollout.lr must be a number or null"),
        ("training.train_iters", "2", "training.train_iters must be a whole number, got the string '2'"),
        (
            "actor_rollout_ref.actor_rollout.do_sample",
            "false",
            "actor_rollout_ref.actor_rollout.do_sample must be true or",
        ),
        ("training.global_batch_size", 0, "training.global_batch_size must be a positive number, got 0"),
        ("reward.micro_batch_size", -1, "reward.micro_batch_size must be a positive number, got -1"),
        ("resource_pool.critic", ["1"], "resource_pool.critic must be a list, each item a whole number, got"),
    ],
)
def test_mindspeed_type_errors_name_the_file_and_its_key(tmp_path, capsys, dotted, value, message):
    path = edited(tmp_path, setter(dotted, value))
    with pytest.raises(SystemExit) as e:
        run_cli(main, [path])
    assert e.value.code == 2
    assert f"error: {path}: {message}" in capsys.readouterr().err


def test_command_line_values_are_parsed_by_type(tmp_path):
    path = config(tmp_path)
    c = parse_ppo_config(
        [
            path,
            "--actor_rollout.do_sample",
            "false",
            "--max_steps=3",
            "--data.map_keys",
            '{"src": "q"}',
            "--ref.dtype",
            "null",
        ]
    )
    assert (c.actor_rollout.do_sample, c.training.max_steps, c.data.map_keys, c.ref.dtype) == (
        False,
        3,
        {"src": "q"},
        None,
    )
    for flags, message in (
        (["--training.max_steps", "two"], "command line: --training.max_steps must be a whole number, got 'two'"),
        (["--actor_rollout.do_sample", "no"], "command line: --actor_rollout.do_sample must be true or false"),
        (["--reward.timeout", "3s"], "command line: --reward.timeout must be a number"),
        (["--data.rollout_batch_size", "0"], "data.rollout_batch_size must be a positive number, got 0"),
        (["--max_steps"], "command line: --max_steps needs a value"),
        (["--critic.lr", "1"], "command line: critic has no field 'lr'"),
    ):
        with pytest.raises(UserError, match=message.replace("(", r"\(")):
            parse_ppo_config([path, *flags])


def test_greedy_with_two_samples_runs_with_a_warning(tmp_path, capsys):
    """do_sample false with 2 samples per prompt (refused before): runs, warns that they are identical."""
    path = config(tmp_path, actor_rollout={"do_sample": False, "num_samples_per_step": 2}, training={"max_steps": 1})
    main([path])  # its logging set-up writes to stderr
    err = capsys.readouterr().err
    assert "do_sample is false (greedy) with num_samples_per_step=2: the 2 samples of each prompt are identical" in err
    assert len(history(tmp_path / "out")) == 1
    # MindSpeed's name for samples per prompt (its num_samples_per_step is prompts per generate call)
    parse_ppo_config([edited(tmp_path, setter("actor_rollout_ref.actor_rollout.n_samples_per_prompt", 2))])
    assert "num_samples_per_step=2: the 2 samples of each prompt are identical" in capsys.readouterr().err


def _megatron_checkpoint(tmp_path):
    ckpt = tmp_path / "mcore"
    (ckpt / "iter_0000010").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    return setter("critic.load", str(ckpt))


def _megatron_prefix(tmp_path):
    (tmp_path / "data").mkdir()
    for suffix in ("bin", "idx"):
        (tmp_path / "data" / f"descriptiveness_packed_input_ids_document.{suffix}").write_text("")
    return setter("actor_rollout_ref.actor_rollout.data_path", str(tmp_path / "data" / "descriptiveness"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            setter("actor_rollout_ref.actor_rollout.tensor_model_parallel_size", 2),
            (
                "actor_rollout_ref.actor_rollout.tensor_model_parallel_size: 2 cannot take effect here: Megatron's "
                "tensor parallelism is not available here; set it to 1 and give the role N devices in resource_pool"
            ),
        ),
        (setter("critic.pipeline_model_parallel_size", 4), "critic.pipeline_model_parallel_size: 4 cannot take effect"),
        (setter("critic.use_mcore_models", False), "critic.use_mcore_models: False cannot take effect here"),
        (setter("training.fp16", True), "training.fp16: True cannot take effect here: fp16 with loss scaling"),
        (setter("training.distributed_backend", "mpi"), "training.distributed_backend: 'mpi' cannot take effect"),
        (setter("critic.lr_decay_style", "cosine"), "critic.lr_decay_style: 'cosine': this trainer's learning rate is"),
        (
            setter("critic.lr_decay_style", DELETE),
            "critic: lr_decay_style is not set, and Megatron's default is linear",
        ),
        (setter("actor_rollout_ref.actor_rollout.split", "98,2,0"), "split: '98,2,0': PPO here trains on every prompt"),
        (setter("training.stage", "ray_grpo"), "training.stage: 'ray_grpo': this reader runs MindSpeed's PPO"),
        (setter("critic.recompute_granularity", "selective"), "'selective': only full recomputation"),
        (setter("actor_rollout_ref.actor_rollout.finetune", False), "resume with training.resume_from_checkpoint"),
        (setter("critic.bf16", False), "bf16: actor_rollout and critic differ"),
        (
            setter("critic.do_sample", True),
            "critic.do_sample: MindSpeed's PPO reads do_sample only in actor_rollout_ref",
        ),
        (
            setter("actor_rollout_ref.actor_rollout.num_gpus_for_infer", 3),
            "num_gpus_for_train: 1 + num_gpus_for_infer 3 must be resource_pool.actor_rollout (2)",
        ),
        (
            _megatron_checkpoint,
            "critic.load: '{tmp}/mcore' is a Megatron checkpoint (latest_checkpointed_iteration.txt)",
        ),
        (
            _megatron_prefix,
            (
                "data_path: '{tmp}/data/descriptiveness' is a Megatron preprocessed prefix "
                "(descriptiveness_packed_input_ids_document.bin: token ids written by preprocess_data.py). This "
                "trainer reads the prompt records themselves: give as data_path the file that preprocess_data.py read"
            ),
        ),
        (
            setter("actor_rollout_ref.actor_rollout.lrr", 1e-7),
            "actor_rollout_ref.actor_rollout.lrr: unknown name; closest valid names: 'lr'",
        ),
        (setter("critc", {}), "critc: unknown section; closest valid names: 'critic'"),
    ],
)
def test_megatron_settings_that_cannot_take_effect_stop(tmp_path, edit, message):
    if edit in (_megatron_checkpoint, _megatron_prefix):
        edit = edit(tmp_path)
    with pytest.raises(UserError) as err:
        parse_ppo_config([edited(tmp_path, edit)])
    assert message.format(tmp=tmp_path) in str(err.value)


def test_model_file_must_describe_the_checkpoint(tmp_path):
    path = mindspeed(tmp_path, model=MODEL_FILE.replace("num_layers: 4", "num_layers: 16"))
    with pytest.raises(
        UserError,
        match=r"model/tiny-llama.yaml: tiny-llama.num_layers: 16 but .*tiny-llama/config.json "
        r"has num_hidden_layers = 4",
    ):
        parse_ppo_config([path])
    (tmp_path / "model" / "tiny-llama.yaml").unlink()
    with pytest.raises(UserError, match=r"defaults: model 'tiny-llama': no file .*model/tiny-llama.yaml"):
        parse_ppo_config([path])


def test_fields_nothing_read_are_refused(tmp_path):
    for sections, message in (
        ({"data": {"dev_dataset_path": PROMPTS}}, "data.dev_dataset_path: PPO here evaluates no dev set"),
        (
            {"actor_rollout": {"num_gpus_for_train": 1}},
            "set the actor's training devices as resource_pool.actor_rollout",
        ),
        ({"actor_rollout": {"num_gpus_for_infer": 1}}, "as resource_pool.rollout"),
        (
            {"actor_rollout": {"clip_ratoi": 0.1}},
            "actor_rollout: unknown key 'clip_ratoi'; closest valid names: 'clip_ratio'",
        ),
    ):
        with pytest.raises(UserError, match=message):
            parse_ppo_config([config(tmp_path, **sections)])
    with open(config(tmp_path), encoding="utf-8") as f:
        ours = json.load(f)
    ours["defaults"] = {"actor": TINY_LLAMA}  # what llm/config/llama/ppo_argument.json had, read by nothing
    path = tmp_path / "with_defaults.json"
    path.write_text(json.dumps(ours))
    with pytest.raises(UserError, match="defaults: MindSpeed-LLM's list of model files, read in MindSpeed's layout"):
        parse_ppo_config([str(path)])


def test_map_keys_renames_the_prompt_columns(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    c = parse_ppo_config(
        [config(tmp_path, data={"train_dataset_path": str(data), "map_keys": {"src": "question", "tgt": "answer"}})]
    )
    prompts = load_prompts(c, PPOContext.load(c))
    assert len(prompts) == 4 and [p.reference for p in prompts] == ["1", "2", "3", "4"]
    c.data.map_keys = None
    with pytest.raises(UserError, match="questions.jsonl"):
        load_prompts(c, PPOContext.load(c))


def test_relative_paths_resolve_from_llm_too(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.join(ROOT, "llm"))
    c = parse_ppo_config(["config/tiny/ppo_argument.json"])  # its paths are written from the repository root
    assert c.actor_rollout.model_name_or_path == TINY_LLAMA and c.data.train_dataset_path == PROMPTS
    assert c.training.output_dir == "output/tiny_ppo"  # outputs stay relative to the working directory
    with pytest.raises(UserError) as err:
        parse_ppo_config(["config/tiny/ppo_argument.json", "--actor_rollout.model_name_or_path", "llm/assets/nope"])
    looked = f"{os.path.join(ROOT, 'llm', 'llm', 'assets', 'nope')}, {os.path.join(ROOT, 'llm', 'assets', 'nope')}"
    assert f"actor_rollout.model_name_or_path 'llm/assets/nope' does not exist (looked in: {looked})" in str(err.value)
    c = parse_ppo_config(["config/tiny/ppo_argument.json", "--data.train_dataset_path", "data/nope.jsonl"])
    with pytest.raises(UserError, match=r"data.train_dataset_path 'data/nope.jsonl' does not exist \(looked in: "):
        load_prompts(c, PPOContext.load(c))


def test_cd_llm_launch_runs_one_step(tmp_path):
    out = tmp_path / "out"
    flags = {
        "training.max_steps": 1,
        "training.output_dir": out,
        "training.report_to": "none",
        "training.save_steps": 0,
        "training.disable_tqdm": "true",
        "data.rollout_batch_size": 4,
        "actor_rollout.ppo_mini_batch_size": 4,
        "critic.critic_mini_batch_size": 4,
        "actor_rollout.max_response_length": 8,
    }
    argv = [a for k, v in flags.items() for a in (f"--{k}", str(v))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "run_ppo.py", "config/tiny/ppo_argument.json", *argv],
        cwd=os.path.join(ROOT, "llm"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert [h["step"] for h in history(out)] == [1] and (out / "actor" / "model.safetensors").exists()


def test_in_tree_ppo_configs_carry_no_unread_fields():
    for name in ("llama", "qwen2"):
        with open(os.path.join(ROOT, "llm", "config", name, "ppo_argument.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        assert "defaults" not in cfg and not {"num_gpus_for_train", "num_gpus_for_infer"} & set(cfg["actor_rollout"])


def test_critic_mini_batch_size_is_checked_only_with_a_critic(tmp_path):
    """GRPO has no critic: a critic_mini_batch_size that does not divide the batch is not read, so not refused."""
    odd = {"critic": {"critic_mini_batch_size": 3}, "actor_rollout": {"num_samples_per_step": 2}}
    parse_ppo_config([config(tmp_path, algorithm={"adv_estimator": "grpo"}, **odd)])
    with pytest.raises(UserError, match=r"critic.critic_mini_batch_size=3 must divide"):
        parse_ppo_config([config(tmp_path, algorithm={"adv_estimator": "gae"}, **odd)])
