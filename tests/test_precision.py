"""bf16 mixed precision in every trainer (reward models, SFT, DPO, PPO roles), against fp32 on the same tiny
model and data: fp16_opt_level O1 (fp32 weights, bf16 autocast) and O2 (bf16 weights, fp32 AdamW masters);
PPO's training.bf16 (bf16 models, fp32 AdamW masters). Scheme: llm/utils/precision.py.

Tolerance. bf16 keeps 8 significant bits: one rounding is off by at most u = 2^-8 (0.39%) of the value.
The 2-layer models here round ~12 times on the way from the embedding to a logit (per layer: the norm,
q/k/v, the attention output, o_proj, the norm, gate/up, act x up, down_proj; then the final norm and the
head), in O2 once more for the weights. Independent roundings add up like a random walk, so a logit
comes out within ~sqrt(12) u ~ 3.5 u of its fp32 value, relative to the logits' scale L (all adding up
in the worst case: 12 u). At this random init L <= ~1 (measured max |logit| 1.05 SFT, 0.80 PRM, ORM
scores 0.34). Each loss moves by at most 2 x the largest logit error: cross-entropy's gradient in the
logits is softmax - one-hot (L1 norm <= 2), -log sigmoid(s_c - s_r) has slope <= 1 in each of two scores.
So per item, and for the mean over items,
    |loss_bf16 - loss_fp32| <= 2 x 3.5 u x L ~ 0.027   (LOSS_TOL).
Means over tens to hundreds of items average most of the independent part away; the bound is asserted
as is. Token log-probs (PPO) are l_t - logsumexp(l): the same 2 x 3.5 u L. Steps 2-3 add AdamW steps
(lr 1e-3) from bf16 gradients: ~lr x sign(g) per weight, the same sign except where g is near zero, where
a flipped step moves the loss by ~g x lr, next to nothing: the same bound holds.
DPO: at step 1 policy and reference are one model computed the same way: loss log 2 exactly, in every
precision. After that the margin is beta x a sum of ~4 x 50 token log-probs each within ~0.027, mostly
independent: sqrt(200) x 0.027 x 0.1 ~ 0.04, times sigmoid's slope 1/4 at 0: ~0.01 < LOSS_TOL.
Measured (max over 3 steps): PRM 1.8e-3 (O1) / 1.6e-3 (O2), ORM 1.9e-3 / 4.2e-4, SFT 2.5e-4 / 2.3e-3,
DPO 9.6e-5 / 4.8e-4; PPO bf16: log-probs 4.3e-3, values 3.9e-3, policy loss 2.1e-3, value loss 1.2e-3.
Each run must also differ from fp32 (so the test notices bf16 not being used) and be finite.
"""

import itertools
import math
import os

import pytest
import torch

from llm.alignment.dpo.trainer import DPOTrainer, collate_pairs
from llm.alignment.lm import load_causal_lm, weights_dtype
from llm.alignment.ppo.build import Place, PPOContext, build_actor, build_critic
from llm.alignment.ppo.interfaces import PolicyBatch, ValueBatch
from llm.alignment.ppo.offload import OffloadedTrainableRole
from llm.alignment.ppo.optim import TrainableRole
from llm.alignment.rm.build import build_reward_model
from llm.alignment.rm.prm_trainer import PRMTrainer
from llm.alignment.sft.trainer import SFTTrainer
from llm.data.encode_lm import encode_pair_for_lm, encode_sft
from llm.data.encode_reward import encode_pair_for_scores, encode_prm
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import collate, pack
from llm.data.readers import iter_records
from llm.settings.dpo import DPOTrainingArguments
from llm.settings.flat import ModelArgument
from llm.settings.load import parse_ppo_config
from llm.settings.reward import RewardModelArgument, RewardTrainingArguments
from llm.utils import precision as precision_module
from llm.utils.errors import UserError
from llm.utils.precision import MasterWeightAdamW
from tests.helpers import ROOT, reward_trainer, tiny_model, tokenizer
from tests.test_ppo_memory import fixed_samples
from tests.test_ppo_run import config as ppo_config

SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
SFT_TRAIN = os.path.join(ROOT, "llm", "data", "sample_sft", "sft_train.jsonl")
TINY_LLAMA = os.path.join(ROOT, "llm", "assets", "tiny-llama")
TINY_PRM = os.path.join(ROOT, "llm", "assets", "tiny-prm")
U = 2.0**-8  # bf16 unit roundoff
LOSS_TOL = 2 * 3.5 * U * 1.0  # 2 x sqrt(12) u x L with L = 1: see the module docstring
PRECISIONS = {"fp32": {}, "O1": {"bf16": True, "fp16_opt_level": "O1"}, "O2": {"bf16": True, "fp16_opt_level": "O2"}}


def training_args(tmp_path, precision: str, arguments=RewardTrainingArguments, **kw) -> RewardTrainingArguments:
    base = {
        "output_dir": str(tmp_path / precision),
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "logging_steps": 1,
        "max_steps": 3,
        "per_device_train_batch_size": 1,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "seed": 0,
        "dataloader_num_workers": 0,
        **PRECISIONS.get(precision, {}),
    }
    base.update(kw)
    return arguments(**base)  # the shared TrainingArguments plus the reward fields (DPO's: DPOTrainingArguments)


def records(path, kind, n):
    return list(itertools.islice(iter_records(path, kind), n))


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def check_weights_and_optimizer(trainer, precision: str) -> None:
    """O1 trains fp32 weights, O2 bf16 ones whose AdamW holds fp32 masters equal to them up to rounding."""
    dtypes = {p.dtype for p in trainer.model.parameters()}
    assert dtypes == {torch.bfloat16 if precision == "O2" else torch.float32}, dtypes
    optimizer = trainer._raw_optimizer()
    assert isinstance(optimizer, MasterWeightAdamW)
    for p in trainer.model.parameters():
        state = optimizer.state[p]
        if precision == "O2":
            assert state["master"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
            assert torch.equal(p, state["master"].to(torch.bfloat16))
        else:
            assert "master" not in state


def compare(runs: dict[str, list[float]], bound: float) -> dict[str, float]:
    """Max |loss - fp32 loss| per precision; each within ``bound``, finite, and not fp32 itself."""
    ref = runs["fp32"]
    diffs = {}
    for precision in ("O1", "O2"):
        got = runs[precision]
        assert len(got) == len(ref) and all(math.isfinite(x) for x in got), got
        diffs[precision] = max(abs(a - b) for a, b in zip(got, ref))
        assert 0 < diffs[precision] <= bound, (precision, got, ref)
    return diffs


# --- reward models ------------------------------------------------------------------------------------
def reward_rows(process_reward: bool):
    tok = tokenizer()
    cfg = EncodeConfig(512, 128)
    counter = OverlongCounter()
    if process_reward:
        ph = tok.convert_tokens_to_ids("ки")
        recs = records(os.path.join(SAMPLE, "prm_train.jsonl"), "prm", 12)
        examples = [encode_prm(r, tok, cfg, ph, "ки", ("+", "-"), i, counter) for i, r in enumerate(recs)]
    else:
        recs = records(os.path.join(SAMPLE, "pairs_train.jsonl"), "pair", 12)
        examples = [encode_pair_for_scores(r, tok, cfg, i, counter) for i, r in enumerate(recs)]
    rows, _ = pack(examples, 512, "greedy")
    return rows


@pytest.mark.parametrize("process_reward", [True, False], ids=["prm", "orm"])
def test_reward_model_bf16_o1_o2_close_to_fp32(tmp_path, process_reward):
    tok = tokenizer()
    rows = reward_rows(process_reward)
    model_args = RewardModelArgument(
        model_name_or_path=TINY_PRM if process_reward else TINY_LLAMA, init_from_config=True
    )
    runs = {}
    for precision in PRECISIONS:
        args = training_args(tmp_path, precision, process_reward=process_reward)
        model, ids = build_reward_model(model_args, args, tok)
        trainer = reward_trainer(
            process_reward,
            model=model,
            args=args,
            train_dataset=rows,
            data_collator=lambda r: collate(r, pad_token_id=tok.pad_token_id),
            reward_token_ids=ids,
        )
        trainer.train()
        runs[precision] = losses(trainer)
        if precision != "fp32":
            check_weights_and_optimizer(trainer, precision)
    compare(runs, LOSS_TOL)


# --- SFT ----------------------------------------------------------------------------------------------
def test_sft_bf16_o1_o2_close_to_fp32_in_training_and_evaluation_only(tmp_path):
    tok = tokenizer()
    cfg = EncodeConfig(512, 128)
    counter = OverlongCounter()
    examples = [encode_sft(r, tok, cfg, i, counter) for i, r in enumerate(records(SFT_TRAIN, "sft", 12))]
    rows, _ = pack(examples, 512, "greedy")
    runs, evals = {}, {}
    for precision in PRECISIONS:
        args = training_args(tmp_path, precision)
        model = load_causal_lm(TINY_LLAMA, args, tok, init_from_config=True)
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=rows,
            eval_dataset=rows,
            data_collator=lambda r: collate(r, pad_token_id=0),
        )
        # before train(): accelerate has not wrapped the forward in its autocast yet (an evaluation-only run)
        evals[precision] = [trainer.evaluate()["eval_loss"]]
        trainer.train()
        runs[precision] = losses(trainer)
        if precision != "fp32":
            check_weights_and_optimizer(trainer, precision)
    compare(runs, LOSS_TOL)
    compare(evals, LOSS_TOL)


