"""DPO numerics: hand-derived loss values; per-pair log-probs, losses and metrics equal TRL 1.12 for every
loss type (ours packed [prompt | chosen | rejected], TRL padded, same token ids, same weights); the
first rejected token is read at the last prompt position; precomputed reference == on the fly;
gradient accumulation 4 x 1 == batch 4."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from llm.alignment.dpo.loss import (
    PairLogProbs,
    hinge_loss,
    ipo_loss,
    orpo_odds_ratio_loss,
    preference_loss,
    sigmoid_loss,
    simpo_loss,
)
from llm.alignment.dpo.trainer import DPOTrainer, collate_pairs
from llm.data.encode_lm import CHOSEN, PROMPT, REJECTED, encode_pair_for_lm
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import pack
from llm.data.readers import read_records
from llm.settings.dpo import DPOTrainingArguments
from tests.helpers import ROOT, tiny_model, tokenizer, twin

PAIRS = os.path.join(ROOT, "llm", "data", "sample", "pairs_train.jsonl")
TOL = 1e-5  # fp32: losses absolute; log-prob sums (and rewards built from them) relative to their size, see close()


def args(tmp_path, **kw):
    base = {
        "output_dir": str(tmp_path),
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "logging_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    base.update(kw)
    return DPOTrainingArguments(**base)  # the DPO hyper-parameters (loss_type, beta, ...) ride in kw


# --- pure math, values derived by hand ----------------------------------------------------------


def test_losses_hand_values():
    d = torch.tensor([0.0, 10.0])
    # beta D = 0 -> -log(1/2) = 0.693147; beta D = 1 -> -log sigmoid(1) = 0.313262
    assert torch.allclose(sigmoid_loss(d, 0.1), torch.tensor([0.693147, 0.313262]), atol=1e-6)
    # cDPO with e = 0.1 at beta D = 1: 0.9 * 0.313262 + 0.1 * 1.313262 = 0.413262
    assert torch.allclose(sigmoid_loss(d, 0.1, 0.1)[1], torch.tensor(0.413262), atol=1e-6)
    # hinge: relu(1 - 0) = 1, relu(1 - 1) = 0
    assert torch.equal(hinge_loss(d, 0.1), torch.tensor([1.0, 0.0]))
    # IPO, beta 0.5: (0 - 1)^2 = 1, (10 - 1)^2 = 81
    assert torch.equal(ipo_loss(d, 0.5), torch.tensor([1.0, 81.0]))
    # SimPO, beta 2, gamma 1: logits 2 * 0.5 - 1 = 0 -> log 2
    assert torch.allclose(simpo_loss(torch.tensor([0.5]), 2.0, 1.0), torch.tensor([math.log(2)]), atol=1e-6)
    # ORPO: mean log-probs log(1/2) both -> odds 1 each -> log OR = 0 -> -beta log(1/2) = 0.1 * 0.693147
    half = torch.tensor([math.log(0.5)])
    assert torch.allclose(orpo_odds_ratio_loss(half, half, 0.1), torch.tensor([0.0693147]), atol=1e-7)
    # p_c = 0.5 (odds 1), p_r = 0.2 (odds 1/4): log OR = log 4 -> -log sigmoid(log 4) = -log 0.8 = 0.223144
    got = orpo_odds_ratio_loss(half, torch.tensor([math.log(0.2)]), 1.0)
    assert torch.allclose(got, torch.tensor([0.223144]), atol=1e-6)


def test_rewards_and_reference_free():
    pol = PairLogProbs(torch.tensor([-10.0]), torch.tensor([-14.0]), torch.tensor([5.0]), torch.tensor([7.0]))
    ref = (torch.tensor([-11.0]), torch.tensor([-12.0]))
    out = preference_loss("sigmoid", pol, ref, beta=0.5)
    # rewards 0.5 * (-10 + 11) = 0.5 and 0.5 * (-14 + 12) = -1; margin D = 3 -> -log sigmoid(1.5)
    assert out.chosen_rewards.item() == 0.5 and out.rejected_rewards.item() == -1.0
    assert abs(out.loss.item() - (-math.log(1 / (1 + math.exp(-1.5))))) < 1e-6
    free = preference_loss("sigmoid", pol, None, beta=0.5)
    assert abs(free.loss.item() - (-math.log(1 / (1 + math.exp(-2.0))))) < 1e-6  # D = -10 + 14 = 4
    simpo = preference_loss("simpo", pol, ref, beta=2.0, simpo_gamma=0.0)  # the reference is ignored
    assert simpo.chosen_logps.item() == -2.0 and simpo.rejected_logps.item() == -2.0
    assert simpo.chosen_rewards.item() == -4.0


# --- the same pairs through our trainer and through TRL --------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """8 pairs (one two-turn), our packed examples, a policy and a different reference, TRL trainers."""
    from trl import DPOConfig
    from trl import DPOTrainer as TRLDPOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok = tokenizer()
    records = read_records(PAIRS, "pair")
    multi = next(r for r in records if len(r.prompt) > 1)
    records = records[:7] + [multi]
    cfg = EncodeConfig(1024, 256)
    examples = [encode_pair_for_lm(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(records)]
    with_prompt = [encode_pair_for_lm(r, tok, cfg, i, OverlongCounter(), True) for i, r in enumerate(records)]
    policy, ref = tiny_model("llama", seed=1).eval(), tiny_model("llama", seed=2).eval()
    trl_policy, trl_ref = twin(policy, "sdpa").eval(), twin(ref, "sdpa").eval()

    def split(ex):  # the pair layout back into prompt / chosen / rejected ids
        p = ex.blocks[1].kv[0][1]
        c = ex.blocks[0].q_end - p
        return ex.input_ids[:p], ex.input_ids[p : p + c], ex.input_ids[p + c :]

    ids = [split(ex) for ex in examples]
    text = Dataset.from_dict({"prompt": ["q"] * 2, "chosen": [" a"] * 2, "rejected": [" b"] * 2})
    tmp = tmp_path_factory.mktemp("trl")
    common = {"report_to": "none", "use_cpu": True, "bf16": False, "max_length": None}
    dpo = TRLDPOTrainer(
        model=trl_policy,
        ref_model=trl_ref,
        args=DPOConfig(output_dir=str(tmp / "dpo"), **common),
        train_dataset=text,
        processing_class=tok,
    )
    cpo = CPOTrainer(
        model=trl_policy,
        args=CPOConfig(output_dir=str(tmp / "cpo"), cpo_alpha=0.0, **common),
        train_dataset=text,
        processing_class=tok,
    )
    orpo = ORPOTrainer(
        model=trl_policy,
        args=ORPOConfig(output_dir=str(tmp / "orpo"), **common),
        train_dataset=text,
        processing_class=tok,
    )
    return SimpleNamespace(
        tok=tok,
        records=records,
        examples=examples,
        with_prompt=with_prompt,
        ids=ids,
        policy=policy,
        ref=ref,
        trl_policy=trl_policy,
        dpo=dpo,
        cpo=cpo,
        orpo=orpo,
        tmp=tmp,
    )


def ours(setup, loss_type="sigmoid", examples=None, **kw):
    """Per-pair loss and outputs in record order, from one packed batch (greedy packing into 2 rows)."""
    trainer = DPOTrainer(
        model=setup.policy, args=args(setup.tmp / "ours", loss_type=loss_type, **kw), ref_model=setup.ref
    )
    examples = examples if examples is not None else setup.examples
    rows, _ = pack(examples, 700, "greedy")
    assert len(rows) > 1 and max(len(r.records) for r in rows) > 1  # really packed
    batch = collate_pairs(rows, pad_token_id=setup.tok.pad_token_id)
    with torch.no_grad():
        out = trainer.forward_items(setup.policy, batch)
    order = batch.records.argsort()
    values = {k: v[order] for k, v in out.values.items()}
    return out.loss[order], values, trainer.metrics([trainer.example_outputs(batch, out)[i] for i in order])


def trl_dpo_batch(setup, pairs):
    feats = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in (setup.ids[i] for i in pairs)]
    return setup.dpo.data_collator(feats)


def run_trl_dpo(setup, loss_type, pairs, beta=0.1, label_smoothing=0.0, weights=None, reference_free=False):
    trl = setup.dpo
    trl.loss_types, trl.loss_weights = loss_type, weights or [1.0] * len(loss_type)
    trl.beta, trl.label_smoothing = beta, label_smoothing
    trl.precompute_ref_logps = reference_free  # TRL 1.12 has no reference-free flag: feed zero reference log-probs
    batch = trl_dpo_batch(setup, pairs)
    if reference_free:
        batch["ref_chosen_logps"] = batch["ref_rejected_logps"] = torch.zeros(len(pairs))
    trl._metrics["eval"].clear()
    with torch.no_grad():
        loss = trl.compute_loss(setup.trl_policy, batch)
        chosen, rejected = trl.compute_ref_log_probs(setup.trl_policy, batch)  # the policy's per-pair sums
    return loss, chosen, rejected, {k: v[-1] for k, v in trl._metrics["eval"].items()}


def as_float64(x):
    return torch.stack(x).double() if isinstance(x, list) else torch.as_tensor(x, dtype=torch.float64)


def close(name, ours_value, trl_value, scale=1.0):
    """max |ours - TRL| / scale <= TOL; printed (pytest -s) for the record.

    fp32 sums of a few hundred token log-probs differ between packed and padded kernels in their last
    bits (~1e-4 on -450, 2e-7 relative), so sums are compared relative to their size and rewards
    (beta times a difference of two such sums) relative to beta times the size of the sums.
    """
    diff = (as_float64(ours_value) - as_float64(trl_value)).abs()
    worst = (diff / scale).max().item()
    print(f"{name}: max |difference| {diff.max().item():.2e}, relative to scale {worst:.2e}")
    assert worst <= TOL, (name, worst)


@pytest.mark.parametrize(
    "loss_type, beta, reference_free",
    [("sigmoid", 0.1, False), ("hinge", 0.1, False), ("ipo", 0.5, False), ("sigmoid", 0.1, True)],
)
def test_dpo_family_equals_trl(setup, loss_type, beta, reference_free):
    loss, values, metrics = ours(setup, loss_type, beta=beta, reference_free=reference_free)
    pairs = list(range(len(setup.examples)))
    trl_loss, chosen, rejected, trl_metrics = run_trl_dpo(
        setup, [loss_type], pairs, beta, reference_free=reference_free
    )
    name = f"{loss_type}{' reference-free' if reference_free else ''}"
    close(
        f"{name} logps (sums)",
        torch.stack([values["chosen_logps"], values["rejected_logps"]]),
        [chosen, rejected],
        scale=torch.stack([chosen, rejected]).abs(),
    )
    close(f"{name} loss", loss.mean(), trl_loss)
    size = torch.stack([chosen, rejected]).abs().max().item()
    scales = {"rewards/accuracies": 1.0, "logps/chosen": size}  # rewards: beta * (sum - ref sum)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        close(f"{name} {key}", metrics[key], trl_metrics[key], scale=scales.get(key, beta * size))


@pytest.mark.parametrize("case", ["label_smoothing", "sft_loss_weight"])
def test_cdpo_and_sft_term_equal_trl_per_pair(setup, case):
    """TRL 1.12's DPOTrainer has no cDPO on the sigmoid loss; its 'aot' loss is exactly cDPO for a single pair
    (sorting one value is the identity). Its 'sft' term is a token mean over the whole batch; for a single
    pair it is that pair's mean NLL, which is our per-pair SFT term (TRL<1.0's rpo_alpha)."""
    if case == "label_smoothing":
        loss, _, _ = ours(setup, "sigmoid", label_smoothing=0.2)
        trl_kwargs = {"loss_type": ["aot"], "label_smoothing": 0.2}
    else:
        loss, _, _ = ours(setup, "sigmoid", sft_loss_weight=0.7)
        trl_kwargs = {"loss_type": ["sigmoid", "sft"], "weights": [1.0, 0.7]}
    trl_losses = torch.stack([run_trl_dpo(setup, pairs=[i], **trl_kwargs)[0] for i in range(len(setup.examples))])
    close(f"sigmoid {case} loss per pair", loss, trl_losses)


def cpo_orpo_batch(trainer, setup, pairs):
    feats = []
    for p, c, r in (setup.ids[i] for i in pairs):
        feats.append(
            {
                "prompt_input_ids": p,
                "prompt_attention_mask": [1] * len(p),
                "chosen_input_ids": p + c,
                "chosen_attention_mask": [1] * (len(p) + len(c)),
                "chosen_labels": [-100] * len(p) + c,
                "rejected_input_ids": p + r,
                "rejected_attention_mask": [1] * (len(p) + len(r)),
                "rejected_labels": [-100] * len(p) + r,
            }
        )
    return trainer.data_collator(feats)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_equals_trl_cpo(setup, label_smoothing):
    loss, values, metrics = ours(setup, "simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=label_smoothing)
    cpo = setup.cpo
    cpo.loss_type, cpo.beta, cpo.simpo_gamma, cpo.label_smoothing = "simpo", 2.0, 0.5, label_smoothing
    batch = cpo_orpo_batch(cpo, setup, range(len(setup.examples)))
    with torch.no_grad():
        chosen, rejected, *_ = cpo.concatenated_forward(setup.trl_policy, batch)
        trl_loss, trl_metrics = cpo.get_batch_loss_metrics(setup.trl_policy, batch)
    name = f"simpo{' label_smoothing' if label_smoothing else ''}"
    close(f"{name} logps (means)", torch.stack([values["chosen_logps"], values["rejected_logps"]]), [chosen, rejected])
    close(f"{name} loss", loss.mean(), trl_loss)
    for key in ("rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/rejected"):
        close(f"{name} {key}", metrics[key], trl_metrics[key])


def test_reference_free_cdpo_equals_trl_cpo_sigmoid(setup):
    """CPO's sigmoid loss is reference-free DPO with cDPO label smoothing (cpo_alpha=0: no NLL term)."""
    loss, _, _ = ours(setup, "sigmoid", beta=0.1, reference_free=True, label_smoothing=0.15)
    cpo = setup.cpo
    cpo.loss_type, cpo.beta, cpo.label_smoothing = "sigmoid", 0.1, 0.15
    with torch.no_grad():
        trl_loss, _ = cpo.get_batch_loss_metrics(setup.trl_policy, cpo_orpo_batch(cpo, setup, range(8)))
    close("sigmoid reference-free label_smoothing loss", loss.mean(), trl_loss)


