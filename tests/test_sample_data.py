"""The bundled sample data and the tiny tokenizer: format, labels, determinism, round trip."""

import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer

from llm.data import make_sample_data
from llm.utils import tokenizer_assets

SAMPLE_DIR = make_sample_data.SAMPLE_DIR
SAMPLE_FILES = ["prm_train", "prm_dev", "pairs_train", "pairs_dev", "prompts", "processbench_dev", "bon_dev"]
PLACEHOLDER = "ки"


def _read(name: str) -> list[dict]:
    lines = (SAMPLE_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tokenizer_assets.TINY_TOKENIZER_DIR)


# --- an independent checker of the step arithmetic (does not import the generator) ----------

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
ANSWER = re.compile(r"^The answer is (\d+)\.$")


def _equation_holds(a: int, op: str, b: int, c: int) -> bool:
    if op == "+":
        return a + b == c
    if op == "-":
        return a - b == c
    if op == "*":
        return a * b == c
    return b != 0 and b * c == a  # exact division only


def expected_labels(context: list[str], steps: list[str]) -> list[str]:
    """Math-Shepherd labels recomputed from the text.

    A step is sound if its equation holds and both operands are visible earlier: a number of
    the question (or earlier turns) or the result of an earlier step; the answer step is
    sound if it repeats the last result. A step is "+" iff it and all earlier steps are sound.
    """
    available = {int(x) for text in context for x in re.findall(r"\d+", text)}
    last = None
    labels, all_sound = [], True
    for i, step in enumerate(steps):
        answer = ANSWER.match(step)
        if answer:
            assert i == len(steps) - 1, f"answer step before the end: {steps}"
            sound = int(answer.group(1)) == last
        else:
            found = EQUATION.findall(step)
            assert len(found) == 1, f"want exactly one equation in {step!r}"
            a, op, b, c = found[0]
            a, b, c = int(a), int(b), int(c)
            assert all(0 <= v <= 99 for v in (a, b, c)), step
            sound = _equation_holds(a, op, b, c) and a in available and b in available
            available.add(c)
            last = c
        all_sound = all_sound and sound
        labels.append("+" if all_sound else "-")
    assert ANSWER.match(steps[-1]), f"last step is not an answer: {steps}"
    return labels


def first_error(context: list[str], steps: list[str]) -> tuple[int | None, str]:
    """The first unsound step (as ``expected_labels`` judges it) and why: "echo" (the result just
    repeats the number before "="), "result" (other wrong arithmetic), "carry" (an operand seen
    nowhere earlier, the arithmetic right) or "answer"; ``(None, "none")`` for a sound solution."""
    available = {int(x) for text in context for x in re.findall(r"\d+", text)}
    last = None
    for i, step in enumerate(steps):
        answer = ANSWER.match(step)
        if answer:
            return (None, "none") if int(answer.group(1)) == last else (i, "answer")
        a, op, b, c = (int(x) if x.isdigit() else x for x in EQUATION.findall(step)[0])
        if a not in available or b not in available:
            return i, "carry"
        if not _equation_holds(a, op, b, c):
            return i, "echo" if c == b else "result"
        available.add(c)
        last = c
    raise AssertionError(f"no answer step: {steps}")


def test_checker_on_hand_made_steps():
    q = ["Tony buys 3 kg of cheese at 4 dollars per kg and 2 kg of beef at 5 dollars per kg."]
    good = [
        "Cheese costs 3 * 4 = 12 dollars.",
        "Beef costs 2 * 5 = 10 dollars.",
        "In total he pays 12 + 10 = 22 dollars.",
        "The answer is 22.",
    ]
    assert expected_labels(q, good) == ["+"] * 4
    wrong_copy = good[:2] + [
        "In total he pays 13 + 10 = 23 dollars.",
        "The answer is 23.",
    ]
    assert expected_labels(q, wrong_copy) == ["+", "+", "-", "-"]
    assert expected_labels(q, good[:3] + ["The answer is 21."]) == ["+", "+", "+", "-"]
    echo = [
        "Cheese costs 3 * 4 = 4 dollars.",
        "Beef costs 2 * 5 = 10 dollars.",
        "In total he pays 4 + 10 = 14 dollars.",
    ]
    assert expected_labels(q, echo + ["The answer is 14."]) == ["-"] * 4
    assert first_error(q, good) == (None, "none")
    assert first_error(q, echo + ["The answer is 14."]) == (0, "echo")
    assert first_error(q, wrong_copy) == (2, "carry")
    assert first_error(q, good[:2] + ["In total he pays 12 + 10 = 21 dollars.", "The answer is 21."]) == (2, "result")
    assert first_error(q, good[:3] + ["The answer is 21."]) == (3, "answer")


# --- (a) the seed example ----------------------------------------------------------------


def test_seed_example_is_first_and_has_four_placeholders(tok):
    rec = _read("prm_train")[0]
    assert rec["src"][0].startswith("Tony buys 3 kg of cheese")
    assert "beef" in rec["src"][0] and rec["tgt"] == []
    assert len(rec["responses"]) == 4
    assert rec["labels"] == ["+", "+", "-", "-"]
    text = " ки\n".join(rec["responses"]) + " ки"  # PaddleNLP's joining
    ids = tok(text, add_special_tokens=False)["input_ids"]
    placeholder_id = tok.convert_tokens_to_ids(PLACEHOLDER)
    assert ids.count(placeholder_id) == 4


# --- (b) single tokens ---------------------------------------------------------------------


@pytest.mark.parametrize("token", [PLACEHOLDER, "+", "-"])
def test_placeholder_and_reward_tokens_are_single_tokens(tok, token):
    ids = tok.encode(token, add_special_tokens=False)
    assert ids == [tok.convert_tokens_to_ids(token)]
    assert ids[0] != tok.unk_token_id
    assert tok.decode(ids) == token


