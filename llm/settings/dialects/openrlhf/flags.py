"""OpenLLaMA2 / OpenRLHF flags: the translation table and OpenLLaMA2's defaults (read by launch.py)."""

from __future__ import annotations

# ``flags type scripts action``, in the order the translation runs. Actions: ``*`` (the method of that name),
# ``-> FLAT | PPO ~ why`` (fields for sft/rm/dpo | ppo: ``field``, ``field=value``, ``field=@flag``; an empty side is
# noted with why, ``!text`` refused), ``~ why`` (noted), ``! fix`` (refused), ``=a,b ~ why ! fix`` (those values only).
TABLE = """
pretrain  str  all  *
load_model  str  flat  *
sft_model_path,reward_model_path,reward_pretrain,critic_pretrain  str  ppo  *
ref_pretrain  str  dpo  *
remote_rm_url  str  ppo  ! OpenRLHF's remote reward speaks another protocol: serve the model with serve_reward.py
value_head_prefix  str  rm,ppo  =score ~ the head is named score here too ! this project's value head is 'score'
save_path  str  all  *
dataset  str  flat  *
prompt_data  str  ppo  *
dataset_probs  str  flat  -> dataset_probs ~ mixed till each file is read once (OpenLLaMA2: till one runs out)
prompt_data_probs  str  ppo  -> | data.dataset_probs ~ mixed till each file is read once (OpenRLHF: till one runs out)
max_samples  int  all  *
input_key  str  sft,ppo  *
output_key  str  sft  *
label_key  str  ppo  *
prompt_key,chosen_key,rejected_key  str  rm,dpo  *
apply_chat_template  bool  all  -> use_chat_template | data.use_chat_template ~ without it the prompt is plain text
input_template,tokenizer_chat_template  str  all  ! prompts are plain text or the tokenizer's chat template here
train_split,prompt_split  str  all  =train ~ a local file is its train split ! a local file has one split: train
eval_split  str  flat  ~ the dev data here is --dev_dataset_path, a file of its own
multiturn  bool  sft  ~ every assistant turn is trained here too
pretrain_mode  bool  sft  ! SFT here trains on the answer tokens only
packing_samples  bool  all  -> zero_padding=true | ~ exact packing: the same numbers as unpacked (PPO: always)
micro_train_batch_size  int  all  -> per_device_train_batch_size per_device_eval_batch_size | \
actor_rollout.micro_batch_size critic.micro_batch_size
train_batch_size  int  flat  *
train_batch_size  int  ppo  -> | actor_rollout.ppo_mini_batch_size critic.critic_mini_batch_size ~ per optimizer step
micro_rollout_batch_size  int  ppo  -> | training.micro_batch_size ~ generation, reference and reward forwards
rollout_batch_size  int  ppo  -> | data.rollout_batch_size ~ prompts per step
n_samples_per_prompt  int  ppo  -> | actor_rollout.num_samples_per_step
max_epochs  int  all  -> num_train_epochs | actor_rollout.ppo_epochs critic.critic_update_epochs
num_episodes  int  ppo  *
max_len  int  flat  *
max_len  int  ppo  ~ deprecated there: --prompt_max_len and --generate_max_len cap prompt and response
prompt_max_len  int  ppo  -> | actor_rollout.max_prompt_length
generate_max_len  int  ppo  -> | actor_rollout.max_response_length
learning_rate  float  flat  -> learning_rate
actor_learning_rate  float  ppo  -> | actor_rollout.learning_rate
critic_learning_rate  float  ppo  -> | critic.learning_rate
lr_warmup_ratio  float  flat  -> warmup_ratio ~ then the schedule of --lr_scheduler
lr_warmup_ratio  float  ppo  *
lr_scheduler  str  flat  *
adam_betas  pair  all  -> adam_beta1 adam_beta2 | training.adam_beta1 training.adam_beta2
l2  float  all  -> weight_decay | training.weight_decay
max_norm  float  all  -> max_grad_norm | training.max_grad_norm
seed  int  all  -> seed | training.seed
bf16  bool  all  -> bf16=true fp16_opt_level=O2 | training.bf16=true ~ DeepSpeed's: bf16 weights, fp32 masters
gradient_checkpointing  bool  all  -> recompute=true | training.gradient_checkpointing=true
adam_offload  bool  all  -> | training.adam_offload=true ~ memory only; on a CPU nothing to move
flash_attn  bool  all  ~ an attention kernel: the packed attention here is exact (CUDA: --use_flash_attention true)
load_in_4bit  bool  all  -> weight_quantize_algo=nf4 | !QLoRA is not available in PPO here: remove it
lora_rank,lora_alpha  int  all  *
lora_dropout  float  all  *
target_modules  list  all  *
save_steps  int  all  *
eval_steps  int  flat  *
eval_steps  int  ppo  ~ PPO here evaluates no dev set (the log has each step's scores)
logging_steps  int  all  -> logging_steps | training.logging_steps
max_ckpt_num  int  all  -> save_total_limit | training.save_total_limit
load_checkpoint  bool  all  ~ resume here with --resume_from_checkpoint auto after the script
use_wandb  str  all  -> report_to=wandb | !PPO here logs to TensorBoard only: use --use_tensorboard
use_tensorboard  str  all  -> report_to=tensorboard | training.report_to=tensorboard ~ events in output_dir
loss  str  rm  =sigmoid,logexpwithlogit ~ -log sigmoid(s_c - s_r), both ! this project's ORM loss is sigmoid
margin_loss  bool  rm  ! a per-pair margin column is not read: --margin (one constant) after the script
only_evaluate  bool  rm  -> do_train=false do_eval=true | ~ on --dev_dataset_path FILE, given after the script
compute_fp32_loss  bool  rm  ~ the losses are fp32 here always
beta  float  dpo  -> beta
ipo  bool  dpo  -> loss_type=ipo
label_smoothing  float  dpo  -> label_smoothing
nll_loss_coef  float  dpo  -> sft_loss_weight ~ the mean NLL of the chosen answer
ref_offload  bool  dpo  ~ memory only
eps_clip  float  ppo  -> | actor_rollout.clip_ratio
value_clip  float  ppo  -> | critic.cliprange_value
gamma  float  ppo  -> | algorithm.gamma
lambd  float  ppo  -> | algorithm.lam
init_kl_coef  float  ppo  -> | algorithm.kl_ctrl.kl_coef ~ the KL penalty in the reward, per token
kl_target  float  ppo  -> | algorithm.kl_ctrl.type=adaptive algorithm.kl_ctrl.target_kl ~ horizon 10000 as there
kl_estimator  str  ppo  -> | algorithm.kl_penalty=%k1:kl,k2:mse,k3:low_var_kl
advantage_estimator  str  ppo  -> | algorithm.adv_estimator=%gae,group_norm:grpo,rloo,reinforce:reinforce_plus_plus
use_kl_loss  bool  ppo  -> | algorithm.use_kl_in_reward=false algorithm.kl_loss_coef=@init_kl_coef ~ GRPO's KL loss
normalize_reward  bool  ppo  *
reward_clip_range  pair  ppo  *
temperature  float  ppo  -> | actor_rollout.temperature
top_p  float  ppo  -> | actor_rollout.top_p
eps_clip_low_high  pair  ppo  -> | actor_rollout.clip_ratio_low actor_rollout.clip_ratio_high ~ DAPO's clip-higher
policy_loss_type  str  ppo  *
dual_clip  float  ppo  *
dynamic_filtering  bool  ppo  -> | algorithm.filter_groups=true ~ all-equal groups dropped, more prompts drawn
dynamic_filtering_reward_range  pair  ppo  ~ groups are dropped when all their rewards are equal (= (0, 1) for 0/1)
overlong_buffer_len  int  ppo  -> | reward.overlong_buffer_len ~ DAPO's soft overlong punishment
overlong_penalty_factor  float  ppo  -> | reward.overlong_penalty_factor
async_train  bool  ppo  -> | actor_rollout.async_rollout=true ~ one-step-off: the next rollout during the update
pretrain_data  str  ppo  ! PPO-ptx (a pretraining loss beside PPO) is not available: remove it
pretrain_data_probs,pretrain_split  str  ppo  ~ read only with --pretrain_data
ptx_coef  float  ppo  ~ read only with --pretrain_data
enable_ema  bool  ppo  ! no EMA copy of the actor is kept here: remove it
freezing_actor_steps  int  ppo  =-1,0 ~ the actor trains from the first step ! the actor is never frozen here
save_value_network  bool  ppo  ~ the critic is always saved, in output_dir/critic
aux_loss_coef  float  all  =0 ~ no MoE balancing loss ! no MoE balancing loss here: set 0
ring_attn_size  int  all  =1 ~ no ring attention ! no ring attention here: set 1
use_ms  bool  all  ! ModelScope downloads are not available: give local paths
zero_stage,zpg,inference_tp_size  int  all  ~ DeepSpeed: memory and speed only (torchrun: sharding stage1/2/3)
local_rank,ring_head_stride,max_ckpt_mem  int  all  ~ launcher / ring attention / checkpoint size: not read here
overlap_comm,torch_compile,use_liger_kernel,actor_init_on_gpu  bool  all  ~ speed / placement only
full_determinism,gradient_checkpointing_use_reentrant,disable_fast_tokenizer  bool  all  ~ the same numbers here
save_hf_ckpt,disable_ds_ckpt,save_hf_model  bool  all  ~ checkpoints and model are Hugging Face format here
grad_accum_dtype,ckpt_path  str  all  ~ gradients accumulate in the weights' dtype; checkpoints go to output_dir
wandb_org,wandb_group,wandb_project,wandb_run_name  str  all  ~ logging only
"""
TYPES = {"bool": bool, "int": int, "float": float, "str": str, "list": list, "pair": tuple}
SCRIPTS = {"all": ("sft", "rm", "dpo", "ppo"), "flat": ("sft", "rm", "dpo")}
FLAT = {"max_epochs": 1, "micro_train_batch_size": 8, "train_batch_size": 128, "max_len": 512, "learning_rate": 1e-5,
        "lr_scheduler": "cosine"}  # fmt: skip
DEFAULTS = {  # OpenLLaMA2's argparse defaults (and its fixed betas, warmup, reward clip) where ours differ
    "all": {"save_path": "./ckpt", "lr_warmup_ratio": 0.03, "adam_betas": (0.9, 0.95), "save_steps": -1,
            "logging_steps": 1, "apply_chat_template": False},
    "sft": {**FLAT, "max_epochs": 2, "learning_rate": 2e-6, "max_samples": 1000000},
    "rm": FLAT,
    "dpo": {**FLAT, "beta": 0.01},
    "ppo": {"num_episodes": 1, "rollout_batch_size": 512, "micro_rollout_batch_size": 8, "max_epochs": 1,
            "prompt_max_len": 1024, "generate_max_len": 1024, "max_samples": 100000, "micro_train_batch_size": 4,
            "train_batch_size": 128, "actor_learning_rate": 1e-6, "critic_learning_rate": 9e-6,
            "init_kl_coef": 0.02, "reward_clip_range": (-10.0, 10.0)},
}  # fmt: skip
