"""The generative PRM (prm_kind generative): its training layout and loss by hand, its step scores (a critique
written, then p(+) read) against a hand computation and a scripted model, the step-score interface in PPO's reward,
the critique maker, the tiny config as shipped, and bad input (exit 2, one message)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from llm.alignment.rm.generative import CritiqueSettings, GenerativePRM, judge_batch, judge_pass
from llm.alignment.rm.genprm_trainer import GenPRMTrainer, genprm_loss, item_weights
from llm.data.encode_genprm import CRITIQUE, VERDICT, encode_genprm, separator_ids, step_ids
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import collate, pack
from llm.data.readers import PRMRecord
from llm.settings.reward import RewardTrainingArguments
from llm.utils.attention import PACKED_SDPA
from llm.utils.errors import UserError
from tests.helpers import ROOT, read_json, read_jsonl, tiny_model, tokenizer

PROMPT = [{"role": "user", "content": "What is 2 * 3?"}]
STEPS = ["2 * 3 = 6.", "The answer is 7."]
CRITIQUES = ["The step is right.", "The step has an error."]


def record(critiques=CRITIQUES, labels=("+", "-"), steps=STEPS) -> PRMRecord:
    return PRMRecord(PROMPT, list(steps), list(labels), "mem.jsonl", 4, critiques=critiques)


def encode(rec: PRMRecord, max_len: int = 256, require: bool = True):
    tok = tokenizer()
    ids = (tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-"))
    cfg = EncodeConfig(max_len, 128)
    return encode_genprm(rec, tok, cfg, ids, ("+", "-"), require, 0, OverlongCounter()), tok, ids


def test_loss_covers_the_critique_and_verdict_tokens_only():
    ex, tok, (plus, minus) = encode(record())
    piece = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    prompt = tok("What is 2 * 3?\n")["input_ids"]
    # the layout by hand: prompt | step + \n | critique | verdict | \n | ...
    expected = list(prompt)
    loss_tokens = []
    for step, critique, verdict in zip(STEPS, CRITIQUES, (plus, minus)):
        expected += piece(step + "\n")
        start = len(expected)
        expected += piece(critique) + [verdict]
        loss_tokens += [(i, expected[i]) for i in range(start, len(expected))]
        expected += piece("\n")
    assert ex.input_ids == expected
    assert [(p + 1, t) for p, t in zip(ex.readout_position, ex.readout_target)] == loss_tokens
    n1, n2 = len(piece(CRITIQUES[0])), len(piece(CRITIQUES[1]))
    assert ex.readout_part == [CRITIQUE] * n1 + [VERDICT] + [CRITIQUE] * n2 + [VERDICT]
    assert [t for t, p in zip(ex.readout_target, ex.readout_part) if p == VERDICT] == [plus, minus]
    # nothing of the prompt or the steps is a target
    assert min(ex.readout_position) + 1 > len(prompt) + len(piece(STEPS[0] + "\n")) - 1


def test_unlabelled_steps_and_overlong_text_end_at_a_verdict():
    full, _, _ = encode(record())
    cut, _, _ = encode(record(labels=("+", None)))  # ProcessBench after the first error: no label
    first_end = full.readout_part.index(VERDICT) + 1
    assert cut.readout_target == full.readout_target[:first_end]
    short, _, _ = encode(record(), max_len=full.readout_position[-1] + 1)  # the last verdict no longer fits
    assert short.readout_target == full.readout_target[:first_end]


def test_weighted_loss_equals_the_hand_sum(tmp_path):
    tok = tokenizer()
    ids = (tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-"))
    ex, _, _ = encode(record())
    rows, _ = pack([ex], 256, None)
    batch = collate(rows, pad_token_id=0)
    model = tiny_model("llama", seed=5)
    args = RewardTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", process_reward=True,
        prm_kind="generative", critique_loss_weight=0.25, verdict_loss_weight=3.0,
    )  # fmt: skip
    trainer = GenPRMTrainer(model=model, args=args, reward_token_ids=ids)
    loss = trainer.compute_loss(model, batch)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0]
    logp = torch.log_softmax(logits[ex.readout_position], -1)[torch.arange(len(ex.readout_target)), ex.readout_target]
    w = torch.tensor([3.0 if p == VERDICT else 0.25 for p in ex.readout_part])
    assert loss.item() == pytest.approx((-(w * logp)).sum().item() / len(w), rel=1e-4)
    # weight 0: the critique tokens leave the loss and its count
    assert item_weights(torch.tensor([CRITIQUE, VERDICT]), 0.0, 2.0).tolist() == [0.0, 2.0]
    assert genprm_loss(torch.tensor([-1.0, -2.0]), torch.tensor([0.0, 2.0])).tolist() == [0.0, 4.0]


class Scripted(torch.nn.Module):
    """A causal LM whose next-token logits follow a script by the length of the sequence so far."""

    def __init__(self, script: dict[int, dict[int, float]], vocab: int = 20) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.script, self.vocab, self.seen = script, vocab, []

    def forward(self, input_ids, cache=None, use_cache=True):
        seq = (cache or []) + input_ids[0].tolist()
        self.seen.append(list(input_ids[0].tolist()))
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        for token, value in self.script.get(len(seq), {}).items():
            logits[0, -1, token] = value
        return type("Out", (), {"logits": logits, "cache": seq})()


def test_a_pass_writes_the_critique_until_a_verdict_and_reads_p_plus_there():
    plus, minus, sep = 10, 11, [12]
    # prompt [1, 2]; step 1 [3]: then the model writes 5, 6, then "+" (logit 2 against "-" 1)
    script = {3: {5: 9.0}, 4: {6: 9.0}, 5: {plus: 9.0, minus: 1.0}}
    # after "+" and the separator, step 2 [4] at length 8: "-" at once (logits "+" 0.5, "-" 8)
    script[8] = {plus: 0.5, minus: 8.0}
    model = Scripted(script)
    scores, critiques = judge_pass(model, [1, 2], [[3], [4]], (plus, minus), sep, max_tokens=5)
    assert critiques == [[5, 6], []]
    assert scores[0] == pytest.approx(torch.softmax(torch.tensor([9.0, 1.0]), 0)[0].item())
    assert scores[1] == pytest.approx(torch.softmax(torch.tensor([0.5, 8.0]), 0)[0].item())
    # the verdict written and the separator come before the next step
    assert model.seen == [[1, 2, 3], [5], [6], [plus], [12], [4]]  # over the cache: one token a forward
    # at the cap the verdict is read where the critique stops: one token, then p(+) of the logits there
    model = Scripted({3: {5: 9.0}, 4: {6: 9.0, plus: 3.0, minus: 4.0}})
    scores, critiques = judge_pass(model, [1, 2], [[3]], (plus, minus), sep, max_tokens=1)
    assert critiques == [[5]] and scores[0] == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


def test_a_batch_of_passes_equals_each_pass_alone():
    """judge_batch (left-padded prompts of different lengths, one token a forward for all) against judge_pass one
    solution at a time: the same critiques and scores, greedy and sampled; on the packed kernel, which builds no
    padding mask, the batch would read its padding (it runs on stock SDPA and switches back)."""
    tok = tokenizer()
    model = tiny_model("llama", seed=3).eval()
    plus, minus = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
    with torch.no_grad():  # verdict rows that win at some positions: critiques end early, at once, or at the cap
        head = model.get_output_embeddings().weight
        g = torch.Generator().manual_seed(0)
        for t in (plus, minus):
            head[t] = torch.randn(head.shape[1], generator=g) * head.std() * 3
    problems = ["What is 2 * 3?\n", "Add 17 and 25, then halve it.\n", "Q\n", "What is 2 * 3?\n"]
    solutions = [STEPS, ["17 + 25 = 42.", "42 / 2 = 21.", "The answer is 21."], [], ["x"]]
    jobs = [(tok(p)["input_ids"], [step_ids(tok, s) for s in sol]) for p, sol in zip(problems, solutions)]
    sep, pair = separator_ids(tok), (plus, minus)
    lengths = set()
    for temperature in (0.0, 1.0):
        gens = [torch.Generator().manual_seed(100 + i) if temperature else None for i in range(len(jobs))]
        alone = [judge_pass(model, p, s, pair, sep, 6, temperature, g) for (p, s), g in zip(jobs, gens)]
        gens = [torch.Generator().manual_seed(100 + i) if temperature else None for i in range(len(jobs))]
        together = judge_batch(model, jobs, pair, sep, 6, temperature, gens, tok.pad_token_id)
        assert model.config._attn_implementation == PACKED_SDPA  # switched back
        for (scores, critiques), (b_scores, b_critiques) in zip(alone, together):
            assert b_critiques == critiques
            assert b_scores == pytest.approx(scores, abs=1e-5)
            lengths |= {len(c) for c in critiques}
    assert alone[2] == ([], []) and together[2] == ([], [])  # no steps: nothing to judge
    assert {0, 6} <= lengths and lengths - {0, 6}  # at once, at the cap and in between


def test_k_sampled_critiques_are_averaged_and_seeded():
    model = tiny_model("llama", seed=2)
    tok = tokenizer()
    ids = (tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-"))
    sampled = GenerativePRM(model, tok, ids, CritiqueSettings(samples=3, max_tokens=3, temperature=1.0, seed=7))
    [j] = sampled.judge([tok("What is 2 * 3?\n")["input_ids"]], [STEPS])
    assert len(j.critiques) == 3 and len(j.pass_scores) == 3
    for k in range(2):
        assert j.scores[k] == pytest.approx(sum(p[k] for p in j.pass_scores) / 3)
    assert len({tuple(c) for c in j.critiques}) > 1  # the passes differ
    [again] = sampled.judge([tok("What is 2 * 3?\n")["input_ids"]], [STEPS])
    assert again.scores == j.scores
    # passes one at a time: the same critiques (each pass has its own stream), the scores up to float rounding
    one = GenerativePRM(model, tok, ids, CritiqueSettings(3, 3, 1.0, 7, batch_size=1))
    [alone] = one.judge([tok("What is 2 * 3?\n")["input_ids"]], [STEPS])
    assert alone.critiques == j.critiques and alone.scores == pytest.approx(j.scores, abs=1e-5)


def test_ppo_reward_reads_the_generative_scores_through_the_interface():
    from llm.alignment.ppo.interfaces import Samples
    from llm.alignment.ppo.rewards import REWARDS
    from llm.alignment.ppo.rewards.generative import GenerativePRMReward

    assert REWARDS["generative_prm"].cls is GenerativePRMReward
    tok = tokenizer()
    ids = (tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-"))
    scorer = GenerativePRM(tiny_model("llama", seed=4), tok, ids, CritiqueSettings(max_tokens=2))
    problems = ["What is 2 * 3?\n"]
    response = "\n".join(STEPS)
    samples = Samples(
        [tok(problems[0])["input_ids"]], [tok(response, add_special_tokens=False)["input_ids"]], problems,
        [response], [None], torch.tensor([True]),
    )  # fmt: skip
    reward = GenerativePRMReward(scorer.model, tok, tok, "\n", scorer, "dense")
    got, _ = reward.step_scores(samples)
    assert got == scorer.score_steps(problems, [STEPS])
    dense = reward.score(samples).dense[0]
    assert sorted(v for v in dense.tolist() if v) == pytest.approx(sorted(got[0]))  # one reward per step


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_maker_writes_template_critiques_and_resumes(tmp_path):
    from llm.run_critiques import main

    rows = [
        {"src": ["q1"], "tgt": [], "responses": ["a", "b"], "labels": ["+", "-"]},
        {"problem": "q2", "steps": ["c", "d", "e"], "label": 1},  # ProcessBench: step 2 unlabelled
    ]
    data = write(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    argv = ["--data_path", data, "--output_dir", str(out), "--positive_template", "Fine.", "--negative_template", "No."]
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"seed": 1}))
    main([str(cfg), *argv])
    made = read_jsonl(out / "critiques.jsonl")
    assert [r["critiques"] for r in made] == [["Fine.", "No."], ["Fine.", "No."]]
    assert made[1]["responses"] == ["c", "d"] and made[1]["labels"] == ["+", "-"]
    assert read_json(out / "report.json")["template_critiques"] == 4
    main([str(cfg), *argv])  # done: nothing appended
    assert len(read_jsonl(out / "critiques.jsonl")) == 2
    with pytest.raises(UserError, match="other settings"):
        main([str(cfg), *argv[:-1], "Bad."])


def test_a_judge_critique_holding_a_verdict_token_is_replaced():
    from llm.alignment.critique.make import clean

    assert clean("\n  It adds 2 and 3.\nmore", ("+", "-")) == "It adds 2 and 3."
    assert clean("2 + 3 = 5", ("+", "-")) is None and clean("   ", ("+", "-")) is None


def test_the_tiny_config_runs_as_shipped(tmp_path):
    from llm.run_reward import main

    os.chdir(ROOT)
    out = tmp_path / "out"
    main(["llm/config/tiny/genprm_argument.json", "--output_dir", str(out)])
    results = read_json(out / "all_results.json")
    assert results["train_loss"] > 0 and "eval_loss" in results
    rows = read_jsonl(out / "eval_scores.jsonl")
    assert len(rows) == 8
    for row in rows:
        assert len(row["step_scores"]) == len(row["critiques"]) == len(row["labels"])
        assert all(0 < s < 1 for s in row["step_scores"])
    right = [(s > 0.5) == (lab == "+") for r in rows for s, lab in zip(r["step_scores"], r["labels"])]
    assert results["eval_judged_step_accuracy"] == pytest.approx(sum(right) / len(right))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"critiques": ["only one"]}, "field 'critiques': has 1 critique(s) but 'responses' has 2"),
        ({"critiques": ["ok", "it is 2+3"]}, "critique 1 holds the verdict token '+'"),
        ({"critiques": None}, "has no 'critiques'"),
    ],
)
def test_bad_records_exit_2_naming_the_field(tmp_path, capsys, change, needle):
    from llm.run_reward import main
    from llm.utils.errors import run_cli

    row = {"src": ["q"], "tgt": [], "responses": ["a b", "c d"], "labels": ["+", "-"], "critiques": ["ok", "no"]}
    row.update(change)
    row = {k: v for k, v in row.items() if v is not None}
    data = write(tmp_path / "train.jsonl", [row])
    os.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            main,
            ["llm/config/tiny/genprm_argument.json", "--train_dataset_path", data, "--output_dir", str(tmp_path / "o")],
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "train.jsonl" in err and "record 0" in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--reward_tokens", "correct,wrong"], "must be exactly one token"),
        (["--critique_samples", "3"], "critique_temperature"),
    ],
)
def test_bad_settings_exit_2(tmp_path, capsys, args, needle):
    from llm.run_reward import main
    from llm.utils.errors import run_cli

    os.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, ["llm/config/tiny/genprm_argument.json", "--output_dir", str(tmp_path / "o"), *args])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_ppo_builds_the_generative_prm_reward_and_a_run_takes_it(tmp_path):
    """reward.type generative_prm from a PPO config: built with the config's critique settings, its scores equal
    the step scorer's over the same weights; one GRPO step of a run scores with it."""
    from llm.alignment.ppo.build import PPOContext, build_role
    from llm.alignment.ppo.interfaces import Samples
    from llm.run_ppo import main as ppo_main
    from llm.settings.load import parse_ppo_config
    from tests.test_ppo_run import TINY_TOKENIZER, history
    from tests.test_ppo_run import config as ppo_config

    reward = {
        "type": "generative_prm",
        "model_name_or_path": f"{ROOT}/llm/assets/tiny-prm",
        "tokenizer_name_or_path": TINY_TOKENIZER,
        "init_from_config": True,
        "max_critique_tokens": 2,
        "prm_aggregation": "min",
    }
    c = parse_ppo_config([ppo_config(tmp_path, reward=reward)])
    built = build_role(c, "reward", run=PPOContext.load(c))
    assert built.scorer.settings.max_tokens == 2
    tok = built.tokenizer
    s = Samples([tok("q\n")["input_ids"]], [[5]], ["q\n"], ["a b\nc d"], [None], torch.ones(1, dtype=bool))
    expected = built.scorer.score_steps(["q\n"], [["a b", "c d"]])[0]
    assert built.score(s).scores.tolist() == pytest.approx([min(expected)])
    out = tmp_path / "run"
    ppo_main(
        [
            ppo_config(
                tmp_path,
                reward=reward,
                training={"output_dir": str(out), "max_steps": 1},
                algorithm={"adv_estimator": "grpo"},
                actor_rollout={"num_samples_per_step": 2},
            )
        ]
    )
    assert len(history(out)) == 1 and 0 <= history(out)[0]["score"] <= 1


