"""The implicit PRM (``prm_kind: implicit``): r(y) = beta * log(pi(y) / pi_ref(y)) from two tiny models' logits by
hand; the ce and dpo losses, the step rewards and p(correct), PPO's ``implicit_prm`` dense rewards, the frozen
reference saved once, evaluation-only runs and the server reading the trained model, and bad inputs."""

from __future__ import annotations

import itertools
import json
import math
import os
import types

import pytest
import torch
import torch.nn.functional as F

from llm.alignment.ppo.interfaces import Samples
from llm.alignment.ppo.rewards.implicit import ImplicitPRMReward
from llm.alignment.rm.implicit import IMPLICIT_FILE, REFERENCE_DIR, ImplicitPRM, read_implicit_prm
from llm.alignment.rm.implicit_trainer import ImplicitPRMTrainer
from llm.data.encode_implicit import encode_implicit_pair, encode_implicit_solution
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import collate, pack
from llm.settings.reward import RewardTrainingArguments
from llm.utils.errors import UserError
from tests.helpers import ROOT, read_json, read_jsonl, tiny_model, tokenizer, twin

BETA = 0.5
PROBLEMS = ["Tom has 3 bags of 4 apples. How many apples?\n", "What is 2 + 5?\n"]
STEPS = [["3 * 4 = 12 apples.", "The answer is 12."], ["2 + 5 = 8.", "So 8.", "The answer is 8."]]
TINY_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "implicit_prm_argument.json")
SAMPLE = os.path.join(ROOT, "llm", "data", "sample")


@pytest.fixture(scope="module")
def models():
    """A policy and a reference of different random weights (packed attention), and their stock twins."""
    policy, ref = tiny_model("llama", seed=1).eval(), tiny_model("llama", seed=2).eval()
    return policy, ref, twin(policy, "sdpa").eval(), twin(ref, "sdpa").eval()


def hand_ratios(stock_policy, stock_ref, ids: list[int], start: int) -> torch.Tensor:
    """log pi - log pi_ref of tokens ids[start:], each from a plain forward of the whole sequence."""
    x = torch.tensor([ids])
    with torch.no_grad():
        lp = F.log_softmax(stock_policy(input_ids=x).logits[0].double(), -1)
        lr = F.log_softmax(stock_ref(input_ids=x).logits[0].double(), -1)
    return torch.stack([lp[t - 1, ids[t]] - lr[t - 1, ids[t]] for t in range(start, len(ids))])


def step_token_counts(tok, steps: list[str]) -> list[int]:
    return [len(tok(s + "\n", add_special_tokens=False)["input_ids"]) for s in steps]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def args(tmp_path, **kw) -> RewardTrainingArguments:
    base = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True, "disable_tqdm": True,
            "save_strategy": "no", "logging_strategy": "no", "seed": 0, "dataloader_num_workers": 0,
            "process_reward": True, "prm_kind": "implicit", "implicit_beta": BETA}  # fmt: skip
    return RewardTrainingArguments(**{**base, **kw})


def prm_records(n: int) -> list:
    rows = read_jsonl(os.path.join(SAMPLE, "prm_train.jsonl"))[:n]
    return [
        types.SimpleNamespace(prompt=[{"role": "user", "content": r["src"][0]}], steps=r["responses"],
                              labels=r["labels"], correct=None, first_error=None)
        for r in rows
    ]  # fmt: skip


def test_ce_loss_step_rewards_and_scores_equal_a_hand_computation(tmp_path, models):
    policy, ref, stock_policy, stock_ref = models
    tok, cfg = tokenizer(), EncodeConfig(1024, 256)
    records = prm_records(8)
    outcomes = [0.0 if "-" in r.labels else 1.0 for r in records]
    assert 0 < sum(outcomes) < len(outcomes)  # both outcomes: the loss's sign is tested
    examples = [encode_implicit_solution(r, tok, cfg, ("+", "-"), i, OverlongCounter()) for i, r in enumerate(records)]
    rows, _ = pack(examples, 1024, "greedy")  # several solutions per row
    batch = collate(rows, pad_token_id=tok.pad_token_id)
    trainer = ImplicitPRMTrainer(model=policy, args=args(tmp_path), ref_model=ref)
    with torch.no_grad():
        out = trainer.forward_items(policy, batch)
        got = {ex["record"]: ex for ex in trainer.example_outputs(batch, out)}
    assert trainer.count_items(batch) == len(records)
    losses = dict(zip(batch.records.tolist(), out.loss.tolist()))
    for i, (record, outcome) in enumerate(zip(records, outcomes)):
        prompt = tok("\n".join(m["content"] for m in record.prompt) + "\n")["input_ids"]
        ids = examples[i].input_ids
        ratios = hand_ratios(stock_policy, stock_ref, ids, len(prompt))
        r = BETA * float(ratios.sum())
        p = sigmoid(r)
        assert losses[i] == pytest.approx(-(outcome * math.log(p) + (1 - outcome) * math.log(1 - p)), abs=1e-5)
        bounds = [0]
        for n in step_token_counts(tok, record.steps):
            bounds.append(bounds[-1] + n)
        steps = [BETA * float(ratios[a:b].sum()) for a, b in itertools.pairwise(bounds)]
        assert got[i]["step_rewards"] == pytest.approx(steps, abs=1e-5)
        assert got[i]["step_scores"] == pytest.approx([sigmoid(sum(steps[: k + 1])) for k in range(len(steps))])
        assert got[i]["reward"] == pytest.approx(r, abs=1e-5)
    assert len({round(x, 6) for ex in got.values() for x in ex["step_rewards"]}) > 10  # not constants


