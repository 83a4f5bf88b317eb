"""The training command of an OpenLLaMA2 / OpenRLHF launch script, read the way bash reads it (a subset).

Read: ``#`` comments, quotes, line continuations, Windows line ends, here-documents (``<<EOF``, ``<<'EOF'``,
``<<-EOF``), assignments (``NAME=value``, ``export NAME=value``; ``NAME=value cmd`` is that command's environment),
OpenLLaMA2's ``read -r -d '' NAME <<EOF``, ``NAME=$(cat <<EOF ...)``, ``$NAME`` / ``${NAME}`` from the script
(assignments before the command) or the environment (an unquoted one split into words as bash does, its quotes
removed too), and ``;`` ``&&`` ``|`` and redirections (``2>&1 | tee log``) around the command. The training command
is the one simple command whose words, expanded, hold OpenRLHF's script: ``../train_sft.py`` (OpenLLaMA2),
``openrlhf.cli.train_sft`` or ``-m`` / ``--module`` ``train_sft``; the same command in two branches is one.
Not done: command substitution (``$(...)``, backticks) and the other ``${...}`` forms; a value of the command
holding one is refused (bash would run it). Every step is linear in the script's size; a script over ``MAX_BYTES``
is refused unread, a FIFO or device before it is opened, expansions past ``MAX_EXPANDED`` in all stop.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from llm.utils.errors import UserError
from llm.utils.paths import read_text_file, resolve_input_path, tried

MAX_BYTES = 1 << 20  # an OpenRLHF launch script is a few KB
MAX_EXPANDED = 8 << 20  # characters all variable expansions of the script produce together
_SUBSTITUTION = r"\$\((?:[^()\n]++|\([^()\n]*+\))*+\)|`[^`]*+`"  # $(...) (one nesting level), `...`: kept as text
_WORD = rf"""(?:[^\s'"\\|&;()<>$`]++|'[^']*+'|"(?:[^"\\]++|\\.)*+"|\\.|{_SUBSTITUTION}|\$\(|[$`])++"""
_TOKEN = re.compile(
    rf"""(?P<blank>(?:[ \t\f\v]|\\\n)++) | (?P<comment>\#[^\n]*+) | (?P<heredoc><<-?)(?!<)
    | (?P<redirect>\d*+(?:<<<|>>|>&|<&|<>|>\||[<>])|&>>?) | (?P<op>&&|\|\||;;|\|&|[|&;()\n]) | (?P<word>{_WORD})""",
    re.VERBOSE | re.DOTALL,
)
_DELIMITER = re.compile(rf"[ \t]*+({_WORD})", re.DOTALL)
_PART = re.compile(  # one part of a word: quoted, escaped, plain, or a quote without its pair (kept as text)
    r"""'(?P<single>[^']*+)'|"(?P<double>(?:[^"\\]++|\\.)*+)"|\\(?P<escaped>.)"""
    r"""|(?P<plain>[^'"\\]++)|(?P<stray>['"\\])""",
    re.DOTALL,
)
_FIELD = re.compile(r"""(?:[^\s'"\\]++|'[^']*+'|"(?:[^"\\]++|\\.)*+"|\\.|['"\\])++""", re.DOTALL)
_NAME = r"([A-Za-z_]\w*+|\d)"
_VAR = re.compile(rf"\$(?:\{{{_NAME}\}}|{_NAME})")
_QUOTED = re.compile(rf'\\([$`"\\\n])|\$(?:\{{{_NAME}\}}|{_NAME})')  # inside "...": escapes and variables
_BODY = re.compile(rf"\\([$`\\\n])|\$(?:\{{{_NAME}\}}|{_NAME})")  # an unquoted here-document's body
_ASSIGNMENT = re.compile(r"([A-Za-z_]\w*+)\+?=")
_TRAIN = re.compile(r"train_([a-z_]+)")
RESERVED = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "case", "esac", "{", "}", "!", "time"}
DECLARE = {"export", "readonly", "declare", "typeset", "local"}


@dataclass
class TrainingCommand:
    """The flags after OpenRLHF's script, which script (``sft``, ``ppo_ray``, ...) and whose layout runs it:
    ``openllama2`` (``train_x.py``: the model saved as ``save_path/x_model.pt``) or ``openrlhf`` (``openrlhf.cli``:
    ``save_path`` is the model's directory)."""

    args: list[str]
    runs: str
    layout: str


