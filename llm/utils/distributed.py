"""Paddle-style parallel fields -> PyTorch's own engines, and the layout-independent checkpoint.

Layout of ``WORLD_SIZE`` processes (torchrun), innermost dimension last::

    world = replicate x shard x tp
            |           |       '-- tensor_parallel_degree: DTensor tensor parallelism (the model's tp_plan)
            |           '---------- sharding_parallel_degree: FSDP2 (fully_shard) group
            '---------------------- data-parallel replicas of that group (DDP, or HSDP with sharding)

Every process of one tensor-parallel group reads the same batch; the data-parallel degree is
``replicate x shard``. Models are placed by transformers' native ``DistributedConfig`` (FSDP2 and
tensor parallelism applied at load time, each rank reading only its shard), plain data parallel by
``Trainer``'s DDP. Paddle's sharding stages map onto FSDP2 as:

    stage1, stage2 -> parameters all-gathered once per step and kept until backward
                      (``reshard_after_forward=False``); gradients and optimizer state sharded.
                      FSDP2 has no optimizer-only mode, so stage1 runs as stage2 (it saves more memory).
    stage3         -> parameters resharded after forward and gathered again for backward.
    offload        -> FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer step on CPU.

The checkpoint (``save_sharded_state`` / ``load_sharded_state``) is ``torch.distributed.checkpoint``:
every rank writes its own shards in parallel, keyed by parameter name and global shape, so a run saved
under one layout (2-way sharding, tensor parallel, DDP) resumes under any other (one process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

SHARDING_WORDS = ("stage1", "stage2", "stage3", "offload")
SHARDED_STATE_DIR = "sharded_state"  # inside checkpoint-N/: torch.distributed.checkpoint files

T = TypeVar("T")


def has_accelerator() -> bool:
    npu = getattr(torch, "npu", None)  # torch_npu registers torch.npu when it is installed
    return torch.cuda.is_available() or torch.backends.mps.is_available() or bool(npu and npu.is_available())


def barrier() -> None:
    """Wait for every rank (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def share(n: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous share of ``n`` items split over ``world`` ranks: the first ``n % world``
    ranks take one more, so shares differ by at most one and, concatenated in rank order, are ``range(n)``."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def with_spares(items: list[T], rounds: int, spare: T) -> Iterator[tuple[T, bool]]:
    """``items``, then ``spare`` until ``rounds`` in all, each with True when it is a spare.

    Under FSDP2 and tensor parallelism every forward (and backward) is a collective, so all ranks must
    make the same number of them: a rank with less work runs spare ones on ``spare`` and drops their
    output (a spare backward: a zero-weighted loss)."""
    for k in range(max(rounds, len(items))):
        yield (items[k], False) if k < len(items) else (spare, True)


def most_over_ranks(n: int, device: torch.device | str) -> int:
    """The largest ``n`` over the ranks of the default group (``n`` itself in one process)."""
    if not (_distributed() and dist.get_world_size() > 1):
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: list[float], device: torch.device | str) -> list[float]:
    """``values`` summed element-wise over the ranks of the default group (in float64; as is in one process)."""
    if not (_distributed() and dist.get_world_size() > 1) or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def backend() -> str:
    """Collective backend for this machine: NCCL on CUDA, HCCL with torch_npu, gloo on CPU."""
    if torch.cuda.is_available():
        return "nccl"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "hccl"
    return "gloo"


@dataclass(frozen=True)
class Layout:
    """How ``world`` processes split into data-parallel replicas, FSDP2 shard groups and tensor-parallel groups."""

    world: int
    tp: int = 1
    shard: int = 1
    stage: int = 0  # 0: no sharding; 1, 2, 3: Paddle sharding stage
    offload: bool = False

    @property
    def replicate(self) -> int:
        return self.world // (self.tp * self.shard)

    @property
    def dp(self) -> int:
        """Processes that read distinct batches."""
        return self.world // self.tp

    @property
    def native(self) -> bool:
        """True when transformers places the model (FSDP2 and/or tensor parallel); False: plain DDP or one process."""
        return self.tp > 1 or self.shard > 1

    def describe(self) -> str:
        parts = [f"{self.world} process(es)"]
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}")
        if self.shard > 1:
            offload = ", CPU offload" if self.offload else ""
            parts.append(f"FSDP2 stage{self.stage} over {self.shard}{offload}")
        if self.replicate > 1:
            parts.append(f"{self.replicate} data-parallel replica(s)")
        return "; ".join(parts)