def test_dpo_form_equals_a_hand_computation(tmp_path, models):
    policy, ref, stock_policy, stock_ref = models
    tok, cfg = tokenizer(), EncodeConfig(1024, 256)
    rows = read_jsonl(os.path.join(SAMPLE, "pairs_train.jsonl"))[:4]
    records = []
    for r in rows:
        hi = 0 if r["sort"][0] > r["sort"][1] else 1
        records.append(types.SimpleNamespace(prompt=[{"role": "user", "content": r["src"][-1]}],
                                             chosen=r["response"][hi], rejected=r["response"][1 - hi]))  # fmt: skip
    examples = [encode_implicit_pair(r, tok, cfg, i, OverlongCounter()) for i, r in enumerate(records)]
    packed, _ = pack(examples, 2048, "greedy")
    batch = collate(packed, pad_token_id=tok.pad_token_id)
    trainer = ImplicitPRMTrainer(model=policy, args=args(tmp_path, implicit_loss="dpo"), ref_model=ref)
    with torch.no_grad():
        out = trainer.forward_items(policy, batch)
    assert trainer.count_items(batch) == len(records)
    losses = dict(zip(batch.records.tolist(), out.loss.tolist()))
    for i, record in enumerate(records):
        prompt = tok("\n".join(m["content"] for m in record.prompt) + "\n")["input_ids"]
        side = []
        for text in (record.chosen, record.rejected):  # one step per line, each followed by a newline
            lines = [s.strip() for s in text.split("\n") if s.strip()]
            response = [t for s in lines for t in tok(s + "\n", add_special_tokens=False)["input_ids"]]
            side.append(BETA * float(hand_ratios(stock_policy, stock_ref, prompt + response, len(prompt)).sum()))
        assert losses[i] == pytest.approx(-math.log(sigmoid(side[0] - side[1])), abs=1e-5)