def test_orpo_equals_trl_per_pair(setup):
    """TRL's ORPO NLL is a token mean over the batch (prompt and chosen tokens); per pair it is ours."""
    loss, values, _ = ours(setup, "orpo", examples=setup.with_prompt, beta=0.1)
    orpo = setup.orpo
    orpo.beta = 0.1
    trl_losses, trl_chosen = [], []
    for i in range(len(setup.examples)):
        batch = cpo_orpo_batch(orpo, setup, [i])
        with torch.no_grad():
            trl_losses.append(orpo.get_batch_loss_metrics(setup.trl_policy, batch)[0])
            trl_chosen.append(orpo.concatenated_forward(setup.trl_policy, batch)[0][0])
    close("orpo logps (means)", values["chosen_logps"], torch.stack(trl_chosen))
    close("orpo loss per pair", loss, torch.stack(trl_losses))


# --- layout, reference, accumulation ---------------------------------------------------------


def test_first_rejected_token_is_read_at_the_last_prompt_position(setup):
    """Oracle: prompt + rejected run alone with the full LM head, summed over the rejected tokens."""
    tok = setup.tok
    ex = setup.examples[0]
    p = ex.blocks[1].kv[0][1]
    c = ex.blocks[0].q_end - p
    first_rejected = next(pos for pos, part in zip(ex.readout_position, ex.readout_part) if part == REJECTED)
    assert first_rejected == p - 1 and ex.readout_part.count(CHOSEN) == c and PROMPT not in ex.readout_part
    prompt, _, rejected = setup.ids[0]
    assert tok.decode(rejected) == setup.records[0].rejected + tok.eos_token
    seq = torch.tensor([prompt + rejected])
    with torch.no_grad():
        logits = twin(setup.policy, "sdpa")(input_ids=seq).logits[0].log_softmax(-1)
    oracle = sum(logits[p - 1 + k, t].item() for k, t in enumerate(rejected))
    _, values, _ = ours(setup)
    assert abs(values["rejected_logps"][0].item() - oracle) <= 1e-5 * abs(oracle)
    quirk = oracle - logits[p - 1, rejected[0]].item()  # PaddleNLP skips the first rejected token's label
    assert abs(values["rejected_logps"][0].item() - quirk) > 1e-2


