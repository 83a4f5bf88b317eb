"""PPO configuration in MindSpeed-LLM's layout, the schema: ``training`` defaults that roles override, one
section per role, ``algorithm``, ``resource_pool`` and ``data``. Every section is a dataclass; every value
is type-checked (``llm.settings.fields``) and sizes are bounded (``metadata={"min": ...}``) when ``llm.settings.load``
reads a file into them; ``llm.settings.ppo_validation`` also checks what the types cannot say."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llm.settings.environment import EnvironmentConfig
from llm.settings.fields import help_field as _f
from llm.settings.prime import PrimeSection
from llm.settings.registry import ADV_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from llm.settings.shared import LoraFields, OptimizerFields, check_reward_url, reward_token_pair, with_default
from llm.utils.errors import UserError


@dataclass
class TrainingSection(OptimizerFields):
    """Shared defaults; each role section may override the optimisation fields (``llm.settings.shared``) and the
    micro-batch size."""

    output_dir: str = "output/ppo"
    seed: int = _f(42, low=0)
    learning_rate: float = with_default(OptimizerFields, "learning_rate", 1e-6)
    lr_warmup_steps: int = _f(0, "linear warmup over this many optimizer steps, then a constant rate", low=0)
    max_steps: int = _f(100, low=1)
    logging_steps: int = _f(1, low=1)
    save_steps: int = _f(0, "a checkpoint every this many steps; 0: none", low=0)
    save_total_limit: int | None = _f(None, "checkpoints kept (the oldest are deleted); null: all", low=1)
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = _f(
        False,
        "train in an output_dir holding another run's results (nothing is deleted); false: such a dir stops the run",
    )
    bf16: bool = field(
        default=False,
        metadata={
            "help": "bf16 weights for every model (frozen ones unless ref.dtype / reward.dtype say otherwise), no "
            "autocast; actor and critic AdamW on fp32 master weights: the O2 scheme"
        },
    )
    readout_chunk: int = _f(
        1024,
        "readouts per LM-head block in the log-probs, entropies and exact KL of actor and reference: the largest "
        "(tokens, vocab) block alive (1024 x 151,936 x 4 bytes = 622 MB); the numbers do not depend on it",
        low=1,
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "activation checkpointing of actor and critic in their update forwards (transformers' "
            "non-reentrant checkpointing): activations are recomputed in backward instead of stored; null (the "
            "default): on for a role with lora (LoRA's memory default), off for the others"
        },
    )
    adam_offload: bool = field(
        default=False,
        metadata={
            "help": "keep the AdamW state of actor and critic (fp32 master weights and both moments, ~12 B/param) "
            "in host memory and run the optimizer step there: gradients are copied to the host, the new weights "
            "back. Nothing to move when the role runs on the CPU (noted in the log)"
        },
    )
    report_to: str = "tensorboard"
    disable_tqdm: bool = False
    log_samples: int = _f(
        4,
        "every logging_steps step, the step's first this many samples (prompt, decoded response, score, reference, "
        "ended with EOS, token length) are appended to output_dir/samples.jsonl and, with report_to tensorboard, "
        "shown as text in TensorBoard; 0: none",
        low=0,
    )
    micro_batch_size: int = _f(8, "samples per forward (packed into one row) of every role", low=1)


@dataclass
class ModelSection:
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None
    init_from_config: bool = False
    micro_batch_size: int | None = _f(None, "samples per forward of this role; null: training.micro_batch_size", low=1)


@dataclass
class TrainedSection(ModelSection, LoraFields):
    """A role with an optimizer (actor, critic): each null field takes the ``training`` value; LoRA fields as the
    flat scripts' (``llm.settings.shared``)."""

    learning_rate: float | None = _f(None, low=0)
    weight_decay: float | None = _f(None, low=0)
    adam_beta1: float | None = _f(None, low=0)
    adam_beta2: float | None = _f(None, low=0)
    adam_epsilon: float | None = _f(None, low=0)
    max_grad_norm: float | None = _f(None, low=0)
    lr_warmup_steps: int | None = _f(None, low=0)