def test_the_reward_server_serves_the_generative_prm(tmp_path):
    from llm.alignment.rm.serve import ServeArgument, build_scorer
    from llm.settings.load import parse_arguments
    from llm.settings.reward import REWARD_ARGUMENT_TYPES

    os.chdir(ROOT)
    model_args, _, training_args = parse_arguments(
        ["llm/config/tiny/genprm_argument.json", "--output_dir", str(tmp_path)], REWARD_ARGUMENT_TYPES
    )
    served = build_scorer(model_args, training_args, ServeArgument(prm_aggregation="last"))
    answer = served.score(["q\n"], ["a b\nc d"], [None], [True])
    expected = served.reward.scorer.score_steps(["q\n"], [["a b", "c d"]])[0]
    assert answer["step_scores"][0] == pytest.approx(expected) and answer["scores"] == pytest.approx([expected[-1]])


def test_eval_only_gives_processbench_and_best_of_n_from_the_judged_scores(tmp_path):
    """An evaluation-only run on ProcessBench solutions and best-of-N candidates (no critiques): the metrics are
    those the written step scores imply, and the scores are the step scorer's over the same weights."""
    from llm.alignment.rm.evaluation import step_score_metrics
    from llm.data.readers import load_dataset_records
    from llm.run_reward import main

    os.chdir(ROOT)
    lines = []
    for name, n in (("processbench_dev.jsonl", 6), ("bon_dev.jsonl", 8)):
        with open(f"llm/data/sample/{name}", encoding="utf-8") as f:
            lines += [next(f) for _ in range(n)]
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(lines))
    out = tmp_path / "out"
    main(["llm/config/tiny/genprm_argument.json", "--output_dir", str(out), "--do_train", "false",
          "--dev_dataset_path", str(dev), "--eval_random_init", "true", "--max_critique_tokens", "2"])  # fmt: skip
    rows = read_jsonl(out / "eval_scores.jsonl")
    results = read_json(out / "eval_results.json")
    records = list(load_dataset_records(str(dev), "prm"))
    scores = [r["step_scores"] for r in sorted(rows, key=lambda r: r["index"])]
    metrics = step_score_metrics(scores, records, 0.5, None, ["min", "product", "last", "mean"], seed=42)
    assert "processbench_f1" in metrics and "bon_min@2" in metrics
    for key, value in metrics.items():
        assert results[f"eval_{key}"] == pytest.approx(value, abs=1e-6, nan_ok=True), key
    assert all("predicted_first_error" in r for r in rows[:6]) and "eval_loss" not in results


@pytest.mark.parametrize("folder", ["tiny", "smollm2"])
def test_the_genprm_configs_parse_strictly_with_their_data(folder):
    from llm.settings.load import parse_arguments
    from llm.settings.reward import REWARD_ARGUMENT_TYPES

    os.chdir(ROOT)
    _, data_args, training_args = parse_arguments([f"llm/config/{folder}/genprm_argument.json"], REWARD_ARGUMENT_TYPES)
    assert training_args.process_reward and training_args.prm_kind == "generative"
    for path in (data_args.train_dataset_path, data_args.dev_dataset_path):
        assert all(r.critiques for r in _records(path))


def _records(path):
    from llm.data.readers import load_dataset_records

    return list(load_dataset_records(path, "prm"))