def test_the_reference_gets_no_gradient_and_stays_unchanged_by_steps(tmp_path, models):
    policy, ref = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    tok, cfg = tokenizer(), EncodeConfig(1024, 256)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    policy_before = {k: v.clone() for k, v in policy.state_dict().items()}
    examples = [encode_implicit_solution(r, tok, cfg, ("+", "-"), i, OverlongCounter())
                for i, r in enumerate(prm_records(4))]  # fmt: skip
    batch = collate(pack(examples, 1024, "greedy")[0], pad_token_id=tok.pad_token_id)
    trainer = ImplicitPRMTrainer(model=policy, args=args(tmp_path), ref_model=ref)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters()) and not trainer.ref_model.training
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    for _ in range(2):
        trainer.compute_loss(policy, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(p.grad is None for p in ref.parameters())
    assert all(torch.equal(before[k], v) for k, v in ref.state_dict().items())
    assert any(not torch.equal(policy_before[k], v) for k, v in policy.state_dict().items())


def test_the_step_scorer_equals_a_hand_computation(models):
    policy, ref, stock_policy, stock_ref = models
    tok = tokenizer()
    scorer = ImplicitPRM(policy, ref, tok, BETA, micro_batch_size=1)  # one solution per forward: records come back
    rewards, scores = scorer.step_rewards(PROBLEMS, STEPS), scorer.score_steps(PROBLEMS, STEPS)
    for problem, steps, got, probs in zip(PROBLEMS, STEPS, rewards, scores):
        prompt = tok(problem)["input_ids"]
        response = [t for s in steps for t in tok(s + "\n", add_special_tokens=False)["input_ids"]]
        ratios = hand_ratios(stock_policy, stock_ref, prompt + response, len(prompt))
        bounds = [0]
        for n in step_token_counts(tok, steps):
            bounds.append(bounds[-1] + n)
        expected = [BETA * float(ratios[a:b].sum()) for a, b in itertools.pairwise(bounds)]
        assert got == pytest.approx(expected, abs=1e-5)
        assert probs == pytest.approx([sigmoid(sum(expected[: k + 1])) for k in range(len(expected))], abs=1e-6)
    cut = scorer.step_rewards(PROBLEMS, [s[:1] for s in STEPS])  # a step does not depend on the steps after it
    assert [c[0] for c in cut] == pytest.approx([r[0] for r in rewards], abs=1e-6)


def ppo_samples(tok) -> Samples:
    responses = ["\n".join(STEPS[0]), "\n\n".join(STEPS[1]) + "\n"]  # empty steps are dropped
    return Samples(
        [tok(p)["input_ids"] for p in PROBLEMS],
        [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses],
        PROBLEMS,
        responses,
        [None, None],
        torch.tensor([True, True]),
    )


def test_ppo_implicit_prm_dense_rewards_per_token_and_per_step_by_hand(models):
    policy, ref, stock_policy, stock_ref = models
    tok = tokenizer()
    samples = ppo_samples(tok)
    scorer = ImplicitPRM(policy, ref, tok, BETA, micro_batch_size=2)
    per_token = ImplicitPRMReward(scorer, tok, "\n", "dense", "token").score(samples)
    per_step = ImplicitPRMReward(scorer, tok, "\n", "dense", "step").score(samples)
    outcome = ImplicitPRMReward(scorer, tok, "\n", "min", "token").score(samples)
    for i, (p, r) in enumerate(zip(samples.prompt_ids, samples.response_ids)):
        token = BETA * hand_ratios(stock_policy, stock_ref, p + r, len(p)).float()
        assert per_token.dense[i, : len(r)] == pytest.approx(token, abs=1e-5)
        assert float(per_token.dense[i, len(r) :].abs().sum()) == 0
        # a step's reward at the first token whose decoded prefix covers the step's text; the rest in the last step
        text, ends, start = samples.responses[i], [], 0
        for piece in text.split("\n"):
            if piece.strip():
                char_end = min(start + len(piece) + 1, len(text))  # with the newline after it
                ends.append(
                    next(k for k in range(len(r)) if len(tok.decode(r[: k + 1], skip_special_tokens=True)) >= char_end)
                )
            start += len(piece) + 1
        ends[-1] = len(r) - 1
        starts = [0] + [e + 1 for e in ends[:-1]]
        steps = [float(token[a : b + 1].sum()) for a, b in zip(starts, ends)]
        expected = torch.zeros(per_step.dense.shape[1])
        expected[ends] = torch.tensor(steps)
        assert per_step.dense[i] == pytest.approx(expected, abs=1e-5)
        assert len(steps) == len(STEPS[i])
        assert float(outcome.scores[i]) == pytest.approx(min(sigmoid(sum(steps[: k + 1])) for k in range(len(steps))))
    assert per_token.scores.abs().sum() == 0 and per_step.scores.abs().sum() == 0


# --- the tiny config as shipped: training with a dev set, the saved reference, eval-only, the scorer, the server


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from llm.run_reward import main

    out = tmp_path_factory.mktemp("implicit") / "out"
    main([TINY_CONFIG, "--output_dir", str(out)])
    return out


def test_the_tiny_config_trains_and_saves_the_reference_once(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llm.utils.modeling import load_model

    with open(TINY_CONFIG, encoding="utf-8") as f:
        shipped = json.load(f)
    assert shipped["prm_kind"] == "implicit" and shipped["dev_dataset_path"]
    results = read_json(trained / "all_results.json")
    assert math.isfinite(results["train_loss"]) and math.isfinite(results["eval_loss"])
    assert "eval_processbench_f1" in results and "eval_outcome_accuracy" in results
    assert read_json(trained / IMPLICIT_FILE) == {"beta": shipped["implicit_beta"], "reference": REFERENCE_DIR,
                                                  "loss": "ce"}  # fmt: skip
    # the reference is the initial model, saved once: not in the checkpoints
    initial = load_model(AutoModelForCausalLM, os.path.join(ROOT, shipped["model_name_or_path"]),
                         init_from_config=True, seed=shipped["seed"])  # fmt: skip
    saved_ref = load_file(str(trained / REFERENCE_DIR / "model.safetensors"))
    saved = load_file(str(trained / "model.safetensors"))
    for name, value in initial.state_dict().items():
        if name in saved_ref:
            assert torch.equal(saved_ref[name], value), name
    assert any(not torch.equal(saved[k], saved_ref[k]) for k in saved_ref)  # the policy was trained
    checkpoints = [d for d in os.listdir(trained) if d.startswith("checkpoint-")]
    assert checkpoints and not any(os.path.exists(trained / c / REFERENCE_DIR) for c in checkpoints)
    assert read_implicit_prm(str(trained), "model_name_or_path") == (shipped["implicit_beta"],
                                                                      str(trained / REFERENCE_DIR))  # fmt: skip


def test_eval_only_run_the_step_scorer_and_the_server_read_the_trained_model(trained, tmp_path):
    from llm.alignment.rm.scoring import score_records
    from llm.alignment.rm.serve import ServeArgument, build_scorer
    from llm.data.readers import load_dataset_records
    from llm.run_reward import main
    from llm.settings.reward import RewardModelArgument
    from llm.settings.search import PRMSection

    out = tmp_path / "eval"
    main([TINY_CONFIG, "--output_dir", str(out), "--do_train", "false", "--model_name_or_path", str(trained),
          "--init_from_config", "false"])  # fmt: skip
    first, again = read_json(trained / "eval_results.json"), read_json(out / "eval_results.json")
    assert again["eval_loss"] == pytest.approx(first["eval_loss"], abs=1e-6)
    assert again["eval_processbench_f1"] == first["eval_processbench_f1"]
    rows = read_jsonl(out / "eval_scores.jsonl")
    flat = lambda scores: [x for s in scores for x in s]
    assert flat(r["step_scores"] for r in rows) == pytest.approx(
        flat(r["step_scores"] for r in read_jsonl(trained / "eval_scores.jsonl")), abs=1e-6
    )
    # the step scorer (search, evaluation) over the same records gives the same step scores
    scorer = ImplicitPRM.from_settings(
        PRMSection(kind="implicit", model_name_or_path=str(trained), tokenizer_name_or_path=str(trained)), seed=0
    )
    path = os.path.join(ROOT, "llm", "data", "sample", "processbench_dev.jsonl")
    records = list(load_dataset_records(path, "prm"))[: len(rows)]
    got = score_records(scorer, records, batch_size=8)
    assert [len(g) for g in got] == [len(r["step_scores"]) for r in rows]
    assert flat(got) == pytest.approx(flat(r["step_scores"] for r in rows), abs=1e-5)
    # serve_reward.py: the same model, the answer's step scores are the scorer's
    model_args = RewardModelArgument(model_name_or_path=str(trained))
    served = build_scorer(model_args, args(tmp_path, implicit_beta=0.05), ServeArgument(micro_batch_size=2))
    assert served.kind == "implicit_prm"
    answer = served.score(PROBLEMS, ["".join(s + "\n" for s in steps) for steps in STEPS], [None, None], [False] * 2)
    assert [len(s) for s in answer["step_scores"]] == [len(s) for s in STEPS]
    assert flat(answer["step_scores"]) == pytest.approx(flat(scorer.score_steps(PROBLEMS, STEPS)), abs=1e-5)
    assert answer["scores"] == pytest.approx([min(s) for s in answer["step_scores"]])


def test_a_ppo_run_with_reward_type_implicit_prm(trained, tmp_path):
    """GRPO-style PPO with the trained implicit PRM's per-step dense rewards, built from the config (from_config):
    its beta and reference from implicit_prm.json, one step run; a bad granularity stops at start-up."""
    from llm.alignment.ppo.build import PPOContext, build_role
    from llm.run_ppo import main as ppo_main
    from llm.settings.load import parse_ppo_config
    from tests.test_ppo_run import config, history

    reward = {"type": "implicit_prm", "model_name_or_path": str(trained), "implicit_granularity": "step"}
    c = parse_ppo_config([config(tmp_path, reward=reward)])
    built = build_role(c, "reward", run=PPOContext.load(c))
    assert isinstance(built, ImplicitPRMReward) and built.granularity == "step"
    assert built.scorer.beta == read_json(trained / IMPLICIT_FILE)["beta"]
    assert not any(p.requires_grad for p in built.scorer.reference.parameters())
    ppo_main([config(tmp_path, reward=reward, training={"max_steps": 1})])
    assert len(history(tmp_path / "out")) == 1 and math.isfinite(history(tmp_path / "out")[0]["score"])
    with pytest.raises(UserError, match="reward.implicit_granularity must be token or step"):
        parse_ppo_config([config(tmp_path, reward={**reward, "implicit_granularity": "word"})])


# --- bad input


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (["--implicit_loss", "hinge"], "implicit_loss"),
        (["--implicit_beta", "0.0"], "implicit_beta"),
        (["--prm_kind", "discriminative", "--implicit_loss", "dpo"], "implicit_loss"),
        (["--prm_kind", "implicit", "--process_reward", "false"], "process_reward"),
        (["--prm_kind", "discriminative", "--implicit_reference", "llm/assets/tiny-llama"], "implicit_reference"),
        (["--lora", "true"], "lora"),
    ],
)
def test_bad_settings_stop_with_one_message_and_exit_2(override, named, tmp_path, capsys):
    from llm.run_reward import main
    from llm.utils.errors import run_cli

    with pytest.raises(SystemExit) as stop:
        run_cli(main, [TINY_CONFIG, "--output_dir", str(tmp_path / "out"), *override])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_model_without_implicit_prm_json_or_with_a_bad_one_is_refused(tmp_path):
    from llm.run_reward import main

    with pytest.raises(UserError, match=IMPLICIT_FILE):  # eval-only of a model that is no implicit PRM
        main([TINY_CONFIG, "--output_dir", str(tmp_path / "out"), "--do_train", "false", "--eval_random_init", "true"])
    (tmp_path / "m").mkdir()
    for data, field in (({"beta": -1, "reference": "reference"}, "beta"), ({"beta": 0.1, "reference": 3}, "reference"),
                        ({"beta": 0.1, "reference": "nowhere"}, "reference")):  # fmt: skip
        (tmp_path / "m" / IMPLICIT_FILE).write_text(json.dumps(data))
        with pytest.raises(UserError, match=f"field '{field}'"):
            read_implicit_prm(str(tmp_path / "m"), "prm.model_name_or_path")