@dataclass
class ActorRolloutSection(TrainedSection):
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = _f(0, low=0)
    max_prompt_length: int = _f(512, low=1)
    max_response_length: int = _f(256, low=1)
    num_samples_per_step: int = _f(1, "responses sampled per prompt", low=1)
    ppo_mini_batch_size: int = _f(8, "samples per optimizer step (over all ranks of the role)", low=1)
    ppo_epochs: int = _f(1, low=1)
    clip_ratio: float = _f(0.2, low=0)
    clip_ratio_low: float | None = _f(None, low=0)
    clip_ratio_high: float | None = _f(None, low=0)
    shuffle_minibatch: bool = True
    entropy_coeff: float = _f(0.0, low=0)
    policy_loss: str = _f(
        POLICY_LOSSES.default,
        "the policy objective: a name registered in POLICY_LOSSES (llm.settings.registry); the built-ins, with their "
        "formulas and papers, are in llm/alignment/ppo/objectives.py",
    )
    clip_ratio_c: float = _f(3.0, "dual_clip: a negative advantage's loss is at most clip_ratio_c x |A| (> 1)", low=0)
    loss_agg_mode: str = _f(
        LOSS_AGG_MODES.default,
        "how per-token losses make the loss: a name registered in LOSS_AGG_MODES (llm.settings.registry); the "
        "built-ins are in llm/alignment/ppo/objectives.py. Counts are the whole mini-batch's, so micro-batches and "
        "ranks add up to one big batch",
    )
    mask_truncated_completions: bool = _f(
        False,
        "responses cut at max_response_length (no EOS) are left out of the policy loss (DAPO's overlong filtering; "
        "TRL's name); they still count in the rollout's statistics",
    )
    async_rollout: bool = _f(
        False,
        "one-step-off training: the rollout of step n+1 runs on a separate copy of the actor while step n updates, "
        "the copy taking the new weights after each update; old log-probs come from the policy that generated "
        "(staleness bounded by max_staleness, logged)",
    )
    max_staleness: int = _f(
        1, "async_rollout: how many updates a rollout's policy may lag behind (0: wait for each update, = sync)", low=0
    )
    ignore_eos: bool = False  # generate max_response_length tokens regardless of EOS (benchmarks)
    gather_weights_for_generation: bool = field(
        default=True,
        metadata={
            "help": "an actor (or rollout copy) sharded over an FSDP2 group all-gathers its full weights once per "
            "generate call and keeps them while decoding, instead of at every decoding step: every rank then "
            "holds the whole model during generation; false for a model whose full weights do not fit one device"
        },
    )
    rollout_engine: str = _f(
        "hf",
        "what generates the responses: hf (Hugging Face generate on the actor's model) or vllm (a vLLM engine in the "
        "generating role's process, taking the actor's weights after every update; pip install -r "
        "requirements-vllm.txt)",
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3,
        "vllm on CUDA: the share of the device the engine may take (weights + KV cache); the CPU backend "
        "reserves the KV cache the step's sequences need instead",
        low=0,
    )
    vllm_max_model_len: int | None = _f(
        None,
        "vllm: the longest prompt + response the engine holds; null: max_prompt_length + max_response_length "
        "(environment.max_episode_tokens with an environment)",
        low=1,
    )
    vllm_sleep: bool = _f(
        True, "vllm on CUDA, colocated: the engine sleeps (weights to host memory, KV cache freed) outside generation"
    )
    rollout_log_probs: bool = field(
        default=False,
        metadata={
            "help": "take the actor's old log-probs from the logits that generation computes anyway (as TRL "
            "does) instead of a separate packed forward after it: one actor forward less per step. The two "
            "differ by float rounding (KV-cached vs full forward; ~1e-6 in fp32, more in bf16). Not with "
            "kl_penalty 'full', which needs the actor's whole distribution: that keeps the forward"
        },
    )
    rollout_is_cap: float | None = _f(
        None,
        "truncated importance sampling for the engine / trainer mismatch (TIS, as verl and TRL): the old "
        "log-probs stay the trainer's forward, the engine also returns its own for the sampled tokens, and each "
        "token's policy loss is weighted by min(exp(old - engine), cap); logs rollout_is_weight and "
        "rollout_logprob_gap. null: off. Not with rollout_log_probs (the weights would be 1)",
        low=1,
    )


@dataclass
class CriticSection(TrainedSection):
    cliprange_value: float | None = _f(0.2, low=0)
    critic_mini_batch_size: int = _f(8, "samples per optimizer step (over all ranks of the role)", low=1)
    critic_update_epochs: int = _f(1, low=1)
    value_loss_coef: float = _f(1.0, low=0)


