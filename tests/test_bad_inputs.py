"""Bad input to the four flat scripts (run_reward, run_finetune, run_dpo, run_ppo) ends in one message naming
the file, record or field, exit code 2 and no traceback: corrupt or truncated weights, a missing model
directory, an ORM reward model with another tokenizer than the actor's, a misbehaving HTTP reward server, a
rule function that raises (``SystemExit`` too); over-long records that are skipped are named and counted."""

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from llm.alignment.ppo.build import Place, PPOContext, build_reward
from llm.alignment.ppo.interfaces import RoleFailure, Samples
from llm.alignment.ppo.rewards import HttpReward, ORMReward, RuleReward
from llm.data.encoding import OverlongCounter, encode_all
from llm.run_dpo import main as dpo_main
from llm.run_finetune import main as sft_main
from llm.run_ppo import main as ppo_main
from llm.run_reward import main as reward_main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError, run_cli
from tests.helpers import ROOT, tiny_model, tokenizer

TINY = os.path.join(ROOT, "llm", "config", "tiny")
SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
SAMPLE_SFT = os.path.join(ROOT, "llm", "data", "sample_sft")
TINY_LLAMA = os.path.join(ROOT, "llm", "assets", "tiny-llama")
TINY_TOKENIZER = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")
MAINS = {"reward": reward_main, "finetune": sft_main, "dpo": dpo_main, "ppo": ppo_main}
FLAT = {"reward": "rm_argument.json", "finetune": "sft_argument.json", "dpo": "dpo_argument.json"}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def head(src, n, dst):
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    dst.write_text("".join(lines))
    return str(dst)


def flat_config(tmp_path, script, **overrides):
    """A one-step run of a flat script on a few records of the bundled sample data."""
    with open(os.path.join(TINY, FLAT[script]), encoding="utf-8") as f:
        cfg = json.load(f)
    data = SAMPLE_SFT if script == "finetune" else SAMPLE
    train = "sft_train.jsonl" if script == "finetune" else "pairs_train.jsonl"
    cfg.update(
        model_name_or_path=TINY_LLAMA,
        tokenizer_name_or_path=TINY_TOKENIZER,
        train_dataset_path=head(os.path.join(data, train), 4, tmp_path / f"{script}_{train}"),
        output_dir=str(tmp_path / f"out_{script}"),
        disable_tqdm=True,
        report_to="none",
        logging_steps=1,
        warmup_steps=0,
        max_seq_len=256,
        max_prompt_len=128,
        max_steps=1,
        do_eval=False,
        save_strategy="no",
        evaluation_strategy="no",
    )
    cfg.pop("dev_dataset_path", None)
    cfg.update(overrides)
    path = tmp_path / f"cfg_{script}_{len(list(tmp_path.glob('cfg_*')))}.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False))
    return str(path)