def test_precomputed_reference_equals_on_the_fly(setup, tmp_path):
    rows, _ = pack(setup.examples, 700, "greedy")
    collator = lambda r: collate_pairs(r, pad_token_id=0)
    trainer = DPOTrainer(model=setup.policy, args=args(tmp_path), ref_model=setup.ref, data_collator=collator)
    referenced = trainer.with_reference_log_probs(rows, batch_size=1)
    on_the_fly, precomputed = collator(rows), collator(referenced)
    assert precomputed.ref_chosen is not None and on_the_fly.ref_chosen is None
    with torch.no_grad():
        a = trainer.forward_items(setup.policy, on_the_fly)
        b = trainer.forward_items(setup.policy, precomputed)
    assert torch.allclose(a.loss, b.loss, atol=1e-6, rtol=0)


def one_sgd_step(tmp_path, rows, batch_size, accumulation, loss_type, **kw):
    model = tiny_model("llama", seed=3)
    trainer = DPOTrainer(
        model=model,
        args=args(
            tmp_path,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            loss_type=loss_type,
            **kw,
        ),
        train_dataset=rows,
        data_collator=lambda r: collate_pairs(r, pad_token_id=0),
        ref_model=tiny_model("llama", seed=4),
    )
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("loss_type, kw", [("sigmoid", {"sft_loss_weight": 0.5}), ("orpo", {})])
def test_accumulation_4x1_equals_batch_4(tmp_path, setup, loss_type, kw):
    tok = setup.tok
    records = read_records(PAIRS, "pair")[:16]
    cfg = EncodeConfig(1024, 256)
    examples = [
        encode_pair_for_lm(r, tok, cfg, i, OverlongCounter(), prompt_targets=loss_type == "orpo")
        for i, r in enumerate(records)
    ]
    # Rows holding different numbers of pairs, so a per-micro-batch mean would give a different update.
    rows, _ = pack(examples, 450, "sequential")
    rows = rows[:4]
    counts = [len(r.records) for r in rows]
    assert len(set(counts)) > 1, counts
    init = tiny_model("llama", seed=3).state_dict()
    big = one_sgd_step(tmp_path / "a", rows, 4, 1, loss_type, **kw)
    small = one_sgd_step(tmp_path / "b", rows, 1, 4, loss_type, **kw)
    moved = max((big[k] - init[k]).abs().max().item() for k in big)
    assert moved > 1e-4
    worst = max((big[k] - small[k]).abs().max().item() for k in big)
    assert worst <= 1e-6 * max(1.0, moved) + 1e-7, worst