@dataclass
class FrozenModelSection(ModelSection):
    """A role whose model is not trained (reference, reward)."""

    dtype: str | None = field(
        default=None,
        metadata={
            "help": "weights of this frozen model: float32 or bfloat16 (half the memory, scores to bf16 "
            "precision); null: as the trained models (bfloat16 with training.bf16, else float32)"
        },
    )
    offload: bool = field(
        default=False,
        metadata={
            "help": "keep this frozen model in host memory between its forwards, moving it to its device for "
            "each call and back after; nothing to move when it runs on the CPU (noted in the log)"
        },
    )


@dataclass
class RefSection(FrozenModelSection):
    pass


@dataclass
class RewardSection(FrozenModelSection):
    type: str = _f(
        "rule", "a registered reward type (rewards/): orm | prm | generative_prm | implicit_prm | rule | http"
    )
    weight: float = _f(1.0, "this reward's weight in the total, sum(weight x reward) over the list of rewards (> 0)")
    name: str | None = _f(
        None, "a list of rewards: this one's name in the metrics (reward/NAME/mean); null: its type or rule"
    )
    rule: str = "llm.alignment.ppo.rewards.rule_functions:math_exact_match"
    url: str | None = _f(None, "type http: the scoring server, an http:// or https:// URL (redirects are not followed)")
    timeout: float = _f(30.0, "seconds one HTTP reward request may take in all (connect, send, whole answer)", low=0)
    max_retries: int = _f(2, "type http: retries of a failed request (connection error, timeout, 429, 5xx)", low=0)
    retry_backoff: float = _f(1.0, "type http: seconds before the first retry, doubled before each next one", low=0)
    max_response_bytes: int = _f(16 * 2**20, "type http: the largest answer read; a longer one is an error", low=1)
    step_separator: str = "\n"
    placeholder_token: str = "ки"
    reward_tokens: str = "+,-"
    prm_aggregation: str = "dense"  # rewards.PRM_AGGREGATIONS: dense | min | last | mean
    critique_samples: int = _f(1, "type generative_prm: critiques per response, their verdicts averaged", low=1)
    max_critique_tokens: int = _f(64, "type generative_prm: the most tokens of one step's critique", low=0)
    critique_temperature: float = _f(0.0, "type generative_prm: the critiques' temperature; 0: greedy", low=0)
    implicit_granularity: str = _f(
        "token", "implicit_prm, dense: token (beta * log(pi/pi_ref) per token) | step (per step)"
    )
    normalize_reward: bool = False
    reward_clip: float | None = _f(None, low=0)
    overlong_buffer_len: int = _f(
        0,
        "DAPO's soft overlong punishment: a response longer than max_response_length - overlong_buffer_len tokens "
        "loses overlong_penalty_factor x (its excess / overlong_buffer_len) of reward, up to the whole factor at "
        "max_response_length; 0: off",
        low=0,
    )
    overlong_penalty_factor: float = _f(1.0, "the largest overlong punishment (at max_response_length)", low=0)
    # reward_tokens as (positive, negative), parsed once here (not a setting: derived, never fingerprinted)
    label_tokens: tuple[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """What the lower bounds cannot say: the URL scheme, the label tokens, upper bounds (a run must not wait
        for ever)."""
        self.label_tokens = reward_token_pair(self.reward_tokens, "reward.reward_tokens")
        if self.url is not None:
            check_reward_url(self.url)
        if self.critique_samples > 1 and self.critique_temperature == 0:
            raise UserError(
                "reward.critique_samples > 1 with reward.critique_temperature 0: greedy critiques are all the same; "
                "set reward.critique_temperature > 0 or reward.critique_samples 1"
            )
        for name, high in (("max_retries", 10), ("retry_backoff", 60.0), ("max_response_bytes", 2**30)):
            if getattr(self, name) > high:
                raise UserError(f"reward.{name} must be at most {high:g}, got {getattr(self, name):g}")


@dataclass
class KLCtrlSection:
    type: str = "fixed"
    kl_coef: float = _f(0.05, low=0)
    target_kl: float = _f(6.0, low=0)
    horizon: float = _f(10000.0, low=0)


@dataclass
class AlgorithmSection:
    adv_estimator: str = "gae"
    gamma: float = _f(1.0, low=0)
    lam: float = _f(0.95, low=0)
    kl_penalty: str = "kl"
    use_kl_in_reward: bool = True
    kl_loss_coef: float = _f(0.0, "> 0: KL as a loss term (GRPO style) instead of / besides the reward", low=0)
    kl_ctrl: KLCtrlSection = field(default_factory=KLCtrlSection)
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None
    norm_adv_by_std_in_grpo: bool = _f(
        True,
        "grpo: divide each group's centred scores by their standard deviation; false: Dr. GRPO's unnormalised "
        "advantage (Liu et al. 2025), r - mean(group)",
    )
    filter_groups: bool = _f(
        False,
        "DAPO's dynamic sampling: groups whose samples all have the same reward (advantage 0, no gradient) are "
        "dropped and more prompts are generated until the batch is full (grouped estimators only)",
    )
    # filter_groups: also drop a group unless its mean reward (the reward's own values) lies in [low, high], e.g.
    # [0.2, 0.8], PRIME's online prompt filtering (verl's accuracy bounds); null: only all-equal groups are dropped
    filter_groups_range: list[float] | None = None
    max_num_gen_batches: int = _f(
        10,
        "filter_groups: the most generation rounds per step (the first included); then the step trains on what it "
        "has, logged",
        low=1,
    )

    @property
    def kl_in_reward(self) -> bool:
        """A KL penalty in the reward: ``use_kl_in_reward`` with a coefficient that is not fixed at 0."""
        return self.use_kl_in_reward and not (self.kl_ctrl.type == "fixed" and self.kl_ctrl.kl_coef == 0)

    @property
    def uses_reference(self) -> bool:
        """A KL term (in the reward, or ``kl_loss_coef`` > 0) reads the reference; without one it is not built or
        run, as verl (``need_reference_policy``) and TRL's GRPO (``beta`` 0) skip it."""
        return self.kl_in_reward or self.kl_loss_coef > 0


@dataclass
class DataSection:
    train_dataset_path: str | None = None
    dataset_probs: str | None = None
    rollout_batch_size: int = _f(8, "prompts per step", low=1)
    use_chat_template: bool | None = _f(
        None,
        "render the prompts with the actor tokenizer's chat template (true) or as plain text (false); null: on "
        "exactly when that tokenizer has a chat template (logged)",
    )
    shuffle: bool = _f(True, "draw the prompts in a seeded random order per pass; false: in file order")
    map_keys: dict[str, str] | None = field(
        default=None,
        metadata={
            "help": 'rename the columns of the prompt file as it is read, {"field this project reads": "column in '
            'the file"} (MindSpeed\'s --map-keys), e.g. {"src": "question", "tgt": "answer"}'
        },
    )


ROLES = ("actor_rollout", "ref", "critic", "reward")


@dataclass
class ResourcePool:
    """Where the roles run. Default: all four in this process (every amount 1, ``use_ray`` false).

    With ``use_ray`` each role, or each ``colocate`` group, runs in Ray actor processes placed through
    one placement group: one process for a share of a device (< 1) or one device, N processes forming
    an FSDP2 group for N devices. The amounts count ``device`` units.
    """

    actor_rollout: float = _f(
        1,
        "devices for the actor (its training and, without a rollout copy, its generation); with Ray < 1 is a "
        "share of one device and N > 1 a group of N actors sharding the model with FSDP2",
        low=0,
    )
    ref: float = _f(1, "devices for the frozen reference policy (Ray: a share < 1, or N > 1 for FSDP2)", 0)
    critic: float = _f(1, "devices for the critic, value model and optimizer (Ray: a share < 1, or N > 1 for FSDP2)", 0)
    reward: float = _f(1, "devices for the reward role: model, rule or HTTP client (Ray: a share < 1, or N > 1)", 0)
    rollout: float = _f(
        0,
        "devices for a separate generation copy of the actor that receives its weights after every update "
        "(Ray; bounded by weight_sync_timeout); 0: the actor generates with its own weights",
        low=0,
    )
    use_ray: bool = _f(False, "run the roles in Ray actors (pip install ray); false: all roles in this process")
    device: str = _f(
        "cpu", "what the amounts count and where role models run: cpu (Ray CPUs) or gpu (Ray GPUs, models on CUDA)"
    )
    colocate: list[list[str]] = field(
        default_factory=list,
        metadata={
            "help": 'groups of roles sharing one Ray actor process and its devices, e.g. [["actor_rollout", '
            '"ref"], ["critic", "reward"]]; the members of a group need equal amounts'
        },
    )
    address: str | None = _f(
        None,
        "Ray cluster: null joins the cluster `ray start` made on this node (else starts a local one); 'auto' "
        "must find a running cluster; 'HOST:PORT' the head node of a cluster",
    )
    call_timeout: float = _f(
        1800.0, "seconds a role call (build, generate, score, update, save) may take before the run stops naming it"
    )
    weight_sync_timeout: float = _f(
        300.0, "seconds the actor -> rollout copy weight sync may take before the run stops naming it"
    )
    concurrent_roles: bool = _f(
        True,
        "with Ray: the independent calls of a phase run at the same time in their own actors (scoring: actor "
        "and reference log-probs, values, reward; update: actor and critic); colocated roles still take turns "
        "in their shared process. Same numbers either way; false: one call after another",
    )

    def amount(self, role: str) -> float:
        return getattr(self, role)


SECTIONS: dict[str, type] = {
    "training": TrainingSection,
    "actor_rollout": ActorRolloutSection,
    "critic": CriticSection,
    "ref": RefSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "data": DataSection,
    "resource_pool": ResourcePool,
}
# sections that are None unless the file or the command line gives them
OPTIONAL_SECTIONS: dict[str, type] = {"environment": EnvironmentConfig, "prime": PrimeSection}


@dataclass
class PPOConfig:
    training: TrainingSection
    actor_rollout: ActorRolloutSection
    critic: CriticSection
    ref: RefSection
    reward: RewardSection
    algorithm: AlgorithmSection
    data: DataSection
    resource_pool: ResourcePool
    environment: EnvironmentConfig | None = None  # multi-turn episodes (llm.settings.environment); None: single-turn
    prime: PrimeSection | None = None  # PRIME's online implicit PRM (llm.settings.prime); None: none
    # ``reward`` given as a list: its entries after the first (``reward`` is the first); llm.settings.reward_list
    extra_rewards: tuple[RewardSection, ...] = ()
    source: str = ""  # the config file, for messages
    notes: list[str] = field(default_factory=list)  # lines for the log: what a MindSpeed name became, ...

    @property
    def rewards(self) -> tuple[RewardSection, ...]:
        """Every reward section: the one ``reward``, or the entries of a list (weighted and summed)."""
        return (self.reward, *self.extra_rewards)

    @property
    def clip_low(self) -> float:
        a = self.actor_rollout
        return a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low

    @property
    def clip_high(self) -> float:
        a = self.actor_rollout
        return a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high

    def optim(self, role: str, name: str) -> Any:
        """An optimisation setting of a trained role: its own value, else the ``training`` one."""
        value = getattr(getattr(self, role), name)
        return getattr(self.training, name) if value is None else value

    def lr(self, role: str) -> float:
        return self.optim(role, "learning_rate")

    def micro(self, role: str) -> int:
        """Samples per forward of ``role`` (``rollout``: the actor's)."""
        value = getattr(self, "actor_rollout" if role == "rollout" else role).micro_batch_size
        return self.training.micro_batch_size if value is None else value

    @property
    def on_policy_update(self) -> bool:
        """The actor takes one optimizer step over the whole batch right after its rollout (``ppo_epochs`` 1, one
        mini-batch): the ratio's old log-probs then equal the update's own forward, detached, so the separate
        forward that computes them is skipped, and the update hands them back for the KL statistics (TRL's
        GRPO with ``num_iterations`` 1 does the same). Not with a KL in the reward (needed before the
        advantages), the exact KL (``kl_penalty: full``), the engine's log-probs or TIS (compared with the
        trainer's forward), nor an FSDP2 actor group (each rank sees a share of the batch)."""
        a, alg = self.actor_rollout, self.algorithm
        return (
            a.ppo_epochs == 1
            and a.ppo_mini_batch_size == self.data.rollout_batch_size * a.num_samples_per_step
            and not alg.kl_in_reward
            and alg.kl_penalty != "full"
            and a.rollout_is_cap is None
            and not a.rollout_log_probs
            and self.resource_pool.actor_rollout <= 1
            and not a.async_rollout  # the old log-probs are the generating (older) policy's, not the update's
        )

    @property
    def uses_critic(self) -> bool:
        estimator = ADV_ESTIMATORS.get(self.algorithm.adv_estimator)  # None: refused by validate_ppo_config
        return estimator is not None and estimator.needs_critic


LORA_ROLES = ("actor_rollout", "critic")  # the trained roles, which may train LoRA adapters


def shares_actor_base(c: PPOConfig) -> bool:
    """The reference is the LoRA actor's own base (``ref`` names no other model): the adapter disabled."""
    a = c.actor_rollout
    return a.lora and c.ref.model_name_or_path in (None, a.model_name_or_path)
