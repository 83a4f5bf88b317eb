"""LoRA and QLoRA for the flat trainers (SFT, DPO, reward models) with Hugging Face ``peft``.

Fields (``ModelArgument``, PaddleNLP's names where PaddleNLP has them): ``lora``, ``lora_rank``, ``lora_alpha``
(-1: 2 * rank, or 4 with ``rslora``, as PaddleNLP), ``lora_dropout``, ``target_modules`` (default: the
attention and MLP projections of Llama-shaped decoders), ``rslora``, ``lora_path`` (continue an adapter),
``lora_train_head``, ``lora_merge``, and QLoRA's ``weight_quantize_algo`` (nf4 | fp4) / ``weight_double_quant``.

What is trained: the adapters, plus
- an ORM's ``score`` head (new, so always trained; peft ``modules_to_save``);
- with ``lora_train_head``: a PRM's reward-token rows of the LM head (peft ``trainable_token_indices``: only the
  rows the PRM reads), or for SFT/DPO the whole LM head (``modules_to_save``).

What is saved: ``output_dir`` holds the PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
loaded by ``PeftModel.from_pretrained(base, output_dir)``); with ``lora_merge`` also ``output_dir/merged``, the
base with the adapter merged in, a plain Hugging Face checkpoint. Checkpoints hold the trainable parameters and
their optimizer state only (``llm.utils.distributed.save_sharded_state``); the frozen base is read again from
``model_name_or_path`` on resume.

DPO's reference with a LoRA policy is the same model with the adapter disabled (``reference_model``): no
second copy of the weights.

Where it stops at start-up: FSDP2 sharding and tensor parallelism (peft's adapters are not placed by
transformers' ``DistributedConfig``), QLoRA without CUDA or without bitsandbytes, a target that matches no
module (the message lists the module names there are), the LM head as a target (it is applied outside the
model's forward here: use ``lora_train_head``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os

import torch

from llm.utils.errors import UserError
from llm.utils.paths import resolve_input_path, tried

logger = logging.getLogger(__name__)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZE_ALGOS = ("nf4", "fp4")
MERGED_DIR = "merged"  # inside output_dir, with lora_merge
ADAPTER_CONFIG = "adapter_config.json"

# field -> its default: set without lora, each has no effect, so it stops the run
_LORA_ONLY = {
    "lora_rank": 8,
    "lora_alpha": -1,
    "lora_dropout": 0.0,
    "target_modules": None,
    "rslora": False,
    "lora_path": None,
    "lora_train_head": False,
    "lora_merge": False,
    "weight_quantize_algo": None,
    "weight_double_quant": False,
}


def is_peft_model(model: torch.nn.Module) -> bool:
    return getattr(model, "peft_config", None) is not None and hasattr(model, "disable_adapter")


def target_list(model_args) -> list[str]:
    targets = model_args.target_modules
    if targets is None:
        return list(DEFAULT_TARGETS)
    if isinstance(targets, str):
        targets = targets.split(",")
    targets = [t.strip() for t in targets if t.strip()]
    if not targets:
        raise UserError("target_modules is empty: name at least one module (default: the projections)")
    return targets


def lora_alpha(model_args) -> float:
    if model_args.lora_alpha == -1:
        return 4.0 if model_args.rslora else 2.0 * model_args.lora_rank
    return float(model_args.lora_alpha)


def check_lora_fields(args, prefix: str = "") -> None:
    """The checks of the LoRA fields every trainer shares (the flat ``ModelArgument``, PPO's actor and critic
    sections): a LoRA-only field set without ``lora``, rank / alpha / dropout / targets, ``lora_path`` (resolved
    in place). Only the fields ``args`` has are read; ``prefix`` names its section in the messages."""
    if not args.lora:
        changed = [prefix + name for name, default in _LORA_ONLY.items() if getattr(args, name, default) != default]
        if changed:
            raise UserError(
                f"{', '.join(changed)} only take(s) effect with lora: set {prefix}lora true, or remove them"
            )
        return
    if args.lora_rank <= 0:
        raise UserError(f"{prefix}lora_rank must be > 0, got {args.lora_rank}")
    if args.lora_alpha != -1 and args.lora_alpha <= 0:
        raise UserError(f"{prefix}lora_alpha must be > 0 (or -1: 2 * lora_rank), got {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        raise UserError(f"{prefix}lora_dropout must be in [0, 1), got {args.lora_dropout}")
    target_list(args)
    if args.lora_path is not None:
        found = resolve_input_path(args.lora_path)
        if found is None or not os.path.isfile(os.path.join(found, ADAPTER_CONFIG)):
            raise UserError(
                f"{prefix}lora_path {args.lora_path!r}: no PEFT adapter there (no {ADAPTER_CONFIG}; looked in: "
                f"{tried(args.lora_path)}); give the output_dir of a LoRA run"
            )
        args.lora_path = found
        shaped = [
            prefix + n
            for n in ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "rslora", "lora_train_head")
            if getattr(args, n, _LORA_ONLY[n]) != _LORA_ONLY[n]
        ]
        if shaped:
            raise UserError(
                f"{prefix}lora_path continues the adapter saved in {found} with its own rank, alpha, targets and "
                f"head: remove {', '.join(shaped)}"
            )


def check_lora_arguments(model_args, training_args) -> None:
    """Start-up checks of the LoRA fields (before anything is loaded); every problem names the field and the fix."""
    check_lora_fields(model_args)
    if not model_args.lora:
        return
    layout = training_args.layout
    if layout.native:
        raise UserError(
            f"lora with {layout.describe()}: FSDP2 sharding and tensor parallelism are not available for LoRA in "
            "this build (transformers places the base model, peft's adapters are not placed with it). Train LoRA "
            "data parallel (torchrun without sharding / tensor_parallel_degree), or set lora false"
        )
    algo = model_args.weight_quantize_algo
    if algo is None:
        if model_args.weight_double_quant:
            raise UserError("weight_double_quant needs weight_quantize_algo (nf4 or fp4)")
        return
    if algo not in QUANTIZE_ALGOS:
        raise UserError(
            f"weight_quantize_algo must be one of {', '.join(QUANTIZE_ALGOS)} (4-bit QLoRA with bitsandbytes), "
            f"got {algo!r}"
        )
    if not torch.cuda.is_available():
        raise UserError(
            f"weight_quantize_algo={algo!r} (QLoRA): the 4-bit base needs bitsandbytes on a CUDA device and this "
            "machine has none; on a CPU train plain LoRA (remove weight_quantize_algo)"
        )
    if model_args.init_from_config:
        raise UserError("weight_quantize_algo quantizes loaded weights: set init_from_config false")
    if model_args.lora_merge:
        raise UserError(
            "lora_merge with weight_quantize_algo: merging into the 4-bit base would lose the adapter's precision; "
            "merge offline against the full-precision base (PeftModel.from_pretrained(base, output_dir)"
            ".merge_and_unload())"
        )
    if training_args.fp16_opt_level == "O2":
        raise UserError("weight_quantize_algo (QLoRA) keeps the adapters in fp32: use fp16_opt_level O1")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError(
            f"weight_quantize_algo={algo!r}: bitsandbytes is not installed; pip install bitsandbytes"
        ) from None


def quantization_config(model_args, training_args):
    """transformers' ``BitsAndBytesConfig`` for QLoRA, or None (bitsandbytes is imported only when asked)."""
    if not model_args.lora or model_args.weight_quantize_algo is None:
        return None
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else torch.float32
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=model_args.weight_quantize_algo,
        bnb_4bit_use_double_quant=model_args.weight_double_quant,
        bnb_4bit_compute_dtype=compute,
        llm_int8_skip_modules=["lm_head", "score"],  # the heads stay in full precision (an ORM's score is trained)
    )


