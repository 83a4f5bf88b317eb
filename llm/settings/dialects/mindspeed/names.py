"""``RULES``: every MindSpeed name, the roles that read it in MindSpeed's PPO, its handler, and where
MindSpeed-LLM / Megatron reads it (the justification of the mapping). docs/dialects.md shows it as a table, made by
``python -m llm.docs_tables`` from the rules and their handlers' docstrings."""

from __future__ import annotations

from llm.settings.dialects.mindspeed.architecture import ARCHITECTURE, KERNELS, architecture_name
from llm.settings.dialects.mindspeed.handlers import (
    bf16,
    cliprange_or_none,
    data_path_name,
    kernel,
    later,
    load,
    mini_batch,
    negated,
    no_effect,
    save,
    temperature,
    to,
    tokenizer_name,
    warmup_name,
)
from llm.settings.dialects.mindspeed.refusals import decay, parallel, recompute, same, split, stage_name, tp
from llm.settings.dialects.mindspeed.rule_types import ACTOR, ALL, TRAINED, Rule

HERE = "what this trainer does"
S_INIT = "rlxf/training/initialize.py parse_args_from_config (model < training < role), Megatron validate_args"
S_ACTOR = "rlxf/workers/actor_train_infer.py"
S_CRITIC = "rlxf/workers/critic.py"
S_TRAINER = "rlxf/ray_trainer/ppo_trainer.py"
S_SCHED = "Megatron training.py get_optimizer_param_scheduler / OptimizerParamScheduler"
S_OPT = "Megatron arguments.py _add_regularization_args, optimizer (Adam + clip_grad_norm)"
SEQ_LENGTH = later("`actor_rollout.max_response_length` = `seq_length` - `max_prompt_length`")
GPU_SPLIT = later(
    "read with `resource_pool`: `num_gpus_for_train` devices train the actor (`resource_pool.actor_rollout`), "
    "`num_gpus_for_infer` make `resource_pool.rollout` (a generation copy); both or neither, summing to "
    "MindSpeed's `resource_pool.actor_rollout`"
)

