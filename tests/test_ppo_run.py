"""run_ppo.py end to end on the tiny config, the reward roles, and bad input."""

import http.server
import json
import os
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from llm.alignment.ppo.interfaces import Samples
from llm.alignment.ppo.rewards import HttpReward, PRMReward, RuleReward, char_to_token_end, split_steps
from llm.alignment.ppo.rewards.rule_functions import last_number, math_exact_match
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError, run_cli
from tests.helpers import ROOT, ppo_config_file, tiny_model, tokenizer

TINY = os.path.join(ROOT, "llm", "config", "tiny", "ppo_argument.json")
TINY_LLAMA = os.path.join(ROOT, "llm", "assets", "tiny-llama")
TINY_TOKENIZER = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")
# A model reward (random tiny ORM, seeded) so that all four roles hold models; the critic starts from it.
ORM_REWARD = {
    "type": "orm",
    "model_name_or_path": TINY_LLAMA,
    "tokenizer_name_or_path": TINY_TOKENIZER,
    "init_from_config": True,
}


SMALL = {  # two short steps of 4 prompts
    "training": {"max_steps": 2},
    "actor_rollout": {"max_response_length": 8, "ppo_mini_batch_size": 4, "ppo_epochs": 1},
    "critic": {"critic_mini_batch_size": 4, "critic_update_epochs": 1},
    "data": {"rollout_batch_size": 4},
}


def config(tmp_path, **sections):
    """The tiny demo config, small (``SMALL``), with ``sections`` merged in, written to ``tmp_path``."""
    return ppo_config_file(tmp_path, TINY, "ppo", SMALL, sections)


def history(out):
    with open(os.path.join(out, "log_history.json"), encoding="utf-8") as f:
        return json.load(f)


def test_config_parses_strictly_with_overrides(tmp_path):
    c = parse_ppo_config(
        [
            config(tmp_path),
            "--actor_rollout.learning_rate",
            "3e-4",
            "--algorithm.kl_ctrl.kl_coef",
            "0.2",
            "--max_steps",
            "7",
        ]
    )
    assert c.lr("actor_rollout") == 3e-4 and c.lr("critic") == c.critic.learning_rate
    assert c.algorithm.kl_ctrl.kl_coef == 0.2 and c.training.max_steps == 7
    with pytest.raises(UserError, match=r"actor_rollout: unknown key 'clip_ratoi'.*'clip_ratio'"):
        parse_ppo_config([config(tmp_path, actor_rollout={"clip_ratoi": 0.1})])
    with pytest.raises(UserError, match="unknown section 'algoritm'"):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"algoritm": {}}))
        parse_ppo_config([str(path)])
    with pytest.raises(UserError, match="critic has no field 'lr'"):
        parse_ppo_config([config(tmp_path), "--critic.lr", "1"])
    with pytest.raises(UserError, match="resource_pool.critic=2"):
        parse_ppo_config([config(tmp_path, resource_pool={"critic": 2})])
    with pytest.raises(UserError, match="needs actor_rollout.num_samples_per_step >= 2"):
        parse_ppo_config(
            [config(tmp_path, algorithm={"adv_estimator": "grpo"}, actor_rollout={"num_samples_per_step": 1})]
        )


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus"])
def test_each_estimator_runs_and_saves(tmp_path, estimator):
    out = tmp_path / "out"
    main(
        [
            config(
                tmp_path,
                algorithm={"adv_estimator": estimator, "kl_penalty": "low_var_kl"},
                actor_rollout={"num_samples_per_step": 2},
            )
        ]
    )
    logs = history(out)
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["policy_loss"])) for h in logs)
    assert (out / "actor" / "model.safetensors").exists()
    assert (out / "critic" / "model.safetensors").exists() == (estimator == "gae")
    for key in (
        "score",
        "kl",
        "response_length",
        "eos_rate",
        "abs_policy_loss",
        "clipfrac",
        "approx_kl",
        "entropy",
        "time/rollout",
        "time/update",
    ):
        assert key in logs[0], key
    AutoModelForCausalLM.from_pretrained(out / "actor")  # plain Hugging Face format


def test_full_kl_and_kl_loss_run(tmp_path):
    main([config(tmp_path, algorithm={"kl_penalty": "full", "kl_loss_coef": 0.0})])
    main(
        [
            config(
                tmp_path,
                algorithm={"kl_penalty": "k3", "kl_loss_coef": 0.1, "use_kl_in_reward": False},
                training={"output_dir": str(tmp_path / "out2")},
            )
        ]
    )


def test_resume_continues(tmp_path):
    out = tmp_path / "out"
    main([config(tmp_path, training={"max_steps": 4, "save_steps": 2, "save_total_limit": None})])
    full = history(out)
    resumed_dir = tmp_path / "resumed"
    import shutil

    shutil.copytree(out / "checkpoint-2", resumed_dir / "checkpoint-2")
    main(
        [
            config(
                tmp_path,
                training={
                    "max_steps": 4,
                    "save_steps": 2,
                    "output_dir": str(resumed_dir),
                    "resume_from_checkpoint": "auto",
                },
            )
        ]
    )
    again = history(resumed_dir)
    assert [h["step"] for h in again] == [1, 2, 3, 4]
    for a, b in zip(full[2:], again[2:]):
        assert a["score"] == pytest.approx(b["score"], abs=1e-6)
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-5)


def test_prompt_too_long_and_empty_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(main, [config(tmp_path, actor_rollout={"max_prompt_length": 5})])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "prompts.jsonl: record 0: the prompt has" in err and "max_prompt_length=5" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit):
        run_cli(main, [config(tmp_path, data={"train_dataset_path": str(empty)})])
    assert "empty.jsonl" in capsys.readouterr().err