def _linear_names(model: torch.nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def _check_targets(model: torch.nn.Module, targets: list[str], head_names: set[str]) -> None:
    names = [name for name, _ in model.named_modules() if name]
    available = ", ".join(_linear_names(model))
    for target in targets:
        if target in head_names:
            raise UserError(
                f"target_modules: {target!r} is the model's head, which the trainers apply outside the model's "
                "forward: an adapter there would not be used. Remove it (lora_train_head trains the LM head)"
            )
        if not any(name == target or name.endswith("." + target) for name in names):
            raise UserError(
                f"target_modules: {target!r} matches no module of {type(model).__name__}; its linear layers are "
                f"named: {available}"
            )


def apply_lora(model, model_args, task: str, head_rows: list[int] | None = None):
    """``model`` wrapped by peft with the adapters of ``model_args`` (or those of ``lora_path``), only they (and
    the chosen head) trainable. ``task``: ``causal_lm`` (SFT, DPO, PRM) or ``seq_cls`` (ORM, ``score`` trained).
    ``head_rows``: a PRM's reward-token ids, the rows of the LM head trained with ``lora_train_head``."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training

    if getattr(model_args, "weight_quantize_algo", None) is not None:
        # norms and head in fp32, input gradients on (peft's QLoRA preparation)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if model_args.lora_path is not None:
        model = PeftModel.from_pretrained(model, model_args.lora_path, is_trainable=True)
        logger.info("LoRA: continuing the adapter of %s", model_args.lora_path)
    else:
        head = model.get_output_embeddings()
        head_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is head and name}
        if task == "seq_cls":
            head_names.add("score")
        targets = target_list(model_args)
        _check_targets(model, targets, head_names)
        modules_to_save, token_rows = None, None
        if getattr(model_args, "lora_train_head", False) and task == "causal_lm":
            if getattr(model.config, "tie_word_embeddings", False):
                raise UserError(
                    "lora_train_head: this model ties its LM head to the input embeddings, so training the head "
                    "would change the embeddings too; set lora_train_head false"
                )
            (head_name,) = head_names
            if head_rows is not None:
                token_rows = {head_name: sorted(set(head_rows))}
            else:
                modules_to_save = [head_name]
        config = LoraConfig(
            r=model_args.lora_rank,
            lora_alpha=lora_alpha(model_args),
            lora_dropout=model_args.lora_dropout,
            target_modules=targets,
            use_rslora=model_args.rslora,
            bias="none",
            task_type=TaskType.SEQ_CLS if task == "seq_cls" else TaskType.CAUSAL_LM,
            modules_to_save=modules_to_save,
            trainable_token_indices=token_rows,
        )
        model = get_peft_model(model, config)
    in_place = add_updates_in_place(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA: %d of %d parameters trainable (%.3f%%); %d adapted layers add their update in place",
        trainable,
        total,
        100.0 * trainable / max(total, 1),
        in_place,
    )
    return model


@functools.cache
def _in_place_linear() -> type:
    """peft's LoRA ``Linear`` whose forward adds the adapter's update into the base layer's output in place.

    peft computes ``result = result + lora_B(lora_A(x)) * scaling``: three temporaries of the layer's output
    size per adapted layer and step, freed at once, between the small ``lora_A`` output that autograd keeps.
    glibc's heap cannot reuse the holes they leave (each is split by the next small kept tensor), so the
    process grows: with peft's forward a LoRA step peaked above full fine-tuning of the same model (bench/README.md,
    "LoRA memory"). Here the update is one temporary, scaled and added in place: the same operations in the same
    order (bit-identical outputs and gradients), no copy of the output. The base output may be changed in place
    because nothing saves it: a frozen ``torch.nn.Linear`` keeps its input's gradient path only (its weight),
    and only such base layers get this class. Anything else (adapters disabled or merged, peft's variants such
    as DoRA, mixed-adapter batches) goes to peft's own forward."""
    from peft.tuners.lora.layer import Linear

    class InPlaceLoraLinear(Linear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if args or kwargs or self.disable_adapters or self.merged or self.lora_variant:
                return super().forward(x, *args, **kwargs)
            result = self.base_layer(x)
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_A, lora_B = self.lora_A[name], self.lora_B[name]
                update = lora_B(lora_A(self.lora_dropout[name](self._cast_input_dtype(x, lora_A.weight.dtype))))
                result.add_(update.mul_(self.scaling[name]))
            return result

    return InPlaceLoraLinear


def add_updates_in_place(model: torch.nn.Module) -> int:
    """Give every adapted plain ``torch.nn.Linear`` of the peft ``model`` the in-place forward (``_in_place_linear``);
    returns how many. The modules keep their state (a change of class only): saving, merging and
    ``disable_adapter`` are peft's."""
    from peft.tuners.lora.layer import Linear

    in_place = _in_place_linear()
    count = 0
    for module in model.modules():
        if type(module) is Linear and type(module.base_layer) is torch.nn.Linear:
            module.__class__ = in_place
            count += 1
    return count


@contextlib.contextmanager
def reference_model(model):
    """``model`` (a peft model) with its adapters disabled and in eval mode: the frozen base, as DPO's reference."""
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(was_training)


def head_bias(head: torch.nn.Module) -> torch.Tensor | None:
    """The bias of an LM head, also when peft wraps it for ``lora_train_head`` (whose ``weight`` is the merged one)."""
    token_adapter = getattr(head, "token_adapter", None)
    if token_adapter is not None:
        return token_adapter.base_layer.bias
    return head.bias


def save_merged(model, output_dir: str, tokenizer=None) -> str:
    """Write the base with the adapters merged in to ``output_dir/merged`` (a plain Hugging Face checkpoint);
    the training model is left as it is (a copy is merged). Returns the directory."""
    directory = os.path.join(output_dir, MERGED_DIR)
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    del merged
    logger.info("LoRA: merged model written to %s", directory)
    return directory


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights of the peft ``model`` with its active adapters merged in, on the CPU under the base model's plain
    Hugging Face names (what ``merge_and_unload().state_dict()`` holds), computed beside the model with peft's merge
    math (``W + get_delta_weight``): the trained model is not touched (no merge / unmerge rounding of its base)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    base = model.get_base_model()
    layers, wrappers = {}, {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layers[name] = module
        elif isinstance(module, ModulesToSaveWrapper):
            wrappers[name] = module
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            owner, _, rest = key.rpartition(".")
            while owner and owner not in layers and owner not in wrappers:
                owner, _, part = owner.rpartition(".")
                rest = f"{part}.{rest}"
            if owner in layers:
                if not rest.startswith("base_layer."):
                    continue  # lora_A / lora_B / ...: merged into the weight below
                rest = rest.removeprefix("base_layer.")
                layer = layers[owner]
                if rest == "weight" and not layer.merged and not layer.disable_adapters:
                    deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A]
                    value = (value.float() + sum(d.float() for d in deltas)).to(value.dtype) if deltas else value
            elif owner in wrappers:
                wrapper = wrappers[owner]
                active = (
                    wrapper.active_adapters[0] if wrapper.active_adapters and not wrapper.disable_adapters else None
                )
                keep = f"modules_to_save.{active}." if active is not None else "original_module."
                if not rest.startswith(keep):
                    continue
                rest = rest.removeprefix(keep)
            out[f"{owner}.{rest}" if owner else rest] = value.detach().to("cpu", copy=True)
    return out
