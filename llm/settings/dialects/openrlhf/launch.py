"""OpenLLaMA2 / OpenRLHF launch scripts read as configs: ``python llm/run_ppo.py train_ppo_llama.sh``.

The script's one training command (found by ``script.py``: a heredoc, ``read -r -d '' cmds <<EOF ... EOF`` then
``deepspeed $cmds``, ``deepspeed --module openrlhf.cli.train_sft --flag v \\``, ...) must run the OpenRLHF script
matching ours; ``TABLE`` translates each flag with OpenRLHF's meaning (the argparse of OpenLLaMA2's
``examples/train_*.py``, OpenRLHF/OpenRLHF@55ccebea, and of ``openrlhf/cli/train_*.py`` at f9a8fe2d) onto our fields
(flat for sft / rm / dpo, ``llm.settings.ppo``'s sections for ppo), one line each in ``notes``, or refuses it with
what to do (the table, generated: docs/dialects.md). A flag left out takes OpenLLaMA2's default where ours
differs.
OpenLLaMA2's scripts (``train_x.py``) save ``save_path/x_model.pt``: here the model goes to ``save_path/x_model/``
(Hugging Face format), and a later script's ``save_path/x_model.pt`` loads it; OpenRLHF's CLI saves in ``save_path``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from typing import Any

from llm.settings.dialects.openrlhf.flags import DEFAULTS, SCRIPTS, TABLE, TYPES
from llm.settings.dialects.openrlhf.script import read_training_command
from llm.utils.errors import UserError, closest
from llm.utils.paths import resolve_input_path, tried

LAUNCH_SCRIPT_EXTENSIONS = (".sh",)
READERS = {"sft": "llm/run_finetune.py", "rm": "llm/run_reward.py", "dpo": "llm/run_dpo.py", "ppo": "llm/run_ppo.py"}
MAP_KEYS = {"input_key": "src", "output_key": "tgt", "label_key": "reference"}  # else the flag's name less _key


class _T:
    """One translation: the flags (``given``), our config (``out``), the notes; a ``*`` row's method per flag."""

    def __init__(self, path: str, kind: str, given: dict, defaulted: set, notes: list, layout: str) -> None:
        self.path, self.kind, self.given, self.defaulted, self.notes = path, kind, given, defaulted, notes
        self.layout = layout  # openllama2 (train_x.py: save_path/x_model.pt) or openrlhf (save_path: the model)
        self.ppo, self.out = kind == "ppo", {}

    def src(self, name: str) -> str:
        value = self.given[name]
        text = " ".join(map(str, (f"--{name}", *(value if isinstance(value, (list, tuple)) else [value]))))
        text = f"--{name}" if value is True else f"no --{name}" if value is False else text
        return f"{text} (train_{self.kind}.py's default)" if name in self.defaulted else text

    def set(self, field: str, value: Any, name: str | None, why: str = "") -> None:
        """``field`` = ``value`` from flag ``name`` (None: OpenRLHF's doing without a flag, unless a flag set it)."""
        node = self.out
        *parents, key = field.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        if key in node and (name is None or node[key] == value):
            return
        if key in node:
            raise self.fail(name, f"sets {field} = {json.dumps(value)}, which another flag set to {node[key]!r}")
        node[key] = value
        why = f" ({why})" if why else ""
        self.notes.append(f"{self.src(name) if name else '(no flag)'} -> {field} = {json.dumps(value)}{why}")

    def note(self, name: str, why: str) -> None:
        self.notes.append(f"{self.src(name)}: {why}")

    def fail(self, name: str, why: str) -> UserError:
        return UserError(f"{self.path}: --{name}: {why}")

    def field(self, flat: str, ppo: str) -> str:
        return ppo if self.ppo else flat

    def hf_dir(self, name: str, value: str) -> str:
        """A model directory. OpenLLaMA2's ``save_path/x_model.pt`` (absent) names the model that an OpenLLaMA2
        script run here saved for it, ``save_path/x_model/`` (PPO: its ``actor/``); a .pt file is never unpickled."""
        found = resolve_input_path(value)
        if not value.endswith((".pt", ".pth", ".bin")):
            if found is not None and os.path.isfile(found):
                raise self.fail(name, f"{value!r} is a file: give the Hugging Face directory of the model")
            return value
        stem = os.path.splitext(value)[0]
        saved = [resolve_input_path(d) for d in (stem, os.path.join(stem, "actor"))]
        saved = next((d for d in saved if d and os.path.isfile(os.path.join(d, "config.json"))), None)
        if found is not None:
            why = f"{value!r} is a state dict, OpenLLaMA2's .pt format; nothing is unpickled here: give the Hugging "
            instead = f"the model saved for it here, {saved}" if saved else "run_finetune.py / run_reward.py write one"
            raise self.fail(name, f"{why}Face directory of that model ({instead})")
        if saved is None:
            folder = os.path.dirname(stem)
            why = f"neither {value!r} nor the model saved for it here ({stem}/, which an OpenLLaMA2 script with "
            why += f"--save_path {folder} writes) exists: run that script first"
            others = _saved_models(folder)
            raise self.fail(
                name, why + (f"; {folder} holds {', '.join(others)}: rename the one meant" if others else "")
            )
        self.notes.append(f"{self.src(name)}: OpenLLaMA2's {os.path.basename(value)}; the model saved for it "
                          f"here, {saved}, is loaded (Hugging Face format)")  # fmt: skip
        return saved

    @functools.cached_property
    def counts(self) -> list[int | None]:
        """Records in each data file (JSON lines or a JSON array); None for a directory or another format."""
        out: list[int | None] = []
        for path in self.given.get("prompt_data" if self.ppo else "dataset", "").split(","):
            found = resolve_input_path(path.strip()) if path.strip() else None
            if found is None or os.path.isdir(found) or not found.endswith((".json", ".jsonl")):
                out.append(None)
                continue
            with open(found, encoding="utf-8") as f:
                array = f.read(256).lstrip().startswith("[")
                f.seek(0)
                out.append(len(json.load(f)) if array else sum(1 for line in f if line.strip()))
        return out

    def prompts(self, name: str) -> int:
        if None in self.counts:
            raise self.fail(name, "needs the number of prompts: give the prompts as .jsonl / .json files")
        return min(sum(self.counts), self.given["max_samples"])

    # --- models and data
    def pretrain(self, name: str, value: str) -> None:
        weights, prefix = ("sft_model_path", "actor_rollout.") if self.ppo else ("load_model", "")
        if weights in self.given:  # OpenLLaMA2: the architecture and tokenizer; the weights come from --load_model
            self.set(f"{prefix}tokenizer_name_or_path", self.hf_dir(name, value), name, f"weights: --{weights}")
        else:
            self.set(f"{prefix}model_name_or_path", self.hf_dir(name, value), name)

    def load_model(self, name: str, value: str) -> None:
        field = {"load_model": "model_name_or_path", "sft_model_path": "actor_rollout.model_name_or_path"}
        self.set(field.get(name, "ref_model_name_or_path"), self.hf_dir(name, value), name)

    def reward_model_path(self, name: str, value: str) -> None:
        if "reward_pretrain" in self.given and "reward_model_path" in self.given:
            raise self.fail(name, "--reward_pretrain and --reward_model_path both name the reward model: keep one")
        self.set("reward.type", "orm", name, "a reward model, scoring at the last token")
        self.set("reward.model_name_or_path", self.hf_dir(name, value), name)

    def critic_pretrain(self, name: str, value: str) -> None:
        if "reward_model_path" in self.given:  # OpenLLaMA2: the critic is a copy of the reward model
            self.note(name, "the architecture of the reward model, which the critic starts from, there and here")
        elif "reward_pretrain" in self.given:
            self.set("critic.model_name_or_path", self.hf_dir(name, value), name)
        else:  # OpenLLaMA2 without a trained reward model: these weights with a new value head score the samples
            self.reward_model_path(name, value)

    def dataset(self, name: str, value: str) -> None:
        paths = [p.strip() for p in value.split(",") if p.strip()]
        for p in paths:
            if "@" in p or resolve_input_path(p) is None:
                why = f"{p!r} is not a local file or directory (looked in: {tried(p)}); OpenRLHF downloads hub data "
                raise self.fail(name, why + "sets, this project reads local files: save it as .jsonl and give that")
        self.set(self.field("train_dataset_path", "data.train_dataset_path"), ",".join(paths), name)

    def max_samples(self, name: str, value: int) -> None:
        if None in self.counts and name in self.defaulted:
            return self.note(name, "not counted (a directory or Parquet): this project reads every record")
        if None in self.counts or sum(self.counts) > value:
            why = "cannot count the records" if None in self.counts else f"would keep {value} of {sum(self.counts)}"
            raise self.fail(
                name, f"{why}; this project reads every record: cut the data to {value} records or remove it"
            )
        self.note(name, f"the data has {sum(self.counts)} records: no cap")

    def input_key(self, name: str, column: str) -> None:
        """An OpenRLHF column name -> ``map_keys`` {the field this project reads: the column}."""
        ours = "prompt" if self.ppo and name == "input_key" else MAP_KEYS.get(name, name[: -len("_key")])
        if self.kind == "sft" and name == "input_key" and "output_key" not in self.given:
            ours = "messages"  # OpenRLHF: the input column holds the whole conversation
        if ours == column:
            return self.note(name, "the column this project reads")
        node = self.out.setdefault("data", {}) if self.ppo else self.out
        node["map_keys"] = {**node.get("map_keys", {}), ours: column}
        self.notes.append(f"{self.src(name)} -> {self.field('', 'data.')}map_keys[{ours!r}] = {column!r}")

    # --- sizes, steps, the rest
    def train_batch_size(self, name: str, value: int) -> None:
        micro, world = self.given["micro_train_batch_size"], int(os.environ.get("WORLD_SIZE", "1"))
        if value % (micro * world):
            why = f"{value} is OpenRLHF's global batch, micro_train_batch_size x accumulation x processes: it must be"
            raise self.fail(name, f"{why} a multiple of {micro} x {world} process(es) = {micro * world}")
        why = f"{value} / ({micro} x {world} process(es))"
        self.set("gradient_accumulation_steps", value // (micro * world), name, why)

    def max_len(self, name: str, value: int) -> None:
        pair = self.kind in ("rm", "dpo")
        why = "a pair is one row here, the prompt once and both answers: 2 x max_len holds every pair kept whole"
        self.set("max_seq_len", 2 * value if pair else value, name, why if pair else "")
        why = "OpenRLHF cuts an over-long prompt + answer at its end; here a prompt loses its start, then the answer"
        self.set("max_prompt_len", value - 1, name, why + " its end")

    def num_episodes(self, name: str, value: int) -> None:
        prompts, rollout = self.prompts(name), self.given["rollout_batch_size"]
        if prompts < rollout:
            why = f"the {prompts} prompts make no full rollout batch of {rollout} (OpenRLHF drops a partial one): "
            raise self.fail(name, why + "lower --rollout_batch_size or give more prompts")
        why = f"{value} x ({prompts} prompts // {rollout})"
        self.set("training.max_steps", value * (prompts // rollout), name, why)

    def lr_warmup_ratio(self, name: str, value: float) -> None:
        g = self.given
        steps = g["num_episodes"] * (self.prompts(name) * g.get("n_samples_per_prompt", 1) // g["train_batch_size"])
        why = "of OpenRLHF's optimizer steps; it then decays the learning rates on a cosine, here they stay constant"
        self.set("training.lr_warmup_steps", math.ceil(value * steps * g["max_epochs"]), name, why)

    def lr_scheduler(self, name: str, value: str) -> None:
        self.set("lr_scheduler_type", value, name)
        if value == "cosine_with_min_lr":
            self.set("lr_scheduler_kwargs", {"min_lr_rate": 0.1}, name, "OpenRLHF's min_lr: 0.1 x learning_rate")

    def save_path(self, name: str, value: str) -> None:
        field = self.field("output_dir", "training.output_dir")
        if self.layout != "openllama2":
            return self.set(field, value, name, "the final model, Hugging Face format")
        model = f"{self.kind}_model"
        why = f"OpenLLaMA2 saves {value}/{model}.pt; here its Hugging Face model, which a later {model}.pt loads"
        self.set(field, os.path.join(value, model), name, why)

    def save_steps(self, name: str, value: int) -> None:
        if self.ppo:
            return self.set("training.save_steps", max(value, 0), name, "" if value > 0 else "no checkpoints")
        self.set("save_strategy", "steps" if value > 0 else "no", name)
        if value > 0:
            self.set("save_steps", value, name)

    def eval_steps(self, name: str, value: int) -> None:
        if value <= 0:
            return self.note(name, "no evaluation during training")
        self.set("eval_strategy", "steps", name)
        why = "give --dev_dataset_path FILE after the script: OpenRLHF evaluates its data set's test split"
        self.set("eval_steps", value, name, why)

    def lora_rank(self, name: str, value: Any) -> None:
        if self.given.get("lora_rank", 0) <= 0:
            return self.note(name, "no LoRA: every weight trains" if name == "lora_rank" else "read only with LoRA")
        if value in ("all-linear", ["all-linear"]):
            return self.note(name, "every linear layer of the decoder: this project's default projections")
        for prefix in ("actor_rollout.", "critic.") if self.ppo else ("",):
            if name == "lora_rank":
                self.set(prefix + "lora", True, name)
                if "lora_alpha" not in self.given:
                    self.set(prefix + "lora_alpha", 16, name, "OpenRLHF's default alpha")
            self.set(prefix + name, value, name)

    def normalize_reward(self, name: str, value: bool) -> None:
        model = self.out.get("reward", {}).get("model_name_or_path", "")
        with open(resolve_input_path(os.path.join(model, "config.json")) or os.devnull, encoding="utf-8") as f:
            config = json.loads(f.read() or "{}")
        if config.get("mean", 0) != 0 or config.get("std", 1) != 1:
            why = f"{model} stores a mean and std, which OpenRLHF applies; reward.normalize_reward here uses running "
            raise self.fail(name, why + "batch moments: remove the flag, or fold (r - mean) / std into the score head")
        self.note(name, "the reward model stores no mean / std: OpenRLHF's (r - 0) / 1 changes nothing")

    def policy_loss_type(self, name: str, value: str) -> None:
        """ppo (with --dual_clip: dual_clip) or gspo; OpenRLHF's dual-clip bounds the ppo loss only."""
        ours = {"ppo": "dual_clip" if self.given.get("dual_clip") is not None else "vanilla", "gspo": "gspo"}
        if value not in ours:
            raise self.fail(name, f"{value!r}: ppo or gspo here (actor_rollout.policy_loss also has cispo)")
        self.set("actor_rollout.policy_loss", ours[value], name)

    def dual_clip(self, name: str, value: float) -> None:
        if self.given.get("policy_loss_type", "ppo") != "ppo":
            raise self.fail(name, "dual-clip bounds the ppo loss only: remove it, or use --policy_loss_type ppo")
        self.set("actor_rollout.policy_loss", "dual_clip", name)
        self.set("actor_rollout.clip_ratio_c", value, name, "a negative advantage's loss is at most c |A|")

    def reward_clip_range(self, name: str, value: tuple) -> None:
        if value[0] != -value[1] or value[1] <= 0:
            raise self.fail(name, f"{value}: a symmetric range (-c, c) only (reward.reward_clip c)")
        self.set("reward.reward_clip", value[1], name, "the score clipped to [-c, c] before the KL is added")

    sft_model_path = ref_pretrain = load_model
    reward_pretrain = reward_model_path
    prompt_data = dataset
    output_key = label_key = prompt_key = chosen_key = rejected_key = input_key
    lora_alpha = lora_dropout = target_modules = lora_rank


Handler = Callable[[_T, str, Any], None]


def _saved_models(folder: str) -> list[str]:
    """The ``x_model`` directories in ``folder`` (what OpenLLaMA2 scripts run here saved), for a hint."""
    found = resolve_input_path(folder or ".")
    return sorted(d for d in os.listdir(found) if d.endswith("_model")) if found and os.path.isdir(found) else []


def _rule(action: str, type_: Any) -> Handler:
    """A ``TABLE`` action as a handler."""
    if action == "*":
        return lambda t, name, value: getattr(t, name)(name, value)
    kind = "->" if action.startswith("->") else action[0]
    body, _, why = action[len(kind) :].partition(" ~ ") if kind in "->=" else ("", "", action[1:].strip())
    why, _, fix = why.partition(" ! ")
    accepted = [_typed(type_, [text], "TABLE", "") for text in body.split(",")] if kind == "=" else []
    sides = body.split("|") if kind == "->" else ["", ""]

    def apply(t: _T, name: str, value: Any) -> None:
        side = sides[t.ppo].strip()
        if kind == "!" or side.startswith("!") or value not in accepted and kind == "=":
            raise t.fail(name, why if kind == "!" else side[1:].strip() or f"{value}: {fix}")
        if not side:
            return t.note(name, why)
        fields = side.split()
        split = isinstance(value, tuple) and len(value) == len(fields)
        for field, own in zip(fields, value if split else (value,) * len(fields)):
            field, eq, const = field.partition("=")
            if const.startswith("%"):  # a choice: OpenRLHF's value -> ours
                choices = {k: v or k for k, _, v in (pair.partition(":") for pair in const[1:].split(","))}
                if own not in choices:
                    raise t.fail(name, f"{own!r} is not available here: one of {', '.join(choices)}")
                const = choices[own]
            const = t.given[const[1:]] if const.startswith("@") else {"true": True, "false": False}.get(const, const)
            t.set(field, const if eq else own, name, why)

    return apply


def _typed(kind: Any, values: list[str], name: str, path: str) -> Any:
    count = {bool: 0, tuple: 2}.get(kind, 1)
    if kind is not list and len(values) != count:
        raise UserError(f"{path}: --{name} takes {count or 'no'} value{'s' if count > 1 else ''}, got {values}")
    try:
        if kind is bool:
            return True
        return tuple(float(v) for v in values) if kind is tuple else values if kind is list else kind(values[0])
    except ValueError:
        word = {int: "a whole number", float: "a number"}.get(kind, "two numbers")
        raise UserError(f"{path}: --{name} must be {word} (OpenRLHF's type), got {' '.join(values)!r}") from None


FLAGS: dict[str, dict[str, tuple[Any, Handler]]] = {}  # flag -> {OpenRLHF script: (type, handler)}
for _line in TABLE.strip().splitlines():
    _names, _type, _scripts, _action = _line.split(None, 3)
    for _name in _names.split(","):
        for _kind in SCRIPTS.get(_scripts) or _scripts.split(","):
            FLAGS.setdefault(_name, {})[_kind] = (TYPES[_type], _rule(_action, TYPES[_type]))


# --- the script's flags ------------------------------------------------------------------------------
def _parse_flags(args: list[str], kind: str, path: str) -> dict[str, Any]:
    given: dict[str, Any] = {}
    known = [name for name, kinds in FLAGS.items() if kind in kinds]
    i = 0
    while i < len(args):
        if not args[i].startswith("--") or len(args[i]) == 2:
            why = " (a space after a line's \\ escapes the space, and the line does not continue)"
            raise UserError(
                f"{path}: {args[i]!r} in the training command is not a --flag{why if args[i].isspace() else ''}"
            )
        name, eq, text = args[i][2:].partition("=")
        if name not in known:
            raise UserError(f"{path}: --{name}: not a flag of OpenRLHF's train_{kind} that this reader knows; "
                            f"closest: {closest(name, known)}")  # fmt: skip
        if name in given:
            raise UserError(f"{path}: --{name} is given twice (OpenRLHF would take the last): keep one")
        values, i = ([text] if eq else []), i + 1
        while not eq and i < len(args) and not args[i].startswith("--"):
            values, i = values + [args[i]], i + 1
        given[name] = _typed(FLAGS[name][kind][0], values, name, path)
    return given


def read_launch_script(path: str, script: str, notes: list[str]) -> dict:
    """The config (this project's layout: flat for sft / rm / dpo, sections for ppo) that the OpenLLaMA2 /
    OpenRLHF command in the launch script ``path`` asks for; ``script`` is which of our scripts reads it."""
    command = read_training_command(path)
    runs = command.runs
    kind = runs.removesuffix("_ray")  # train_ppo_ray: train_ppo's flags and Ray's (refused: not known here)
    if kind != script:
        where = f"read it with python {READERS[kind]} {path}" if kind in READERS else "no counterpart here"
        raise UserError(f"{path}: runs OpenRLHF's train_{runs}: {where} (this is {READERS[script]})")
    given = _parse_flags(command.args, kind, path)
    defaults = {**DEFAULTS["all"], **DEFAULTS[kind]}
    defaulted = {name for name in defaults if name not in given}
    t = _T(path, kind, {**given, **{name: defaults[name] for name in defaulted}}, defaulted, notes, command.layout)
    notes.append(f"OpenRLHF's train_{runs}: each flag's translation follows (one process here; torchrun for several)")
    for name, kinds in FLAGS.items():
        if name in t.given:
            kinds[kind][1](t, name, t.given[name])
    if t.ppo and "model_name_or_path" not in t.out.get("reward", {}):  # else our default reward would score
        raise UserError(f"{path}: --reward_pretrain (OpenLLaMA2: --critic_pretrain) is required: the reward model")
    why = "OpenRLHF logs only with --use_wandb / --use_tensorboard"
    t.set(t.field("report_to", "training.report_to"), "none", None, why)
    if t.ppo:
        t.set("actor_rollout.top_k", 50, None, "OpenRLHF's generate() leaves top_k at transformers' default")
        t.set("actor_rollout.do_sample", True, None, "OpenRLHF samples")
    else:
        t.set("do_train", True, None, f"train_{kind}.py trains")
    return t.out