def ppo_config(tmp_path, **sections):
    """A one-step PPO run with 2 prompts x 2 samples and 4-token responses."""
    with open(os.path.join(TINY, "ppo_argument.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["actor_rollout"].update(
        model_name_or_path=TINY_LLAMA,
        tokenizer_name_or_path=TINY_TOKENIZER,
        max_response_length=4,
        ppo_mini_batch_size=4,
        ppo_epochs=1,
    )
    cfg["training"].update(
        output_dir=str(tmp_path / "out_ppo"), report_to="none", disable_tqdm=True, max_steps=1, save_steps=0
    )
    cfg["critic"].update(critic_mini_batch_size=4, critic_update_epochs=1)
    cfg["data"].update(train_dataset_path=os.path.join(SAMPLE, "prompts.jsonl"), rollout_batch_size=2)
    for sec, values in sections.items():
        cfg.setdefault(sec, {}).update(values)
    path = tmp_path / f"ppo_{len(list(tmp_path.glob('ppo_*')))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def config_for(tmp_path, script, model):
    """``script``'s config with ``model`` as its (trained) model: the actor's for PPO."""
    if script == "ppo":
        return ppo_config(tmp_path, actor_rollout={"model_name_or_path": model, "init_from_config": False})
    return flat_config(tmp_path, script, model_name_or_path=model, init_from_config=False)


def exits_2(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        run_cli(main, argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny trained-looking model directory: config, model.safetensors, tokenizer."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    tiny_model("llama", vocab=len(tokenizer())).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return str(path)


def truncated_copy(saved_model, tmp_path, cut):
    """The model directory with its model.safetensors cut by ``cut(data) -> bytes``."""
    path = tmp_path / "corrupt"
    shutil.copytree(saved_model, path)
    weights = path / "model.safetensors"
    weights.write_bytes(cut(weights.read_bytes()))
    return str(path)


CUTS = {
    "half": lambda data: data[: len(data) // 2],
    "tail": lambda data: data[:-7],
    "empty": lambda data: b"",
    "header": lambda data: data[:8] + b"{not json" + data[17:],
}


# --- models ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", list(MAINS))
def test_corrupt_weights_process_exits_2_naming_the_file(tmp_path, saved_model, script):
    """The real command line: exit status 2, the file named, no traceback."""
    corrupt = truncated_copy(saved_model, tmp_path, CUTS["half"])
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "llm", f"run_{script}.py"), config_for(tmp_path, script, corrupt)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"{corrupt}/model.safetensors: cannot read the weights" in proc.stderr
    assert "corrupt or truncated" in proc.stderr


@pytest.mark.parametrize("cut", list(CUTS))
def test_every_kind_of_damaged_weights_is_one_message(tmp_path, saved_model, capsys, cut):
    corrupt = truncated_copy(saved_model, tmp_path, CUTS[cut])
    err = exits_2(reward_main, [config_for(tmp_path, "reward", corrupt)], capsys)
    assert "model.safetensors: cannot read the weights" in err and "save or download the model again" in err


def test_corrupt_ppo_reward_model_is_named(tmp_path, saved_model, capsys):
    corrupt = truncated_copy(saved_model, tmp_path, CUTS["tail"])
    reward = {"type": "orm", "model_name_or_path": corrupt, "init_from_config": False}
    err = exits_2(ppo_main, [ppo_config(tmp_path, reward=reward)], capsys)
    assert f"{corrupt}/model.safetensors: cannot read the weights" in err


@pytest.mark.parametrize("script", list(MAINS))
def test_missing_absolute_model_path_says_the_directory_does_not_exist(tmp_path, capsys, script):
    missing = str(tmp_path / "no" / "such-model")
    err = exits_2(MAINS[script], [config_for(tmp_path, script, missing)], capsys)
    assert missing in err and "does not exist" in err, err
    assert "Repo id" not in err


def test_missing_tokenizer_and_a_file_as_model_path(tmp_path, saved_model, capsys):
    missing = str(tmp_path / "no-tokenizer")
    err = exits_2(reward_main, [flat_config(tmp_path, "reward", tokenizer_name_or_path=missing)], capsys)
    assert f"tokenizer_name_or_path {missing!r}: the directory does not exist" in err
    weights = os.path.join(saved_model, "model.safetensors")
    err = exits_2(reward_main, [config_for(tmp_path, "reward", weights)], capsys)
    assert "is a file, not a model directory" in err


def test_config_of_another_architecture_over_the_weights_stops(tmp_path, saved_model, capsys):
    """A gpt2 config.json over Llama weights: transformers only warns that every weight is missing and would
    train a random model; here the run stops naming the weights file, the architecture and the fix."""
    mixed = tmp_path / "mixed"
    shutil.copytree(saved_model, mixed)
    gpt2 = {"model_type": "gpt2", "vocab_size": len(tokenizer()), "n_embd": 64, "n_head": 4, "n_layer": 2}
    (mixed / "config.json").write_text(json.dumps(gpt2))
    err = exits_2(reward_main, [config_for(tmp_path, "reward", str(mixed))], capsys)
    assert f"{mixed}/model.safetensors lacks" in err and "(gpt2) describes" in err, err
    assert "the config and the weights are of different models" in err
    # a config.json that cannot build its own model (64 wide, 12 heads): one message too, no traceback
    (mixed / "config.json").write_text(json.dumps({**gpt2, "n_head": 12}))
    err = exits_2(reward_main, [config_for(tmp_path, "reward", str(mixed))], capsys)
    assert "cannot build a gpt2 model from its config.json" in err, err


def test_dangling_and_looping_symlinks_as_data_paths_are_said_as_such(tmp_path, capsys):
    """os.path.exists is false for both, which used to read "does not exist"."""
    loop, dangling = tmp_path / "loop.jsonl", tmp_path / "dangling.jsonl"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone.jsonl")
    err = exits_2(reward_main, [flat_config(tmp_path, "reward", train_dataset_path=str(loop))], capsys)
    assert f"train_dataset_path '{loop}' is a loop of symbolic links" in err, err  # named before any model loads
    err = exits_2(reward_main, [flat_config(tmp_path, "reward", train_dataset_path=str(dangling))], capsys)
    assert f"is a symbolic link to {str(tmp_path / 'gone.jsonl')!r}, which does not exist" in err, err


# --- PPO: an ORM reward with another tokenizer -----------------------------------------------------------
def other_tokenizer(path):
    """A byte-level BPE of 300 tokens trained here: ids that mean other text than the tiny tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(SAMPLE, "prompts.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["src"] for line in f]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "</s>", "<s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    )
    tok.save_pretrained(path)
    with open(os.path.join(TINY_LLAMA, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(vocab_size=len(tok), pad_token_id=0, eos_token_id=1, bos_token_id=2, num_hidden_layers=1)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return tok


def test_orm_with_another_tokenizer_retokenises_and_ppo_runs(tmp_path):
    orm_dir = tmp_path / "orm"
    orm_dir.mkdir()
    other = other_tokenizer(str(orm_dir))
    actor_tok = tokenizer()
    # The reward itself re-tokenises the text (ids of the actor's vocabulary would index past its embeddings).
    model = tiny_model("llama", auto_class=AutoModelForSequenceClassification, vocab=len(other), num_labels=1)
    model.eval()
    prompts, responses = ["Tom has 3 apples."], ["He eats 1. The answer is 2."]
    ids = [actor_tok(prompts[0])["input_ids"]], [actor_tok(responses[0], add_special_tokens=False)["input_ids"]]
    assert max(ids[0][0] + ids[1][0]) >= len(other)
    samples = Samples(ids[0], ids[1], prompts, responses, [None], torch.tensor([False]))
    scores = ORMReward(model, other, actor_tok, micro_batch_size=2).score(samples).scores
    assert scores.shape == (1,) and torch.isfinite(scores).all()
    # End to end: the critic, which starts from an ORM of the actor's vocabulary, starts from the actor here.
    reward = {"type": "orm", "model_name_or_path": str(orm_dir), "init_from_config": True}
    cfg = ppo_config(tmp_path, reward=reward)
    run_cli(ppo_main, [cfg])
    assert os.path.exists(os.path.join(tmp_path, "out_ppo", "log_history.json"))


# --- PPO: the HTTP reward client -------------------------------------------------------------------------
def samples(n=2):
    return Samples(
        [[1, 5]] * n, [[9]] * n, ["q"] * n, ["a" * (i + 1) for i in range(n)], ["7"] * n, torch.ones(n, dtype=bool)
    )


class Server:
    """A local HTTP server answering each POST with the next of ``answers``: a callable taking the handler."""

    def __init__(self, *answers):
        self.answers, self.requests = list(answers), []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                server.requests.append((self.command, self.path, self.rfile.read(length)))
                answer = server.answers[min(len(server.requests), len(server.answers)) - 1]
                try:
                    answer(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_POST = do_GET = _answer

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def reply(body: bytes, status=200, headers=None, length=True):
    def answer(h):
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        if length:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return answer


def good(h):
    reply(json.dumps({"scores": [1.0, 2.0]}).encode())(h)


def drip_body(h):  # headers at once, then one byte of the body every 0.3 s: each socket read is quick
    h.send_response(200)
    h.send_header("Content-Length", "200")
    h.end_headers()
    for _ in range(200):
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.3)


def drip_status(h):  # even the status line arrives one byte every 0.3 s
    for byte in b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}":
        h.wfile.write(bytes([byte]))
        h.wfile.flush()
        time.sleep(0.3)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/score", "127.0.0.1:8000/score", "http://"])
def test_http_reward_url_must_be_http_or_https(tmp_path, capsys, url):
    with pytest.raises(UserError, match="reward.url.*only http:// and https://"):
        HttpReward(url, 5)
    err = exits_2(ppo_main, [ppo_config(tmp_path, reward={"type": "http", "url": url})], capsys)
    assert "reward.url" in err and "only http:// and https://" in err


@pytest.mark.parametrize(
    "reward, needle",
    [
        ({"timeout": "3"}, "reward.timeout"),
        ({"max_retries": 11}, "reward.max_retries must be at most 10"),
        ({"max_retries": -1}, "reward.max_retries"),
        ({"retry_backoff": 61}, "reward.retry_backoff must be at most 60"),
        ({"max_response_bytes": 0}, "reward.max_response_bytes"),
    ],
)
def test_http_reward_settings_are_typed_and_bounded(tmp_path, capsys, reward, needle):
    cfg = ppo_config(tmp_path, reward={"type": "http", "url": "http://127.0.0.1:9/", **reward})
    err = exits_2(ppo_main, [cfg], capsys)
    assert needle in err, err


def test_http_reward_settings_reach_the_client(tmp_path):
    cfg = ppo_config(
        tmp_path,
        reward={
            "type": "http",
            "url": "https://x.example/s",
            "max_retries": 0,
            "retry_backoff": 0.5,
            "max_response_bytes": 1000,
        },
    )
    c = parse_ppo_config([cfg])
    r = build_reward(c, Place(), PPOContext.load(c))
    assert (r.max_retries, r.retry_backoff, r.max_response_bytes, r.parts.scheme) == (0, 0.5, 1000, "https")


def test_http_redirect_is_an_error_naming_status_and_location():
    with Server(reply(b"", 302, {"Location": "http://elsewhere.example/score"})) as s:
        with pytest.raises(
            RoleFailure, match=r"302 Found redirecting to 'http://elsewhere.example/score'.*not followed"
        ):
            HttpReward(s.url, 5, max_retries=2, retry_backoff=0.01).score(samples())
        assert [r[0] for r in s.requests] == ["POST"]  # no GET after it, no retry


@pytest.mark.parametrize("answer", [drip_body, drip_status], ids=["body", "status-line"])
def test_http_timeout_is_one_deadline_for_the_whole_request(answer):
    with Server(answer) as s:
        start = time.monotonic()
        with pytest.raises(
            RoleFailure, match=r"failed 1 time\(s\).*no complete answer in time \(timeout 1s for the whole request\)"
        ):
            HttpReward(s.url, 1.0, max_retries=0).score(samples())
        assert time.monotonic() - start < 2.5


@pytest.mark.parametrize(
    "answer, needle",
    [
        (reply(b"x" * 5000), "more than reward.max_response_bytes=1000"),
        (reply(b"x" * 5000, length=False), "more than reward.max_response_bytes=1000"),
        (reply(b'{"scores": [1.0, \xff\xfe]}'), "not UTF-8"),
        (reply(b"<html>busy</html>"), "did not answer JSON"),
        (reply(b'{"scores": [1.0]}'), "with 2 numbers (one per sample), got 1 scores"),
        (reply(b'{"score": [1.0, 2.0]}'), "with 2 numbers"),
        (reply(b'{"scores": [1.0, "high"]}'), "a reward must be a finite number"),
        (reply(b'{"scores": [1.0, 1e39]}'), "returned 1e+39; a reward must be a finite float32 number"),
        (reply(b"no", 404), "answered HTTP 404"),
    ],
)
def test_http_bad_answers_name_the_url_and_the_problem(answer, needle):
    with Server(answer) as s:
        with pytest.raises(UserError) as info:
            HttpReward(s.url, 5, max_retries=2, retry_backoff=0.01, max_response_bytes=1000).score(samples())
        assert s.url in str(info.value) and needle in str(info.value), str(info.value)
        assert len(s.requests) == 1  # an answer that is wrong is not asked again


def test_http_retries_with_backoff_then_succeeds_or_gives_up():
    with Server(reply(b"busy", 500), reply(b"busy", 503), good) as s:
        start = time.monotonic()
        out = HttpReward(s.url, 5, max_retries=2, retry_backoff=0.2).score(samples())
        assert out.scores.tolist() == [1.0, 2.0] and len(s.requests) == 3
        assert time.monotonic() - start >= 0.2 + 0.4  # backoff 0.2 s, then doubled
        assert all(json.loads(body)["responses"] == ["a", "aa"] for _, _, body in s.requests)
    with Server(reply(b"busy", 500)) as s:
        with pytest.raises(RoleFailure, match=r"failed 3 time\(s\) \(reward.max_retries=2\): HTTP 500"):
            HttpReward(s.url, 5, max_retries=2, retry_backoff=0.01).score(samples())
        assert len(s.requests) == 3
    with pytest.raises(RoleFailure, match=r"reward server http://127.0.0.1:9/ failed 2 time\(s\)"):
        HttpReward("http://127.0.0.1:9/", 1, max_retries=1, retry_backoff=0.01).score(samples())


def test_http_redirect_stops_a_ppo_run(tmp_path, capsys):
    with Server(reply(b"", 302, {"Location": "/elsewhere"})) as s:
        cfg = ppo_config(tmp_path, reward={"type": "http", "url": s.url, "max_retries": 0})
        err = exits_2(ppo_main, [cfg], capsys)
    assert f"reward server {s.url} answered 302" in err and "'/elsewhere'" in err
    assert "The run stopped in step 1" in err


# --- PPO: rule functions ---------------------------------------------------------------------------------
def rule_exits(prompt, response, reference):
    raise SystemExit(0)


def rule_interrupts(prompt, response, reference):
    raise KeyboardInterrupt


def rule_fails(prompt, response, reference):
    raise ZeroDivisionError("division by zero")


@pytest.mark.parametrize(
    "fn, needle",
    [
        ("rule_exits", "SystemExit: 0"),
        ("rule_interrupts", "KeyboardInterrupt"),
        ("rule_fails", "ZeroDivisionError: division by zero"),
    ],
)
def test_rule_that_raises_anything_stops_naming_the_function(fn, needle):
    with pytest.raises(RoleFailure) as info:
        RuleReward(f"tests.test_bad_inputs:{fn}").score(samples())
    assert f"reward.rule tests.test_bad_inputs:{fn} raised {needle}" in str(info.value)


def test_rule_module_that_fails_on_import(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="importing exits_on_import raised SystemExit: 3"):
        RuleReward("exits_on_import:score")
    with pytest.raises(UserError, match="must be 'package.module:function'"):
        RuleReward("tests.test_bad_inputs")


def test_rule_system_exit_stops_a_ppo_run_with_a_message(tmp_path, capsys):
    cfg = ppo_config(tmp_path, reward={"type": "rule", "rule": "tests.test_bad_inputs:rule_exits"})
    err = exits_2(ppo_main, [cfg], capsys)
    assert "reward.rule tests.test_bad_inputs:rule_exits raised SystemExit: 0 on sample 0" in err
    assert "The run stopped in step 1" in err


# --- over-long records -----------------------------------------------------------------------------------
class _Rec:
    def __init__(self, source, index, n):
        self.source, self.index, self.n = source, index, n


def _encode(record, record_index, counter):
    if record.n > 10:
        counter["skipped"] += 1
        return None
    counter["ok"] += 1
    return record_index


def test_skipped_records_are_named_first_few_and_counted():
    records = [_Rec("a.jsonl", i, 20 if i % 2 else 1) for i in range(14)] + [_Rec("b.jsonl", 0, 99)]
    examples, counter = encode_all(records, _encode, "a.jsonl,b.jsonl")
    assert len(examples) == 7 and counter["skipped"] == 8
    assert counter.named() == "a.jsonl records 1, 3, 5, 7, 9 and 3 more"
    assert "8 skipped as too long (a.jsonl records 1, 3, 5, 7, 9 and 3 more" in counter.report("x")
    assert OverlongCounter().report("x") == "x: 0 kept whole, 0 truncated, 0 skipped as too long"


def _with_long_record(src, dst, index, make_long):
    with open(src, encoding="utf-8") as f:
        lines = [json.loads(next(f)) for _ in range(4)]
    lines.insert(index, make_long(lines[0]))
    dst.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
    return str(dst)


def _long_pair(rec):
    return {**rec, "response": [r + " and so on" * 200 for r in rec["response"]]}


def _long_sft(rec):
    return {**rec, "tgt": [t + " and so on" * 200 for t in rec["tgt"]]}


@pytest.mark.parametrize("script, lazy", [("reward", False), ("reward", True), ("finetune", False), ("dpo", False)])
def test_overlong_records_skipped_are_named_in_the_log_and_counted_in_results(tmp_path, capsys, script, lazy):
    sft = script == "finetune"
    src = os.path.join(SAMPLE_SFT, "sft_train.jsonl") if sft else os.path.join(SAMPLE, "pairs_train.jsonl")
    data = _with_long_record(src, tmp_path / "long.jsonl", 2, _long_sft if sft else _long_pair)
    extra = {"lazy": True, "max_steps": 5} if lazy else {}  # 4 rows a pass: the stream is read to its end
    cfg = flat_config(tmp_path, script, train_dataset_path=data, overlong_policy="skip", max_seq_len=256, **extra)
    run_cli(MAINS[script], [cfg])
    err = capsys.readouterr().err
    assert "1 skipped as too long" in err and "long.jsonl record 2" in err, err[-3000:]
    with open(os.path.join(tmp_path, f"out_{script}", "all_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    assert results["train_overlong_skipped"] == 1


def test_prm_record_skipped_is_named(tmp_path, capsys):
    def long_prm(rec):
        return {**rec, "responses": [s + " and so on" * 200 for s in rec["responses"]]}

    data = _with_long_record(os.path.join(SAMPLE, "prm_train.jsonl"), tmp_path / "long_prm.jsonl", 1, long_prm)
    cfg = flat_config(
        tmp_path,
        "reward",
        model_name_or_path=os.path.join(ROOT, "llm", "assets", "tiny-prm"),
        train_dataset_path=data,
        process_reward=True,
        overlong_policy="skip",
        max_seq_len=256,
    )
    run_cli(reward_main, [cfg])
    err = capsys.readouterr().err
    assert "long_prm.jsonl record 1" in err, err[-3000:]
    with open(os.path.join(tmp_path, "out_reward", "all_results.json"), encoding="utf-8") as f:
        assert json.load(f)["train_overlong_skipped"] >= 1


# --- settings that would train nothing (issue 22) --------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"max_steps": 0}, "max_steps is 0: nothing would be trained"),
        ({"max_steps": -1, "num_train_epochs": 0}, "num_train_epochs is 0 (and max_steps unset)"),
        ({"learning_rate": 0}, "learning_rate is 0: training would change nothing"),
    ],
)
def test_settings_that_train_nothing_stop_instead_of_saving_an_untrained_model(tmp_path, capsys, overrides, needle):
    err = exits_2(reward_main, [flat_config(tmp_path, "reward", **overrides)], capsys)
    assert needle in err, err
    assert not (tmp_path / "out_reward").exists() or not any((tmp_path / "out_reward").glob("*.safetensors"))


def test_ppo_learning_rate_0_stops(tmp_path, capsys):
    err = exits_2(ppo_main, [ppo_config(tmp_path, actor_rollout={"learning_rate": 0})], capsys)
    assert "the actor_rollout learning_rate is 0" in err, err
    err = exits_2(ppo_main, [ppo_config(tmp_path, critic={"learning_rate": 0})], capsys)
    assert "the critic learning_rate is 0" in err, err