def parse_layout(
    sharding: str, sharding_parallel_degree: int, tensor_parallel_degree: int, world: int | None = None
) -> Layout:
    """Validate the Paddle fields against the world size; every problem names the field and the fix."""
    world = world_size() if world is None else world
    words = sharding.replace(",", " ").split()
    bad = [w for w in words if w not in SHARDING_WORDS]
    if bad:
        raise UserError(f"sharding: unknown value(s) {bad}; use stage1, stage2 or stage3, optionally with offload")
    stages = [int(w[-1]) for w in words if w.startswith("stage")]
    if "offload" in words and not stages:
        raise UserError("sharding: 'offload' needs a stage, e.g. 'stage3 offload'")
    tp = tensor_parallel_degree
    if tp < 1 or world % tp:
        raise UserError(
            f"tensor_parallel_degree={tp} must be >= 1 and divide the number of processes ({world}): "
            f"launch with torchrun --nproc_per_node {max(tp, 1)} (or a multiple), or set it to 1"
        )
    degree = sharding_parallel_degree
    if not stages:
        if degree not in (1, -1):
            raise UserError(
                f"sharding_parallel_degree={degree} needs sharding set (stage1, stage2 or stage3): "
                "set sharding, or set sharding_parallel_degree to -1"
            )
        return Layout(world, tp)
    if degree == -1:
        degree = world // tp
    if degree < 1 or (world // tp) % degree:
        raise UserError(
            f"sharding_parallel_degree={sharding_parallel_degree} must divide the data-parallel size "
            f"{world // tp} (= {world} processes / tensor_parallel_degree {tp}); -1 uses all of them"
        )
    if degree == 1:
        logger.info("sharding=%r with a group of one process: nothing to shard, runs data parallel", sharding)
        return Layout(world, tp)
    return Layout(world, tp, degree, max(stages), "offload" in words)


def distributed_config(layout: Layout):
    """transformers' ``DistributedConfig`` for a layout that needs native placement, else None."""
    if not layout.native:
        return None
    from transformers.distributed import DistributedConfig

    # CPUOffloadPolicy pins host memory, which needs an accelerator; on a CPU-only machine the sharded
    # parameters and optimizer state live in host memory already, so offloading has nothing to move.
    offload = layout.offload and has_accelerator()
    if layout.offload and not offload:
        logger.info("sharding 'offload' on a CPU-only machine: parameters and optimizer state are in host memory")
    return DistributedConfig(
        tp_size=layout.tp,
        fsdp_size=layout.shard,
        dp_replicate_size=layout.replicate if layout.shard > 1 else 1,
        fsdp_cpu_offload=offload,
    )


def place_model(model: torch.nn.Module, layout: Layout, config) -> torch.nn.Module:
    """Shard an already built model (random weights from a config) the way ``from_pretrained`` would,
    then apply the stage's resharding rule. ``config`` is ``distributed_config(layout)``."""
    if config is not None and not getattr(model, "is_distributed_loading_by_transformers", False):
        config, _, mesh = type(model).prepare_distribute_model(config)
        model = type(model).maybe_distribute_model(model, config, mesh)
    if layout.shard > 1 and layout.stage < 3:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False, recurse=False)
    return model


@contextlib.contextmanager
def tensor_parallel_on_cpu(layout: Layout):
    """Let accelerate accept a tensor-parallel model on CPU processes (gloo).

    accelerate's ``ParallelismConfig`` check lists the accelerator device types only and refuses
    ``MULTI_CPU``, although DTensor tensor parallelism runs on gloo and the same data-parallel
    bookkeeping applies. Within this block the check sees a multi-device run; nothing else changes.
    """
    if layout.tp == 1 or has_accelerator():
        yield
        return
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig._validate_accelerator

    def validate(self, accelerator):
        state = accelerator.state
        kind = state.distributed_type
        state.distributed_type = DistributedType.MULTI_GPU if kind == DistributedType.MULTI_CPU else kind
        try:
            original(self, accelerator)
        finally:
            state.distributed_type = kind

    ParallelismConfig._validate_accelerator = validate
    try:
        yield
    finally:
        ParallelismConfig._validate_accelerator = original


# --- the layout-independent sharded checkpoint -------------------------------------------------


# Sharded (DTensor) entries stay sharded: each rank writes and reads only its own pieces.
_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)
# A peft (LoRA) model: only the trainable parameters (adapters, trained heads); the frozen base is read again from
# model_name_or_path. Loading is not strict about the frozen ones (the keys are compared below either way).
_ADAPTER_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False, ignore_frozen_params=True, strict=False)


def _options(model: torch.nn.Module) -> StateDictOptions:
    return _ADAPTER_OPTIONS if getattr(model, "peft_config", None) is not None else _OPTIONS


SHARDED_INDEX = "state.json"  # the non-tensor parts (param_groups, ...) and where each tensor goes