@dataclass
class _Command:
    words: list[str] = field(default_factory=list)  # as written
    heredocs: list[dict] = field(default_factory=list)
    start: int = 0


def script_kind(word: str, previous: str) -> tuple[str, str] | None:
    """(script, layout) when ``word`` names OpenRLHF's training script (``previous``: the word before it)."""
    base = word.rpartition("/")[2]
    if base.endswith(".py"):
        name, layout = base[:-3], "openrlhf" if "/cli/" in f"/{word}" else "openllama2"
    elif previous in ("-m", "--module") or word.startswith(("openrlhf.", "--module=")):
        name, layout = base.rpartition(".")[2], "openrlhf"
    else:
        return None
    found = _TRAIN.fullmatch(name)
    return (found.group(1), layout) if found else None


def read_training_command(path: str) -> TrainingCommand:
    """The one training command of the launch script ``path``."""
    found = resolve_input_path(path)
    if found is None:
        raise UserError(f"{path}: no such file (looked in: {tried(path)})")
    why = " (an OpenRLHF launch script is a few KB): give the script that runs the training command"
    text = read_text_file(found, path, MAX_BYTES, why).replace("\r\n", "\n")
    return _Shell(path, text).command()


class _Shell:
    def __init__(self, path: str, text: str) -> None:
        self.path, self.text, self.variables, self.gaps, self.spent = path, text, {}, {}, 0
        self.hints: list[str] = []  # why no training command was found, when none is

    def line(self, pos: int) -> int:
        return self.text.count("\n", 0, pos) + 1

    def fail(self, pos: int, why: str) -> UserError:
        return UserError(f"{self.path}: line {self.line(pos)}: {why}")

    # --- reading: simple commands, with their here-documents
    def commands(self) -> list[_Command]:
        text, pos, out, pending = self.text, 0, [_Command()], []
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise self.fail(pos, f"a quote ({text[pos]}) is never closed: close it")
            kind, raw, pos = m.lastgroup, m.group(), m.end()
            if kind == "word":
                out[-1].start = out[-1].start if out[-1].words else m.start()
                out[-1].words.append(raw)
                if text.startswith("(", pos) and _ASSIGNMENT.fullmatch(raw):  # NAME=( ... ): an array, not read
                    pos = self.array(pos + 1)
            elif kind == "redirect":  # its target (a file, 1 in 2>&1) is no word of the command
                target = _DELIMITER.match(text, pos)
                pos = target.end() if target else pos
            elif kind == "heredoc":
                target = _DELIMITER.match(text, pos)
                if target is None:
                    raise self.fail(m.start(), f"{raw} without a word that ends the here-document: add one")
                pos, delimiter = target.end(), target.group(1)
                quoted = any(c in delimiter for c in "'\"\\")
                doc = {"end": _unquote(delimiter), "quoted": quoted, "dash": raw == "<<-", "start": m.start()}
                out[-1].heredocs.append(doc)
                pending.append(doc)
            elif kind == "op":
                if raw == "\n":
                    for doc in pending:
                        doc["body"], pos = self.body(doc, pos)
                    pending = []
                out.append(_Command())
        for doc in pending:  # the last line opened one
            doc["body"], pos = self.body(doc, pos)
        return [c for c in out if c.words]

    def array(self, pos: int) -> int:
        """Past the ``)`` closing the array whose elements start at ``pos`` (its value is not read: a command
        using ``${NAME[@]}`` is refused, naming it)."""
        start = pos
        while pos < len(self.text):
            m = _TOKEN.match(self.text, pos)
            if m is None or m.lastgroup not in ("blank", "comment", "word", "op") or m.group() in "|&;(":
                break
            pos = m.end()
            if m.group() == ")":
                return pos
        raise self.fail(start, "an array NAME=( ... ) is not closed by ): close it")

    def body(self, doc: dict, pos: int) -> tuple[str, int]:
        text, lines = self.text, []
        while pos < len(text):
            end = text.find("\n", pos)
            end = len(text) if end < 0 else end
            line, pos = text[pos:end], end + 1
            line = line.lstrip("\t") if doc["dash"] else line
            if line == doc["end"]:
                return "".join(f"{line}\n" for line in lines), pos
            lines.append(line)
        why = f"the here-document <<{doc['end']} is never closed: end it with a line holding only {doc['end']}"
        raise self.fail(doc["start"], why)

    # --- expansion
    def value(self, name: str, missing: list[str]) -> str:
        if name in self.variables:
            for gap in self.gaps.get(name, ()):  # "X (through $A, $B)": X unset, read through A then B
                root, _, via = gap.partition(" (through ")
                missing.append(f"{root} (through {via[:-1] + ', ' if via else ''}${name})")
            text = self.variables[name]
        else:
            text = os.environ.get(name)
            if text is None:
                missing.append(name)
                text = ""
        self.spent += len(text)
        if self.spent > MAX_EXPANDED:
            why = "a launch script read as a config is not that large: write the training command out"
            raise UserError(f"{self.path}: its variables expand to over {MAX_EXPANDED:,} characters in all; {why}")
        return text

    def substitute(self, pattern: re.Pattern, text: str, missing: list[str]) -> str:
        def one(m: re.Match) -> str:
            if m.group(1) is not None:
                return "" if m.group(1) == "\n" else m.group(1)
            return self.value(m.group(2) or m.group(3), missing)

        return pattern.sub(one, text)

    def fields(self, raw: str, missing: list[str], split: bool = True) -> list[str]:
        """The words ``raw`` expands to (``split`` false: one text, as an assignment's value)."""
        out: list[str] = []
        now: str | None = None  # the word being built; None: none started
        for m in _PART.finditer(raw):
            plain, quoted, last = m.group("plain"), m.group("double"), 0
            if plain is None:  # '...', "..." (expanded, not split), \x
                now = (now or "") + (_piece(m) if quoted is None else self.substitute(_QUOTED, quoted, missing))
                continue
            for var in _VAR.finditer(plain):
                now = (now or "") + plain[last : var.start()] if var.start() > last else now
                last, text = var.end(), self.value(var.group(1) or var.group(2), missing)
                if not split:
                    now = (now or "") + text
                    continue
                text = text.replace("\\\n", " ")  # a continuation kept by <<'EOF' separates words
                words = [_unquote(w) for w in _FIELD.findall(text)]
                if text[:1].isspace() and now is not None:
                    out, now = out + [now], None
                for i, word in enumerate(words):
                    if i:
                        out.append(now)
                        now = None
                    now = (now or "") + word
                if words and text[-1:].isspace():
                    out, now = out + [now], None
            now = (now or "") + plain[last:] if last < len(plain) else now
        return out + ([now] if now is not None else [])

    def assign(self, word: str, doc: dict | None) -> None:
        name, missing = _ASSIGNMENT.match(word).group(1), []
        rest = word[_ASSIGNMENT.match(word).end() :]
        if rest == "$(cat" and doc is not None:  # NAME=$(cat <<EOF ... EOF )
            text = self.heredoc(doc, missing).rstrip("\n")
        else:
            text = "".join(self.fields(rest, missing, split=False))
        self.variables[name], self.gaps[name] = text, missing

    def heredoc(self, doc: dict, missing: list[str]) -> str:
        return doc["body"] if doc["quoted"] else self.substitute(_BODY, doc["body"], missing)

    def read(self, words: list[str], doc: dict) -> None:
        """``read [-r] [-d ''] NAME <<EOF``: NAME holds the document (without ``-d``: its first line)."""
        names, options, i = [], "", 0
        while i < len(words):
            if words[i].startswith("-") and len(words[i]) > 1:
                options += words[i][1:]
                i += 2 if words[i][-1] in "adinNptu" else 1
            else:
                names, i = names + [words[i]], i + 1
        if len(names) != 1:
            return
        missing: list[str] = []
        text = self.heredoc(doc, missing)
        if "d" not in options:
            text = (text if "r" in options else text.replace("\\\n", "")).partition("\n")[0]
        self.variables[names[0]], self.gaps[names[0]] = text.strip(" \t\n"), missing

    # --- the command
    def command(self) -> TrainingCommand:
        found: dict[tuple, tuple[list[str], int]] = {}
        for cmd in self.commands():
            words = cmd.words
            while words and words[0] in RESERVED:
                words = words[1:]
            assignments = 0
            while assignments < len(words) and _ASSIGNMENT.match(words[assignments]):
                assignments += 1
            doc = cmd.heredocs[0] if cmd.heredocs else None
            rest = words[assignments:]
            if not rest:
                for word in words:
                    self.assign(word, doc)
            elif rest[0] in DECLARE:
                for word in filter(_ASSIGNMENT.match, rest[1:]):
                    self.assign(word, doc)
            elif rest[0] == "read" and doc is not None:
                self.read(rest[1:], doc)
            elif rest[0].startswith("--"):  # bash: "command not found", after running the command before it
                why = "the line before does not continue (end it with \\, nothing after it)"
                raise self.fail(cmd.start, f"{rest[0]} starts a command of its own: {why}")
            elif rest[0] in ("source", ".") and len(rest) > 1:
                self.hints.append(
                    f"line {self.line(cmd.start)} reads {' '.join(self.fields(rest[1], []))}: give that script"
                )
            else:
                self.candidate(rest, cmd, found)
        if len(found) != 1:
            lines = ", ".join(str(self.line(start)) for _, start in found.values())
            what = f"{len(found)} training commands (lines {lines})" if found else "no OpenRLHF training command"
            hints = "" if found else "".join(f"; {hint}" for hint in self.hints)
            raise UserError(f"{self.path}: holds {what}: a launch script read as a config runs one (deepspeed "
                            f"../train_sft.py or --module openrlhf.cli.train_sft with its flags){hints}")  # fmt: skip
        [((runs, layout, *args), (missing, _))] = found.items()
        self.check_literal(args)
        if missing:
            raise UserError(f"{self.path}: the training command uses ${missing[0]}, which neither the script nor "
                            "the environment sets")  # fmt: skip
        return TrainingCommand(args, runs, layout)

    def candidate(self, words: list[str], cmd: _Command, found: dict) -> None:
        expanded: list[tuple[str, int]] = []  # (word, the index of the word as written)
        missing: list[list[str]] = []  # the variables each word as written names that nothing sets
        for i, raw in enumerate(words):
            missing.append([])
            expanded += [(word, i) for word in self.fields(raw, missing[i])]
        for i, (word, written) in enumerate(expanded):
            script = script_kind(word, expanded[i - 1][0] if i else "")
            if script is not None:
                key = (*script, *(w for w, _ in expanded[i + 1 :]))
                found.setdefault(key, ([name for names in missing[written:] for name in names], cmd.start))
                return
        if any(script_kind(w, "") for word, _ in expanded if " " in word for w in word.split()):
            why = 'the training command is one quoted word (bash -c "..."): write it out as a command of the script'
            self.hints.append(f"line {self.line(cmd.start)}: {why}")

    def check_literal(self, args: list[str]) -> None:
        """A value holding ``$(...)``, backticks or ``${...}`` stops: bash would have run or expanded it."""
        for i, arg in enumerate(args):
            if "$(" not in arg and "`" not in arg and "${" not in arg:
                continue
            flag = next((a for a in reversed(args[: i + 1]) if a.startswith("--")), "the training command")
            flag = flag.partition("=")[0]
            array = re.search(r"\$\{(\w+)\[", arg)
            if array:
                why = f"holds ${{{array.group(1)}[...]}}, a bash array, which this reader does not expand"
                raise UserError(f"{self.path}: {flag}: {arg!r} {why}: write its flags into the training command")
            if "${" in arg and "$(" not in arg and "`" not in arg:
                why = "holds ${...}, an expansion this reader does not do (only $NAME and ${NAME})"
            else:
                why = "holds a command substitution ($(...) or `...`), which bash would run and this reader does not"
            raise UserError(f"{self.path}: {flag}: {arg!r} {why}: write the value it stands for literally")


def _piece(m: re.Match) -> str:
    """The text of a quoted, escaped or stray part of a word, without expansion."""
    if m.group("single") is not None:
        return m.group("single")
    if m.group("double") is not None:
        return re.sub(r'\\([$`"\\\n])', lambda e: "" if e.group(1) == "\n" else e.group(1), m.group("double"))
    if m.group("escaped") is not None:
        return "" if m.group("escaped") == "\n" else m.group("escaped")
    return m.group("plain") if m.group("plain") is not None else m.group("stray")


def _unquote(word: str) -> str:
    return "".join(_piece(m) for m in _PART.finditer(word))
