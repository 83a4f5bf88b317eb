"""Reward-model numerics: ORM equals TRL's RewardTrainer, PRM equals a naive per-example oracle,
gradient accumulation equals one big batch."""

import json
import os
import types

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from llm.alignment.rm.loss import pairwise_loss, step_loss
from llm.alignment.rm.orm_trainer import ORMTrainer
from llm.alignment.rm.prm_trainer import PRMTrainer
from llm.data.encode_reward import encode_pair_for_scores, encode_prm
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import collate, pack
from llm.settings.reward import RewardTrainingArguments as TrainingArguments
from tests.helpers import ROOT, reward_trainer, tiny_model, tokenizer, twin

SAMPLE = os.path.join(ROOT, "llm", "data", "sample")


def read_jsonl(name, n):
    with open(os.path.join(SAMPLE, name), encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def prm_records(n):
    return [
        types.SimpleNamespace(
            prompt=[{"role": "user", "content": r["src"][0]}],
            steps=r["responses"],
            labels=r["labels"],
            soft_labels=None,
            source="prm_train.jsonl",
            index=i,
        )
        for i, r in enumerate(read_jsonl("prm_train.jsonl", n))
    ]


def pair_records(n):
    out = []
    for i, r in enumerate(read_jsonl("pairs_train.jsonl", n)):
        hi = 0 if r["sort"][0] > r["sort"][1] else 1
        out.append(
            types.SimpleNamespace(
                prompt=[{"role": "user", "content": r["src"][-1]}],
                chosen=r["response"][hi],
                rejected=r["response"][1 - hi],
                source="pairs_train.jsonl",
                index=i,
            )
        )
    return out


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
    return TrainingArguments(**base)


def encode_prm_examples(tok, records, max_len=1024):
    cfg = EncodeConfig(max_len, 256)
    ph = tok.convert_tokens_to_ids("ки")
    return [encode_prm(r, tok, cfg, ph, "ки", ("+", "-"), i, OverlongCounter()) for i, r in enumerate(records)]


def test_pairwise_loss_hand_values():
    # s_c - s_r = 0 -> -log(1/2) = 0.693147; with margin 1: -log sigmoid(-1) = 1.313262
    c, r = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])
    assert torch.allclose(pairwise_loss(c, r), torch.tensor([0.693147, 0.313262]), atol=1e-6)
    assert torch.allclose(pairwise_loss(c, r, margin=1.0), torch.tensor([1.313262, 0.693147]), atol=1e-6)
    # centering adds c * (s_c + s_r)^2 = 0.1 * 4 = 0.4 for the first pair
    assert torch.allclose(pairwise_loss(c, r, center_coefficient=0.1)[0], torch.tensor(1.093147), atol=1e-6)
    # PaddleNLP's regularization adds r * (s_c^2 + s_r^2): pair 2, 0.01 * (4 + 1) = 0.05 -> 0.363262
    assert torch.allclose(pairwise_loss(c, r, regularization=0.01), torch.tensor([0.713147, 0.363262]), atol=1e-6)


def test_step_loss_hand_values():
    # logits (2, 0): p(+) = e^2/(e^2+1) = 0.880797; CE for '+' = -log 0.880797 = 0.126928, for '-' = 2.126928
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0]])
    assert torch.allclose(step_loss(logits, torch.tensor([0, 1])), torch.tensor([0.126928, 2.126928]), atol=1e-6)


def test_seed_example_has_four_placeholders_labelled_pp_mm():
    tok = tokenizer()
    record = prm_records(1)[0]
    assert "Tony" in record.prompt[0]["content"] and "cheese" in record.prompt[0]["content"]
    ex = encode_prm_examples(tok, [record])[0]
    assert len(ex.readout_position) == 4
    assert all(ex.input_ids[p] == tok.convert_tokens_to_ids("ки") for p in ex.readout_position)
    assert ["+-"[t] for t in ex.readout_target] == ["+", "+", "-", "-"]