def samples(responses, references=None):
    n = len(responses)
    return Samples([[1, 5]] * n, [[9]] * n, ["q"] * n, responses, references or ["7"] * n, torch.ones(n, dtype=bool))


def bad_rule_raises(prompt, response, reference):
    raise KeyError("boom")


def bad_rule_string(prompt, response, reference):
    return "high"


def test_rule_rewards():
    assert last_number("so 3 + 4 = 7. The answer is 7.") == "7" and last_number("none") is None
    assert math_exact_match("q", "The answer is 22.", "22") == 1.0
    assert math_exact_match("q", "The answer is 21.", "22") == 0.0
    scores = (
        RuleReward("llm.alignment.ppo.rewards.rule_functions:math_exact_match").score(samples(["it is 7", "8"])).scores
    )
    assert scores.tolist() == [1.0, 0.0]
    with pytest.raises(UserError, match="raised KeyError.*sample 0"):
        RuleReward("tests.test_ppo_run:bad_rule_raises").score(samples(["x"]))
    with pytest.raises(UserError, match="returned 'high'; a reward must be a finite number"):
        RuleReward("tests.test_ppo_run:bad_rule_string").score(samples(["x"]))
    with pytest.raises(UserError, match="cannot import"):
        RuleReward("no_such_module:fn")


class _Handler(http.server.BaseHTTPRequestHandler):
    delay = 0.0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.delay)
        payload = json.dumps({"scores": [float(len(r)) for r in body["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def serve(delay):
    handler = type("H", (_Handler,), {"delay": delay})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_reward_ok_slow_and_down():
    server = serve(0.0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        assert HttpReward(url, 5).score(samples(["ab", "abcd"])).scores.tolist() == [2.0, 4.0]
    finally:
        server.shutdown()
    slow = serve(2.0)
    try:
        with pytest.raises(UserError, match="timeout 0.5s"):
            HttpReward(f"http://127.0.0.1:{slow.server_address[1]}/", 0.5, max_retries=0).score(samples(["a"]))
    finally:
        slow.shutdown()
    with pytest.raises(UserError, match="reward server http://127.0.0.1:9/ failed"):
        HttpReward("http://127.0.0.1:9/", 1, max_retries=0).score(samples(["a"]))


def test_prm_dense_rewards_land_on_each_steps_last_token():
    tok = tokenizer()
    prm = tiny_model("llama").eval()
    plus, minus, ph = (tok.convert_tokens_to_ids(t) for t in ("+", "-", "ки"))
    text = "Cheese costs 3 * 4 = 12 dollars.\nThe answer is 12."
    response_ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # Samples carry the prompt as the actor saw it (decoded from its rendered ids, trailing newline included).
    s = Samples(
        [tok("How much?\n")["input_ids"]], [response_ids], ["How much?\n"], [text], ["12"], torch.tensor([True])
    )
    reward = PRMReward(prm, tok, tok, "\n", "ки", (plus, minus), ph, "dense", 4)
    out = reward.score(s)
    nonzero = out.dense[0].nonzero().flatten().tolist()
    spans = split_steps(text, "\n")
    assert len(nonzero) == 2 == len(spans)
    for k, (_, end) in zip(nonzero, spans):
        assert k == char_to_token_end(tok, response_ids, end)
        assert tok.decode(response_ids[: k + 1]).endswith(text[:end][-3:])
    # Oracle: the PRM on the placeholder text, P(+) at each placeholder.
    ids = (
        tok("How much?\n")["input_ids"]
        + tok("Cheese costs 3 * 4 = 12 dollars. ки\nThe answer is 12. ки", add_special_tokens=False)["input_ids"]
    )
    with torch.no_grad():
        logits = prm(input_ids=torch.tensor([ids])).logits[0]
    marks = [i for i, t in enumerate(ids) if t == ph]
    expected = torch.softmax(logits[marks][:, [plus, minus]], -1)[:, 0]
    assert torch.allclose(out.dense[0, nonzero], expected, atol=1e-5)
    for agg, fn in (("min", min), ("last", lambda x: x[-1]), ("mean", lambda x: sum(x) / len(x))):
        reward.aggregation = agg
        assert reward.score(s).scores.item() == pytest.approx(fn(expected.tolist()), abs=1e-5)


def test_every_ppo_config_in_tree_parses():
    import glob

    files = sorted(
        f
        for name in ("ppo*_argument.json", "grpo*_argument.json")
        for f in glob.glob(os.path.join(ROOT, "llm", "config", "*", name))
    )
    assert len(files) >= 6, files  # llama, qwen2, tiny, tiny Ray, smollm2 ppo and grpo
    for path in files:
        c = parse_ppo_config([path])
        assert c.actor_rollout.model_name_or_path and c.data.train_dataset_path


def test_forwards_pack_samples_into_rows_without_padding():
    """Role forwards pack examples into one row each, of at most micro_batch_size x the longest example:
    no padding between examples, never more positions than micro_batch_size padded examples."""
    from llm.alignment.ppo.engine import micro_batches as _micro_batches
    from llm.data.packing import causal_example

    lengths = [40, 9, 12, 31, 5, 40, 7, 22]
    examples = [causal_example(list(range(3, 3 + n)), [n - 1], [0], record=i) for i, n in enumerate(lengths)]
    batches = _micro_batches(examples, 2, torch.device("cpu"))
    assert all(len(rows) == 1 and not spare for rows, spare in batches)
    used = [len(rows[0]) for rows, _ in batches]
    assert sum(used) == sum(lengths) and max(used) <= 2 * 40
    assert sorted(r for rows, _ in batches for r in rows[0].records) == list(range(len(lengths)))
    assert len(batches) == 3  # 166 tokens in rows of 80 (greedy best fit), against 4 padded pairs