FP16 = {"fp16_O1": {"fp16": True, "fp16_opt_level": "O1"}, "fp16_O2": {"fp16": True, "fp16_opt_level": "O2"}}
U16 = 2.0**-11  # fp16 unit roundoff


def test_sft_fp16_o1_o2_close_to_fp32_with_loss_scaling_on_cpu(tmp_path):
    """fp16 O1 (fp32 weights) and O2 (fp16 weights, fp32 masters), fp16 autocast and our LossScaler, on a CPU.
    fp16 keeps 11 significant bits (u = 2^-11): the module docstring's bound with that u, 2 x 3.5 u x L. The
    scale starts at 2^16; these small gradients times 2^16 stay finite, so no step is skipped and all three
    steps compare. The scale sits in the optimizer's param groups."""
    tok = tokenizer()
    cfg = EncodeConfig(512, 128)
    examples = [encode_sft(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(records(SFT_TRAIN, "sft", 12))]
    rows, _ = pack(examples, 512, "greedy")
    runs = {}
    for precision in ("fp32", *FP16):
        args = training_args(tmp_path, precision, **FP16.get(precision, {}))
        model = load_causal_lm(TINY_LLAMA, args, tok, init_from_config=True)
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=rows, data_collator=lambda r: collate(r, pad_token_id=0)
        )
        trainer.train()
        runs[precision] = losses(trainer)
        if precision == "fp32":
            continue
        optimizer = trainer._raw_optimizer()
        assert {p.dtype for p in trainer.model.parameters()} == {
            torch.float16 if precision == "fp16_O2" else torch.float32
        }
        assert optimizer.param_groups[0]["loss_scale"] == 2.0**16
        assert optimizer.param_groups[0]["loss_scale_good_steps"] == 3  # three finite steps, none skipped
        if precision == "fp16_O2":
            for p in trainer.model.parameters():
                assert torch.equal(p, optimizer.state[p]["master"].to(torch.float16))
    for precision in FP16:
        got = runs[precision]
        assert len(got) == 3 and all(math.isfinite(x) for x in got), got
        diff = max(abs(a - b) for a, b in zip(got, runs["fp32"]))
        assert 0 < diff <= 2 * 3.5 * U16, (precision, got, runs["fp32"])


def _fp16_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)).half()