@pytest.mark.parametrize("strategy", [None, "greedy"])
def test_prm_loss_and_accuracy_equal_naive_oracle(tmp_path, strategy):
    tok = tokenizer()
    model = tiny_model("llama").eval()
    stock = twin(model, "sdpa").eval()
    examples = encode_prm_examples(tok, prm_records(12))
    trainer = PRMTrainer(
        model=model,
        args=args(tmp_path),
        reward_token_ids=(tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")),
    )
    rows, _ = pack(examples, 1024, strategy)
    batch = collate(rows, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        out = trainer.forward_items(model, batch)
        ours = trainer.metrics(trainer.example_outputs(batch, out))
        # Oracle: every solution alone, full LM head, gather the two reward-token logits at each placeholder.
        losses, correct = [], []
        plus, minus = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
        for ex in examples:
            logits = stock(input_ids=torch.tensor([ex.input_ids])).logits[0]
            for pos, target in zip(ex.readout_position, ex.readout_target):
                pair = logits[pos, [plus, minus]]
                p_plus = torch.softmax(pair, -1)[0]
                losses.append(-torch.log_softmax(pair, -1)[target])
                correct.append((p_plus > 0.5).item() == (target == 0))
    assert out.loss.numel() == len(losses)
    assert abs(out.loss.mean().item() - torch.stack(losses).mean().item()) <= 1e-5
    assert ours["step_accuracy"] == sum(correct) / len(correct)


def test_orm_scores_and_loss_equal_trl(tmp_path):
    from datasets import Dataset
    from trl import RewardConfig
    from trl import RewardTrainer as TRLRewardTrainer

    tok = tokenizer()
    ours_model = tiny_model("llama", AutoModelForSequenceClassification, num_labels=1).eval()
    trl_model = twin(ours_model, "sdpa").eval()
    records = pair_records(8)
    cfg = EncodeConfig(1024, 256)
    examples = [encode_pair_for_scores(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(records)]
    trainer = ORMTrainer(model=ours_model, args=args(tmp_path))
    rows, _ = pack(examples, 1024, "greedy")
    batch = collate(rows, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        out = trainer.forward_items(ours_model, batch)
    ours = {ex["record"]: ex for ex in trainer.example_outputs(batch, out)}

    # TRL on the same token sequences: prompt + answer (+ eos), padded batch, last non-pad token scored.
    def full(ex, part):
        p = ex.blocks[1].kv[0][1]
        c = ex.blocks[0].q_end - p
        return ex.input_ids[: p + c] if part == 0 else ex.input_ids[:p] + ex.input_ids[p + c :]

    data = Dataset.from_dict(
        {"chosen_ids": [full(e, 0) for e in examples], "rejected_ids": [full(e, 1) for e in examples]}
    )
    trl = TRLRewardTrainer(
        model=trl_model,
        args=RewardConfig(
            output_dir=str(tmp_path / "trl"),
            report_to="none",
            use_cpu=True,
            per_device_train_batch_size=8,
            max_length=None,
        ),
        train_dataset=data,
        processing_class=tok,
    )
    trl_batch = trl.data_collator([data[i] for i in range(len(data))])
    with torch.no_grad():
        trl_loss, trl_out = trl.compute_loss(trl_model, trl_batch, return_outputs=True)
    chosen, rejected = trl_out.logits.squeeze(-1).chunk(2)
    for i in range(len(examples)):
        assert abs(ours[i]["chosen_score"] - chosen[i].item()) <= 1e-5
        assert abs(ours[i]["rejected_score"] - rejected[i].item()) <= 1e-5
    assert abs(out.loss.mean().item() - trl_loss.item()) <= 1e-5


def one_sgd_step(tmp_path, rows, batch_size, accumulation, process_reward, model_factory, token_ids):
    model = model_factory()
    trainer = reward_trainer(
        process_reward,
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
        ),
        train_dataset=rows,
        data_collator=lambda r: collate(r, pad_token_id=0),
        reward_token_ids=token_ids,
    )
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("process_reward", [True, False])
def test_accumulation_4x1_equals_batch_4(tmp_path, process_reward):
    tok = tokenizer()
    if process_reward:
        examples = encode_prm_examples(tok, prm_records(16))
        token_ids = (tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-"))

        def factory():
            return tiny_model("llama", seed=3)
    else:
        cfg = EncodeConfig(1024, 256)
        examples = [encode_pair_for_scores(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(pair_records(16))]
        token_ids = None

        def factory():
            return tiny_model("llama", AutoModelForSequenceClassification, seed=3, num_labels=1)

    # Rows holding different numbers of items, so a per-micro-batch mean would give a different update.
    rows, _ = pack(examples, 200 if process_reward else 400, "sequential")
    rows = rows[:4]
    counts = [len(r.readout_position) if process_reward else len(r.records) for r in rows]
    assert len(set(counts)) > 1, counts
    init = factory().state_dict()
    big = one_sgd_step(tmp_path / "a", rows, 4, 1, process_reward, factory, token_ids)
    small = one_sgd_step(tmp_path / "b", rows, 1, 4, process_reward, factory, token_ids)
    moved = max((big[k] - init[k]).abs().max().item() for k in big)
    assert moved > 1e-4  # the step did something
    worst = max((big[k] - small[k]).abs().max().item() for k in big)
    assert worst <= 1e-6 * max(1.0, moved) + 1e-7, worst


def test_chat_template_prompt_rendering():
    tok = tokenizer()
    record = pair_records(1)[0]
    plain = encode_pair_for_scores(record, tok, EncodeConfig(1024, 256), 0, OverlongCounter())
    chat = encode_pair_for_scores(record, tok, EncodeConfig(1024, 256, use_chat_template=True), 0, OverlongCounter())
    p_plain, p_chat = plain.blocks[1].kv[0][1], chat.blocks[1].kv[0][1]
    text = tok.decode(chat.input_ids[:p_chat])
    assert text.startswith("<|user|>") and text.rstrip().endswith("<|assistant|>")
    assert record.prompt[-1]["content"] in text
    assert chat.input_ids[p_chat:] == plain.input_ids[p_plain:]  # answers are tokenised the same way