RULES: dict[str, Rule] = {
    # run: the driver and the actor's data / generation
    "stage": Rule(ALL, stage_name, "ray_gpt.py main_task: get_trainer(config.training.stage)"),
    "train_iters": Rule(ALL, to("max_steps", "training"), f"{S_TRAINER} train: while iteration < train_iters"),
    "save_interval": Rule(ALL, to("save_steps", "training"), f"{S_TRAINER} train: iteration % save_interval"),
    "global_batch_size": Rule(
        ACTOR, to("rollout_batch_size", "data"), f"{S_ACTOR} run_inference: gbs // dp prompts per inference rank"
    ),
    "seq_length": Rule(ACTOR, SEQ_LENGTH, f"{S_ACTOR} run_inference: max_new_tokens = seq_length - mpl"),
    "max_prompt_length": Rule(ACTOR, to("max_prompt_length"), f"{S_ACTOR} dataset seq_length=max_prompt_length"),
    "data_path": Rule(ACTOR, data_path_name, f"{S_ACTOR} train_valid_test_datasets_provider: data_prefix=data_path"),
    "split": Rule(ACTOR, split, f"{S_ACTOR} build_blended_mtf_dataset(splits_string=split): only train is read"),
    "no_shuffle": Rule(ACTOR, to("shuffle", "data", negated), "mindspeed arguments.py --no-shuffle"),
    "seed": Rule(ALL, to("seed", "training"), "initialize.py _set_random_seed(args.seed); Megatron default 1234"),
    "tokenizer_type": Rule(
        ALL,
        same(str, lambda v, t, r: v == "PretrainedFromHF", "a Hugging Face tokenizer, " + HERE, "PretrainedFromHF"),
        "Megatron build_tokenizer",
    ),
    "tokenizer_name_or_path": Rule(ALL, tokenizer_name, "reward.py AutoTokenizer.from_pretrained; actor generation"),
    "is_instruction_dataset": Rule(
        ALL,
        same(bool, lambda v, t, r: v, "prompt records (instruction data), " + HERE, "prompts are instruction data"),
        "mindspeed arguments.py --is-instruction-dataset",
    ),
    "variable_seq_lengths": Rule(ALL, no_effect("sequences are packed without padding here"), "arguments.py"),
    "pad_to_multiple_of": Rule(ALL, no_effect("sequences are packed without padding here", int), S_ACTOR),
    "no_shared_storage": Rule(ALL, no_effect("no data index cache is built here"), "arguments.py _add_dataset_args"),
    "log_interval": Rule(ALL, no_effect("MindSpeed's PPO logs every iteration, as here", int), S_TRAINER),
    "distributed_backend": Rule(
        ALL,
        same(str, lambda v, t, r: v in ("nccl", "hccl", "gloo"), "collectives: gloo for CPU, NCCL for GPU", "nccl"),
        "Megatron init_process_group(backend=distributed_backend)",
    ),
    # the actor: generation and the policy update
    "do_sample": Rule(ACTOR, to("do_sample"), f"{S_ACTOR} generate(do_sample=...); MindSpeed default false"),
    "temperature": Rule(ACTOR, temperature, f"{S_ACTOR} generate(temperature=...): sampling only"),
    "top_p": Rule(
        ACTOR, no_effect("MindSpeed's PPO does not pass it to generate (no filtering), as here", float), S_ACTOR
    ),
    "top_k": Rule(
        ACTOR, no_effect("MindSpeed's PPO does not pass it to generate (no filtering), as here", int), S_ACTOR
    ),
    "num_samples_per_step": Rule(
        ACTOR,
        no_effect(
            "prompts per generate call on an inference rank (memory/speed, not samples per prompt); here a rank "
            "generates its share of the step in one call",
            int,
        ),
        f"{S_ACTOR} run_inference: num_infer_steps = gbs // (dp * num_samples_per_step)",
    ),
    "n_samples_per_prompt": Rule(
        ACTOR, to("num_samples_per_step"), f"{S_ACTOR} run_inference: each prompt repeated n_samples_per_prompt times"
    ),
    "use_kv_cache": Rule(ACTOR, no_effect("generation here always uses the KV cache (same tokens)"), S_ACTOR),
    "ppo_mini_batch_size": Rule(ACTOR, mini_batch("ppo_mini_batch_size"), f"{S_ACTOR} make_minibatch_iterator"),
    "ppo_epochs": Rule(ACTOR, to("ppo_epochs"), f"{S_ACTOR} make_minibatch_iterator(epochs=ppo_epochs)"),
    "clip_ratio": Rule(ACTOR, to("clip_ratio"), "core_algos.py compute_policy_loss(cliprange=clip_ratio)"),
    "shuffle_minibatch": Rule(ACTOR, to("shuffle_minibatch"), f"{S_ACTOR} dataloader_kwargs shuffle"),
    # the 2026 objectives under verl's names (MindSpeed-LLM's PPO had one clip range; verl, from which its Ray PPO
    # came, names these): llm/alignment/ppo/objectives.py
    "clip_ratio_low": Rule(ACTOR, to("clip_ratio_low"), "verl core_algos.py compute_policy_loss(cliprange_low)"),
    "clip_ratio_high": Rule(ACTOR, to("clip_ratio_high"), "verl core_algos.py compute_policy_loss(cliprange_high)"),
    "clip_ratio_c": Rule(ACTOR, to("clip_ratio_c"), "verl core_algos.py compute_policy_loss (dual-clip bound)"),
    "loss_agg_mode": Rule(ACTOR, to("loss_agg_mode"), "verl core_algos.py agg_loss(loss_agg_mode)"),
    "policy_loss": Rule(ACTOR, to("policy_loss"), "verl actor.policy_loss.loss_mode (get_policy_loss_fn)"),
    "overlong_buffer_len": Rule(
        ("reward",), to("overlong_buffer_len"), "verl reward_model.overlong_buffer.len (DAPO reward manager)"
    ),
    "overlong_penalty_factor": Rule(
        ("reward",), to("overlong_penalty_factor"), "verl reward_model.overlong_buffer.penalty_factor"
    ),
    "entropy_coeff": Rule(
        ACTOR,
        no_effect("MindSpeed's PPO loss (loss_func_ppo) has no entropy term, so neither has this run", float),
        f"{S_ACTOR} loss_func_ppo: policy_loss = pg_loss",
    ),
    "num_gpus_for_train": Rule(ACTOR, GPU_SPLIT, "initialize.py TRAIN_SIZE + INFER_SIZE == actor pool"),
    "num_gpus_for_infer": Rule(ACTOR, GPU_SPLIT, "initialize.py: the actor's inference group"),
    # the critic
    "cliprange_value": Rule(("critic",), to("cliprange_value", convert=cliprange_or_none), f"{S_CRITIC} loss_func"),
    "critic_mini_batch_size": Rule(("critic",), mini_batch("critic_mini_batch_size"), f"{S_CRITIC} (per rank)"),
    "critic_update_epochs": Rule(("critic",), to("critic_update_epochs"), f"{S_CRITIC} make_minibatch_iterator"),
    # every role
    "load": Rule(ALL, load, "Megatron load_checkpoint(args.load) in each worker"),
    "micro_batch_size": Rule(ALL, to("micro_batch_size"), "forward_backward_batch: split by micro_batch_size"),
    "bf16": Rule(ALL, bf16, "Megatron --bf16 per role"),
    "fp16": Rule(
        ALL,
        same(bool, lambda v, t, r: not v, "not fp16", "fp16 with loss scaling is not available here: use bf16"),
        "Megatron --fp16",
    ),
    "tensor_model_parallel_size": Rule(ALL, parallel("tensor parallelism"), S_INIT),
    "pipeline_model_parallel_size": Rule(ALL, parallel("pipeline parallelism"), S_INIT),
    "context_parallel_size": Rule(ALL, parallel("context parallelism"), S_INIT),
    "expert_model_parallel_size": Rule(ALL, parallel("expert parallelism"), S_INIT),
    "sequence_parallel": Rule(
        ALL,
        same(
            bool,
            lambda v, t, r: not v or tp(t, r) == 1,
            "off (Megatron turns it off at tensor_model_parallel_size 1)",
            "sequence parallelism needs Megatron tensor parallelism: set it false",
        ),
        "Megatron validate_args: sequence_parallel = False when tensor_model_parallel_size == 1",
    ),
    "use_mcore_models": Rule(
        ALL,
        same(
            bool,
            lambda v, t, r: v,
            "the transformer of the checkpoint in load (MindSpeed's PPO builds mcore models only)",
            "MindSpeed's PPO needs mcore models (critic.py raises otherwise): set it true",
        ),
        f"{S_CRITIC} model_provider: 'supports mcore only'",
    ),
    "no_load_optim": Rule(ALL, no_effect("load gives the weights only, " + HERE), "Megatron load_checkpoint"),
    "no_load_rng": Rule(ALL, no_effect("load gives the weights only, " + HERE), "Megatron load_checkpoint"),
    "finetune": Rule(
        ALL,
        same(
            bool,
            lambda v, t, r: v,
            "start at step 0 from the weights in load, " + HERE,
            "resume with training.resume_from_checkpoint instead (finetune: true)",
        ),
        "Megatron --finetune",
    ),
    # the trained roles' optimizer and schedule
    "lr": Rule(TRAINED, to("learning_rate"), f"{S_SCHED}: max_lr=args.lr"),
    "lr_decay_style": Rule(TRAINED, decay, f"{S_SCHED}; Megatron default linear"),
    "min_lr": Rule(TRAINED, no_effect("only a decaying schedule reaches it; constant keeps lr", float), S_SCHED),
    "lr_decay_iters": Rule(TRAINED, no_effect("only a decaying schedule uses it", int), S_SCHED),
    "lr_warmup_fraction": Rule(TRAINED, warmup_name, f"{S_SCHED}: fraction x train_iters x gbs samples"),
    "lr_warmup_iters": Rule(TRAINED, warmup_name, f"{S_SCHED}: lr_warmup_iters x gbs samples"),
    "lr_warmup_init": Rule(
        TRAINED,
        same(float, lambda v, t, r: v == 0, "warmup from 0, " + HERE, "warmup starts from 0 here: set 0.0"),
        S_SCHED,
    ),
    "weight_decay": Rule(TRAINED, to("weight_decay"), f"{S_OPT}; Megatron default 0.01"),
    "clip_grad": Rule(TRAINED, to("max_grad_norm"), f"{S_OPT} (global L2 norm)"),
    "adam_beta1": Rule(TRAINED, to("adam_beta1"), S_OPT),
    "adam_beta2": Rule(TRAINED, to("adam_beta2"), S_OPT),
    "adam_eps": Rule(TRAINED, to("adam_epsilon"), S_OPT),
    "optimizer": Rule(
        TRAINED, same(str, lambda v, t, r: v == "adam", "AdamW, " + HERE, "only adam (AdamW) here"), S_OPT
    ),
    "use_distributed_optimizer": Rule(
        TRAINED, no_effect("a role on N devices shards its optimizer state with FSDP2 here"), "Megatron"
    ),
    "save": Rule(TRAINED, save, "Megatron save_checkpoint(args.save) from ppo_trainer.py"),
    "recompute_granularity": Rule(
        TRAINED,
        recompute,
        "Megatron --recompute-granularity full: whole layers recomputed",
    ),
    "recompute_method": Rule(TRAINED, no_effect("every decoder layer is checkpointed here", str), "Megatron"),
    "recompute_num_layers": Rule(TRAINED, no_effect("every decoder layer is checkpointed here", int), "Megatron"),
    **{
        name: Rule(
            TRAINED, no_effect("Megatron scales losses only with fp16", float), "Megatron get_megatron_optimizer"
        )
        for name in ("initial_loss_scale", "loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
    },
    # model files: the architecture is the checkpoint's (config.json), checked; kernel choices
    **{name: Rule(ALL, architecture_name, "configs/rlxf/model/*.yaml -> Megatron model") for name in ARCHITECTURE},
    **{name: Rule(ALL, kernel, "Megatron / MindSpeed kernel choice") for name in KERNELS},
}