def test_loss_scaler_unscales_into_fp32_masters_clips_and_matches_fp32_adamw():
    """One fp16 step through LossScaler + MasterWeightAdamW equals torch's AdamW on fp32 copies of the weights
    given the same (unscaled, clipped) fp32 gradients: the scale is divided out exactly (a power of two), the
    norm is the fp32 norm of the unscaled gradients, clipping multiplies them by max_norm / norm."""
    from llm.utils.precision import LossScaler

    model = _fp16_model(0)
    ref = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = MasterWeightAdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=0.1)
    scaler = LossScaler(init_scale=2.0**10)
    scaler.bind(opt)
    x = torch.randn(8, 4).half()
    loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    grads = [p.grad.float() / 2.0**10 for p in model.parameters()]  # exact: dividing by a power of two
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    got = scaler.unscale_and_clip(opt, max_norm=float(norm) / 2)
    assert float(got) == pytest.approx(float(norm), rel=1e-6)
    for p, g in zip(model.parameters(), grads):
        assert opt.master_grads[p].dtype == torch.float32
        torch.testing.assert_close(opt.master_grads[p], g * (float(norm) / 2) / (float(norm) + 1e-6))
    for r, g in zip(ref, grads):
        r.grad = g * (float(norm) / 2) / (float(norm) + 1e-6)
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(opt.state[p]["master"], r.detach(), rtol=0, atol=1e-7)
        assert torch.equal(p, r.detach().half())
    assert opt.param_groups[0]["loss_scale"] == 2.0**10 and opt.param_groups[0]["loss_scale_good_steps"] == 1