# --- the loss registry ----------------------------------------------------------------------------
def test_an_unregistered_loss_type_is_refused_with_the_valid_ones():
    from llm.alignment.dpo.loss import LOSSES
    from llm.settings.dpo import DPOTrainingArguments
    from llm.utils.errors import UserError

    with pytest.raises(UserError) as err:
        DPOTrainingArguments(output_dir="/tmp/unused", loss_type="simpoo", report_to="none")
    assert "sigmoid, hinge, ipo, simpo, orpo" in str(err.value) and "'simpo'" in str(err.value)
    assert list(LOSSES) == ["sigmoid", "hinge", "ipo", "simpo", "orpo"]


def test_a_registered_loss_is_read_by_validation_and_the_trainer(request):
    """Adding a loss is one LossSpec and one register_loss: the arguments accept it with its properties
    (a reference-free loss refuses reference_free, a smoothing-free one label_smoothing) and preference_loss
    computes it."""
    from llm.alignment.dpo import loss as loss_module
    from llm.settings.dpo import DPOTrainingArguments
    from llm.utils.errors import UserError

    request.addfinalizer(lambda: loss_module.LOSSES.remove("margin_only"))  # the registry is shared
    spec = loss_module.LossSpec(lambda pol, ref, beta, ls, gamma: beta * (pol.rejected - pol.chosen), False)
    loss_module.register_loss("margin_only", spec)
    with pytest.raises(ValueError, match="twice"):
        loss_module.register_loss("margin_only", spec)
    DPOTrainingArguments(output_dir="/tmp/unused", loss_type="margin_only", report_to="none")
    for bad in ({"reference_free": True}, {"label_smoothing": 0.1}):
        with pytest.raises(UserError):
            DPOTrainingArguments(output_dir="/tmp/unused", loss_type="margin_only", report_to="none", **bad)
    pol = PairLogProbs(torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([2.0]), torch.tensor([4.0]))
    out = preference_loss("margin_only", pol, None, beta=0.5)
    assert out.loss.item() == pytest.approx(0.5 * (-5.0 + 3.0))
    assert out.chosen_rewards.item() == pytest.approx(0.5 * -3.0)  # sums, not length-normalised


def test_every_registered_loss_is_exercised_against_a_reference():
    """Each loss_type in the registry has a TRL (or hand) equivalence test in this module."""
    from llm.alignment.dpo.loss import LOSSES

    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    for name in LOSSES:
        assert f'"{name}"' in source.split("# --- the loss registry")[0], name