@pytest.mark.real_model
def test_the_smollm2_config_trains_an_implicit_prm_on_the_real_model(tmp_path):
    """llm/config/smollm2/implicit_prm_argument.json made small: two steps, a dev set of 4 ProcessBench records;
    the reference saved once is SmolLM2 itself, the policy moved away from it."""
    from safetensors.torch import load_file

    from llm.run_reward import main
    from tests.real_model import converted_dir, flat_config, largest_change

    model_dir = converted_dir()
    config = flat_config(tmp_path, "implicit_prm_argument.json", model_dir, max_steps=2, max_eval_samples=4,
                         learning_rate=1e-4, per_device_train_batch_size=2)  # fmt: skip
    main([config])
    out = tmp_path / "out"
    results = read_json(out / "all_results.json")
    assert math.isfinite(results["train_loss"]) and math.isfinite(results["eval_loss"])
    assert "eval_processbench_f1" in results
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    assert largest_change(load_file(str(out / REFERENCE_DIR / "model.safetensors")), base) == 0
    assert largest_change(load_file(str(out / "model.safetensors")), base) > 0


def test_a_resumed_run_gets_the_same_reference_and_model(tmp_path):
    """4 steps at once, and 2 steps then a resume from checkpoint-2 into another directory: the same reference
    (the initial model, not the checkpoint's weights) and, since every loss reads it, the same final model."""
    from safetensors.torch import load_file

    from llm.run_reward import main

    train = tmp_path / "train.jsonl"
    with open(os.path.join(SAMPLE, "prm_train.jsonl"), encoding="utf-8") as f:
        train.write_text("".join(line for _, line in zip(range(32), f)))
    small = ["--max_steps", "4", "--save_steps", "2", "--save_total_limit", "3", "--do_eval", "false"]
    small += ["--train_dataset_path", str(train)]
    main([TINY_CONFIG, "--output_dir", str(tmp_path / "whole"), *small])
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert not (checkpoint / REFERENCE_DIR).exists()
    main([TINY_CONFIG, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", str(checkpoint), *small])
    for name in (f"{REFERENCE_DIR}/model.safetensors", "model.safetensors"):
        whole, resumed = load_file(str(tmp_path / "whole" / name)), load_file(str(tmp_path / "resumed" / name))
        assert all(torch.allclose(whole[k], resumed[k], atol=1e-6) for k in whole), name
    assert any(
        not torch.equal(v, load_file(str(checkpoint / "model.safetensors"))[k])
        for k, v in load_file(str(tmp_path / "resumed" / REFERENCE_DIR / "model.safetensors")).items()
    )  # the reference is not the checkpoint's policy