def test_special_tokens_and_bos(tok):
    assert [tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token] == [
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
    ]
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert PLACEHOLDER not in tok.all_special_tokens  # must survive skip_special_tokens
    plain = tok("3 * 4 = 12", add_special_tokens=False)["input_ids"]
    assert tok("3 * 4 = 12")["input_ids"] == [tok.bos_token_id, *plain]
    # every digit is its own token
    assert [t for t in tok.convert_ids_to_tokens(plain) if t.isdigit()] == [
        "3",
        "4",
        "1",
        "2",
    ]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nHi</s>\n<|assistant|>\n"


# --- (c) labels agree with the arithmetic ---------------------------------------------------


@pytest.mark.parametrize("name", ["prm_train", "prm_dev"])
def test_prm_labels_match_recomputed_arithmetic(name):
    records = _read(name)
    n_wrong = 0
    for i, rec in enumerate(records):
        assert set(rec) == {"src", "tgt", "responses", "labels"}, i
        assert len(rec["src"]) == 1 and rec["tgt"] == [], i
        steps, labels = rec["responses"], rec["labels"]
        assert 2 <= len(steps) <= 5 and len(labels) == len(steps), i
        assert not any(PLACEHOLDER in s for s in steps), i
        assert labels == expected_labels(rec["src"], steps), (name, i, rec)
        if "-" in labels:  # after the first "-" every label is "-"
            first = labels.index("-")
            assert labels[first:] == ["-"] * (len(labels) - first), (name, i)
            n_wrong += 1
    assert 0.35 < n_wrong / len(records) < 0.65  # "roughly half" carry an error


def test_pairs_have_one_correct_and_one_wrong_solution():
    for name in ("pairs_train", "pairs_dev"):
        records = _read(name)
        multi = 0
        for i, rec in enumerate(records):
            assert len(rec["src"]) == len(rec["tgt"]) + 1 and len(rec["response"]) == 2, i
            multi += len(rec["src"]) > 1
            context = [t for pair in zip(rec["src"], rec["tgt"] + [""]) for t in pair]
            chosen = rec["sort"].index(max(rec["sort"]))
            assert sorted(rec["sort"]) == [0, 1], i
            good = rec["response"][chosen].split("\n")
            bad = rec["response"][1 - chosen].split("\n")
            assert expected_labels(context, good) == ["+"] * len(good), (name, i)
            assert "-" in expected_labels(context, bad), (name, i)
        assert 0.03 < multi / len(records) < 0.2, name


def test_prompts_and_split_disjointness():
    prompts = _read("prompts")
    assert all(isinstance(r["src"], str) and r["tgt"].isdigit() for r in prompts)
    train_q = {r["src"][0] for n in ("prm_train", "pairs_train") for r in _read(n)}
    train_q |= {r["src"] for r in prompts}
    for name in ("prm_dev", "pairs_dev"):
        dev_q = [r["src"][0] for r in _read(name)]
        assert len(set(dev_q)) == len(dev_q), name
        assert not train_q & set(dev_q), name
    assert sum(p.stat().st_size for p in SAMPLE_DIR.iterdir()) < 3_000_000


def _readme_kinds(name: str) -> dict[str, int]:
    text = " ".join((SAMPLE_DIR / "README.md").read_text(encoding="utf-8").split())
    listed = re.search(rf"in `{name}`: ([a-z0-9:, ]+)[;.]", text).group(1)
    return {k: int(v) for k, v in (item.split(": ") for item in listed.split(", "))}


@pytest.mark.parametrize("name", ["prm_train", "prm_dev"])
def test_prm_error_kinds(name):
    """The PRM error mix, recomputed from the text: mostly echoes (at any equation position);
    results off and wrong copies only in the last equation; the counts are the README's."""
    kinds, echo_steps = {}, set()
    for rec in _read(name):
        steps = rec["responses"]
        step, kind = first_error(rec["src"], steps)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "echo":
            echo_steps.add(step)
        elif kind in ("result", "carry"):
            assert step == len(steps) - 2, (name, rec)  # the last equation
    assert kinds == _readme_kinds(name)
    wrong = sum(kinds.values()) - kinds["none"]
    assert kinds["echo"] > 0.6 * wrong and min(kinds.values()) > 0, kinds
    assert echo_steps == {0, 1, 2, 3}, echo_steps  # from the first equation to the fourth


# --- (d) determinism ------------------------------------------------------------------------


def test_generator_is_byte_identical(tmp_path: Path):
    make_sample_data.generate(tmp_path)
    committed = sorted(p.name for p in SAMPLE_DIR.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == committed
    assert committed == sorted([f"{n}.jsonl" for n in SAMPLE_FILES] + ["README.md"])
    for name in committed:
        assert (tmp_path / name).read_bytes() == (SAMPLE_DIR / name).read_bytes(), name


def test_tokenizer_rebuild_matches_committed_asset(tmp_path: Path):
    tokenizer_assets.main(["--out-dir", str(tmp_path)])
    committed = tokenizer_assets.TINY_TOKENIZER_DIR
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in committed.iterdir())
    for path in committed.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


# --- (e) round trip -------------------------------------------------------------------------


def test_tokenizer_round_trip_on_sample_texts(tok):
    texts = tokenizer_assets.sample_corpus()
    prm = _read("prm_dev")
    texts += [" ки\n".join(r["responses"]) + " ки" for r in prm]
    texts += ["Ünïcode ✓ 日本 \t tabs  and  spaces\n"]  # byte-level: never unknown
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
        with_bos = tok(text)["input_ids"]
        assert with_bos[0] == tok.bos_token_id
        assert tok.decode(with_bos, skip_special_tokens=True) == text