def test_loss_scaler_skips_an_overflowing_step_halves_the_scale_and_grows_after_the_interval():
    from llm.utils.precision import LossScaler

    model = _fp16_model(1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = MasterWeightAdamW(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**15, growth_interval=2)
    scaler.bind(opt)
    loss = model(torch.full((2, 4), 100.0).half()).float().sum() * 1e3  # x 2^15: beyond fp16's 65504
    scaler.scale(loss).backward()
    assert not math.isfinite(float(scaler.unscale_and_clip(opt, 1.0)))
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved
    assert opt.state == {} or all("master" not in s for s in opt.state.values())  # no AdamW state either
    assert opt.param_groups[0]["loss_scale"] == 2.0**14
    for expected in (2.0**14, 2.0**15):  # two finite steps: the scale doubles after the second
        model.zero_grad()
        scaler.scale(model(torch.randn(2, 4).half()).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert opt.param_groups[0]["loss_scale"] == expected
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- DPO ----------------------------------------------------------------------------------------------
def test_dpo_bf16_o1_o2_close_to_fp32_with_the_reference_in_the_same_precision(tmp_path):
    tok = tokenizer()
    cfg = EncodeConfig(512, 128)
    counter = OverlongCounter()
    recs = records(os.path.join(SAMPLE, "pairs_train.jsonl"), "pair", 12)
    examples = [encode_pair_for_lm(r, tok, cfg, i, counter) for i, r in enumerate(recs)]
    rows, _ = pack(examples, 512, "greedy")
    runs = {}
    for precision in PRECISIONS:
        args = training_args(tmp_path, precision, DPOTrainingArguments)
        model = load_causal_lm(TINY_LLAMA, args, tok, init_from_config=True)
        ref = load_causal_lm(TINY_LLAMA, args, tok, init_from_config=True)
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=rows,
            data_collator=lambda r: collate_pairs(r, pad_token_id=0),
            ref_model=ref,
        )
        trainer.train()
        runs[precision] = losses(trainer)
        # step 1: policy == reference, computed the same way (same precision, same autocast) -> margin 0
        assert runs[precision][0] == pytest.approx(math.log(2), abs=1e-6), runs[precision]
        if precision != "fp32":
            check_weights_and_optimizer(trainer, precision)
            assert {p.dtype for p in trainer.ref_model.parameters()} == {weights_dtype(args)}
    compare(runs, LOSS_TOL)


def test_o2_resume_keeps_the_fp32_masters(tmp_path):
    """4 O2 steps saving at 2; a run resumed from checkpoint-2 continues with the same losses and weights,
    which it would not if the masters or moments had come back rounded to bf16."""
    tok = tokenizer()
    rows = reward_rows(process_reward=True)
    model_args = RewardModelArgument(model_name_or_path=TINY_PRM, init_from_config=True)

    def run(out, resume=None):
        args = training_args(tmp_path, "O2", output_dir=str(out), process_reward=True, max_steps=4)
        args.save_strategy, args.save_steps = "steps", 2  # HF derives its save settings at construction
        model, ids = build_reward_model(model_args, args, tok)
        trainer = PRMTrainer(
            model=model,
            args=args,
            train_dataset=rows,
            data_collator=lambda r: collate(r, pad_token_id=tok.pad_token_id),
            reward_token_ids=ids,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert losses(resumed)[2:] == losses(full)[2:]  # (the first two come back with trainer_state.json)
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    check_weights_and_optimizer(resumed, "O2")


def test_fp16_o2_resume_keeps_the_loss_scale_state(tmp_path):
    """The loss scaler's state rides in the optimizer's param groups: resumed at checkpoint-2 of 4, the run
    ends with 4 finite steps counted (2 restored + 2), not 2, and the same losses and weights."""
    tok = tokenizer()
    examples = [
        encode_sft(r, tok, EncodeConfig(512, 128), i, OverlongCounter())
        for i, r in enumerate(records(SFT_TRAIN, "sft", 12))
    ]
    rows, _ = pack(examples, 512, "greedy")

    def run(out, resume=None):
        args = training_args(tmp_path, "fp32", output_dir=str(out), max_steps=4, **FP16["fp16_O2"])
        args.save_strategy, args.save_steps = "steps", 2
        model = load_causal_lm(TINY_LLAMA, args, tok, init_from_config=True)
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=rows, data_collator=lambda r: collate(r, pad_token_id=0)
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert losses(resumed)[2:] == losses(full)[2:]
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    group = resumed._raw_optimizer().param_groups[0]
    assert (group["loss_scale"], group["loss_scale_good_steps"]) == (2.0**16, 4)


# --- PPO ----------------------------------------------------------------------------------------------
def test_ppo_roles_bf16_close_to_fp32(tmp_path):
    """training.bf16: actor and critic in bf16 (no autocast; AdamW on fp32 masters), against fp32 roles on the
    same samples: log-probs, values, and one update's policy and value losses (same old log-probs / values,
    advantages and returns: the fp32 roles')."""
    samples = fixed_samples()
    mask = samples.response_mask()
    gen = torch.Generator().manual_seed(0)
    advantages = torch.randn(mask.shape, generator=gen) * mask
    returns = torch.randn(mask.shape, generator=gen) * mask
    order = [list(range(len(samples)))]
    out = {}
    for precision in ("fp32", "bf16"):
        c = parse_ppo_config([ppo_config(tmp_path, training={"bf16": precision == "bf16"})])
        run = PPOContext.load(c)
        actor, critic = build_actor(c, Place(), run), build_critic(c, Place(), run)
        logp, values = actor.log_probs(samples), critic.values(samples)
        if precision == "fp32":
            old_logp, old_values = logp, values
        policy = actor.update(PolicyBatch(samples, mask, old_logp, advantages, None), order)
        value = critic.update(ValueBatch(samples, mask, old_values, returns), order)
        out[precision] = (logp, values, policy.metrics["policy_loss"], value.metrics["value_loss"])
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for role in (actor, critic):
            assert {p.dtype for p in role.model.parameters()} == {dtype}
            assert isinstance(role.optim.optimizer, MasterWeightAdamW)
            for p in role.model.parameters():
                state = role.optim.optimizer.state[p]
                assert ("master" in state) == (precision == "bf16")
                if precision == "bf16":
                    assert state["master"].dtype == torch.float32 and torch.equal(p, state["master"].to(dtype))
    m = mask.bool()
    logp_diff = (out["fp32"][0] - out["bf16"][0])[m].abs().max().item()
    value_diff = (out["fp32"][1] - out["bf16"][1])[m].abs().max().item()
    policy_diff, value_loss_diff = (abs(out["fp32"][k] - out["bf16"][k]) for k in (2, 3))
    assert 0 < logp_diff <= LOSS_TOL and 0 < value_diff <= LOSS_TOL
    assert 0 < policy_diff <= LOSS_TOL and 0 < value_loss_diff <= LOSS_TOL


# --- the optimizer ------------------------------------------------------------------------------------
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _loss(model, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 600, (2, 9), generator=gen)
    return model(input_ids=ids, labels=ids).loss


def test_master_weight_adamw_is_adamw_for_fp32_and_on_the_masters_for_bf16():
    # fp32 parameters: torch's AdamW itself
    plain, ours = tiny_model(seed=1), tiny_model(seed=1)
    opt_plain, opt_ours = torch.optim.AdamW(plain.parameters(), **ADAMW), MasterWeightAdamW(ours.parameters(), **ADAMW)
    # bf16 parameters: the masters follow torch's AdamW on fp32 weights fed the same gradients, bit for bit
    half = tiny_model(seed=1).to(torch.bfloat16)
    shadow = [p.detach().float().requires_grad_() for p in half.parameters()]
    opt_half = MasterWeightAdamW(half.parameters(), **ADAMW)
    opt_shadow = torch.optim.AdamW(shadow, foreach=False, **ADAMW)
    for step in range(3):
        for model, opt in ((plain, opt_plain), (ours, opt_ours), (half, opt_half)):
            _loss(model, step).backward()
        for p, s in zip(half.parameters(), shadow):
            s.grad = p.grad.float()
        for opt in (opt_plain, opt_ours, opt_half, opt_shadow):
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name
    for p, s in zip(half.parameters(), shadow):
        master = opt_half.state[p]["master"]
        assert p.dtype == torch.bfloat16 and torch.equal(master, s) and torch.equal(p, s.to(torch.bfloat16))


@pytest.mark.parametrize("chunk", [1 << 24, 1])
def test_fused_master_weight_adamw_is_torchs_fused_adamw_on_the_masters(monkeypatch, chunk):
    """fused=True (what the PPO roles ask for on a CPU): one fused kernel over the masters, in chunks of
    FUSED_CHUNK parameters (1: a call per parameter), bit for bit torch's fused AdamW on fp32 shadows."""
    monkeypatch.setattr(precision_module, "FUSED_CHUNK", chunk)
    half = tiny_model(seed=1).to(torch.bfloat16)
    shadow = [p.detach().float().requires_grad_() for p in half.parameters()]
    opt_half = MasterWeightAdamW(half.parameters(), fused=True, **ADAMW)
    opt_shadow = torch.optim.AdamW(shadow, fused=True, **ADAMW)
    for step in range(3):
        _loss(half, step).backward()
        for p, s in zip(half.parameters(), shadow):
            s.grad = p.grad.float()
        for opt in (opt_half, opt_shadow):
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, s in zip(half.parameters(), shadow):
        state = opt_half.state[p]
        assert torch.equal(state["master"], s) and torch.equal(p, s.to(torch.bfloat16))
        assert float(state["step"]) == 3.0 and state["exp_avg"].dtype == torch.float32


def test_master_weights_keep_updates_below_bf16_resolution_and_survive_a_reload():
    # weight 1.0: bf16 spacing 2^-7, so an Adam step of lr = 1e-3 (< half the spacing) rounds away in bf16
    def make(cls):
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        return p, cls([p], lr=1e-3, weight_decay=0.0)

    (p_plain, plain), (p_ours, ours) = make(torch.optim.AdamW), make(MasterWeightAdamW)
    for _ in range(10):
        for p, opt in ((p_plain, plain), (p_ours, ours)):
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.equal(p_plain, torch.ones_like(p_plain))  # plain bf16 AdamW: stuck
    assert torch.allclose(ours.state[p_ours]["master"], torch.full((4,), 0.99), atol=1e-6)
    assert torch.equal(p_ours, torch.full((4,), 0.99).to(torch.bfloat16))
    # a reload keeps the masters and moments in fp32 (Optimizer.load_state_dict would cast them to bf16)
    p_back, back = make(MasterWeightAdamW)
    with torch.no_grad():
        p_back.copy_(p_ours)
    back.load_state_dict(ours.state_dict())
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert back.state[p_back][name].dtype == torch.float32
        assert torch.equal(back.state[p_back][name], ours.state[p_ours][name])


def test_bf16_checkpoints_move_between_plain_and_offloaded_roles_with_their_masters(tmp_path):
    """PPO's bf16 actor/critic: the plain role (MasterWeightAdamW) and adam_offload's (HostAdamW) save the same
    name-keyed state with fp32 masters, so either resumes the other's exactly."""
    tok = tokenizer()
    role_args = (1e-2, 0.1, (0.9, 0.999), 1e-8, 1.0, 2)
    for source_cls, target_cls in ((TrainableRole, OffloadedTrainableRole), (OffloadedTrainableRole, TrainableRole)):
        model = tiny_model(seed=4).to(torch.bfloat16)
        source = source_cls(model, *role_args)
        for step in range(2):
            _loss(model, step).backward()
            source.step()
        directory = str(tmp_path / source_cls.__name__)
        source.save(directory, tok, with_optimizer=True)
        target = target_cls(tiny_model(seed=9).to(torch.bfloat16), *role_args)
        target.load(directory)
        for role in (source, target):  # one more step each: the same update if masters and moments came across
            _loss(role.model, 7).backward()
            role.step()
        for (name, a), b in zip(model.named_parameters(), target.model.parameters()):
            assert torch.equal(a, b), name


def test_fp16_o2_needs_adamw(tmp_path):
    from llm.settings.flat import DataArgument, validate_arguments

    args = training_args(tmp_path, "fp32", fp16=True, fp16_opt_level="O2", optim="sgd")
    assert weights_dtype(args) == torch.float16
    with pytest.raises(UserError, match="needs AdamW"):
        validate_arguments(ModelArgument(model_name_or_path=TINY_LLAMA), DataArgument(), args)


def test_an_fp32_run_on_a_cpu_with_native_bf16_gets_a_hint_and_keeps_fp32(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_has_bf16", lambda: True)
    assert "bf16: true" in precision_module.cpu_bf16_hint(False, False, True)
    assert precision_module.cpu_bf16_hint(True, False, True) is None  # already bf16
    assert precision_module.cpu_bf16_hint(False, True, True) is None  # fp16
    monkeypatch.setattr(precision_module, "cpu_has_bf16", lambda: False)
    assert precision_module.cpu_bf16_hint(False, False, True) is None  # emulated bf16 is slower: no hint


def test_models_given_to_build_from_models_follow_training_bf16(tmp_path):
    """The programmatic API casts as the loader does: training.bf16 puts policy, critic and (no dtype of their
    own) reference and reward in bf16, with fp32 AdamW masters; a frozen role's dtype wins; without bf16 the
    models stay as given (fp32)."""
    from transformers import AutoModelForSequenceClassification as SeqCls

    from llm.alignment.ppo.build import build_from_models
    from llm.alignment.ppo.prompts import Prompt

    prompts = [Prompt(p, "", None) for p in fixed_samples(n=2).prompt_ids]

    def models():
        return [tiny_model(seed=0), tiny_model(seed=1)] + [
            tiny_model(seed=s, auto_class=SeqCls, num_labels=1) for s in (2, 3)
        ]

    for bf16, ref_dtype, want in (
        (True, None, (torch.bfloat16,) * 4),
        (True, "float32", (torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16)),
        (False, None, (torch.float32,) * 4),
    ):
        c = parse_ppo_config([ppo_config(tmp_path, training={"bf16": bf16}, ref={"dtype": ref_dtype})])
        policy, ref, critic, reward = models()
        trainer = build_from_models(c, prompts, tokenizer(), policy, ref, critic, reward)
        got = tuple(next(m.parameters()).dtype for m in (policy, ref, critic, reward))
        assert got == want, (bf16, ref_dtype, got)
        if bf16:
            trainer.actor.model.lm_head.weight.grad = torch.zeros_like(trainer.actor.model.lm_head.weight)
            trainer.actor.optim.step()
            master = trainer.actor.optim.optimizer.state[trainer.actor.model.lm_head.weight]["master"]
            assert master.dtype == torch.float32