def unalias(tensors: dict[str, torch.Tensor]) -> int:
    """Copy every tensor of ``tensors`` whose memory an earlier one already holds (tied weights: SmolLM2's and
    Llama-3.2's input embedding is their LM head): safetensors refuses to write shared memory. Loading needs no
    counterpart: both names are written, and load into the same tied parameter. Returns how many were copied."""
    seen: set[int] = set()
    copied = 0
    for name, tensor in tensors.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: its shard's memory
        if local.numel() == 0:
            continue
        ptr = local.untyped_storage().data_ptr()
        if ptr in seen:
            tensors[name] = tensor.clone()
            copied += 1
        else:
            seen.add(ptr)
    return copied


def save_sharded_state(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Write model and optimizer state to ``directory`` (all ranks call it): torch.distributed.checkpoint with
    its Hugging Face safetensors storage, every rank writing its own shards (``shard-0000R-...safetensors``,
    each tensor with its offsets in the safetensors header), and the non-tensor parts (the optimizer's
    param_groups, ...) in ``state.json``. Nothing of it is a pickle, so loading it cannot run code."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from llm.utils.checkpoints import encode_tree, write_json_atomic

    options = _options(model)
    state = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=options)
    tensors: dict[str, torch.Tensor] = {}
    tree = encode_tree(state, tensors)
    unalias(tensors)
    os.makedirs(directory, exist_ok=True)
    writer = HuggingFaceStorageWriter(directory, save_distributed=True)
    with _single_process_is_intended():
        dcp.save(tensors, storage_writer=writer, no_dist=not _distributed())
    if not _distributed() or dist.get_rank() == 0:
        write_json_atomic(os.path.join(directory, SHARDED_INDEX), {"format": 1, "tree": tree})


def load_sharded_state(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read what ``save_sharded_state`` wrote, resharded to this run's layout (any number of processes)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException

    from llm.utils.checkpoints import decode_tree, encode_tree, read_json

    _refuse_pickled_format(directory)
    index_path = os.path.join(directory, SHARDED_INDEX)
    index = read_json(index_path)
    if not isinstance(index, dict) or not isinstance(index.get("tree"), dict):
        raise UserError(f"{index_path}: not a sharded-state index written by this project; the checkpoint is damaged")
    part = "model" if optimizer is None else "optimizer"
    saved = index["tree"].get(part)
    if saved is None:
        raise UserError(
            f"{directory}: holds no {part} state (saved with save_only_model?): resume from another checkpoint"
        )
    options = _options(model)
    if optimizer is None:
        target = get_model_state_dict(model, options=options)
    else:
        target = get_optimizer_state_dict(model, optimizer, options=options)
    tensors: dict[str, torch.Tensor] = {}
    encode_tree({part: target}, tensors)
    wanted = set(_tensor_keys(saved, part))
    if set(tensors) != wanted:
        extra, missing = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
        raise UserError(
            f"{directory}: the saved {part} state does not fit this model/optimizer "
            f"(only saved: {extra[:3]}; only here: {missing[:3]}): resume with the settings it was saved with"
        )
    try:
        with _single_process_is_intended():
            dcp.load(tensors, storage_reader=HuggingFaceStorageReader(directory), no_dist=not _distributed())
    except UserError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - a damaged or truncated shard
        first = str(err).strip().splitlines()[-1][:300] if str(err).strip() else ""
        raise UserError(f"{directory}: cannot read the sharded state ({type(err).__name__}: {first})") from None
    state = decode_tree(saved, tensors, index_path)
    if optimizer is None:
        set_model_state_dict(model, state, options=options)
    else:
        set_optimizer_state_dict(model, optimizer, state, options=options)


def _tensor_keys(tree, path: str):
    """The tensor keys ``encode_tree`` gave under ``path`` (as found in a saved tree)."""
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _tensor_keys(v, f"{path}/{i}")
    elif isinstance(tree, dict):
        if "__tensor__" in tree:
            yield tree["__tensor__"]
        elif "__tuple__" in tree:
            yield from _tensor_keys(tree["__tuple__"], path)
        elif "__items__" in tree:
            for k, v in tree["__items__"]:
                yield from _tensor_keys(v, f"{path}/{k}")
        else:
            for k, v in tree.items():
                yield from _tensor_keys(v, f"{path}/{k}")


def _refuse_pickled_format(directory: str) -> None:
    """The previous format's ``.metadata`` is a pickle (torch.distributed.checkpoint's FileSystemReader unpickles
    it): never read it."""
    if not os.path.isdir(directory):
        raise UserError(f"{directory}: missing; the checkpoint is incomplete: resume from another checkpoint")
    names = os.listdir(directory)
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        raise UserError(
            f"{directory}: written in the older torch.distributed.checkpoint format, whose .metadata file is a "
            "pickle that could run code when loaded; it is not read. Resume from a checkpoint saved by this "
            "version (safetensors + JSON), or start the run afresh"
        )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_is_intended():
    """One process reads or writes the whole checkpoint; DCP warns about that on every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
