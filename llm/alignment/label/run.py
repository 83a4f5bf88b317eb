"""The labelling run: read the problems, build the models, label each process's share of the unfinished problems,
merge and report. One process, several under torchrun (``RANK`` / ``WORLD_SIZE``: problem k of the unfinished ones
goes to process k % world), or ``ray_workers`` Ray tasks; every problem is seeded by its index
(``problem.problem_seed``), so the labels are the same under any of them and after any restart.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable

import torch

from llm.alignment.label.completer import ModelCompleter, Sampling, hf_engine, vllm_engine
from llm.alignment.label.problem import ProblemLabeller, Tools
from llm.alignment.label.store import LabelStore, report
from llm.alignment.label.verify import FunctionJudge, ModelJudge, Verifier
from llm.data.encoding import render_prompt, resolve_chat_template
from llm.data.readers import ProblemRecord, iter_records
from llm.settings.fingerprint import run_fingerprint
from llm.settings.label import LabelArguments
from llm.utils import preemption
from llm.utils.distributed import barrier
from llm.utils.errors import UserError
from llm.utils.modeling import load_model, load_tokenizer, model_stop_ids

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

Build = Callable[[LabelArguments, list[ProblemRecord], str], Tools]  # (args, the problems, device) -> Tools


def read_problems(args: LabelArguments, source: str) -> list[ProblemRecord]:
    """The problems (the first ``max_problems``), every one checked before any model loads."""
    if "," in args.problems_path:
        raise UserError(f"{source}: problems_path {args.problems_path!r}: give one file (join the files first)")
    records = iter_records(
        args.problems_path, "problem", reward_tokens=args.reward_tokens, placeholder=args.placeholder_token,
        map_keys=args.map_keys,
    )  # fmt: skip
    problems = list(itertools.islice(records, args.max_problems))
    if args.model_name_or_path is None:
        unsolved = next((p for p in problems if p.steps is None), None)
        if unsolved is not None:
            raise UserError(
                f"{unsolved.source}: record {unsolved.index}, field 'responses': the problem gives no solution and no "
                "policy is set to write one. Fix: set model_name_or_path (the policy), or give the solution's steps"
            )
    return problems


# --- the models -------------------------------------------------------------------------------------------
def _model(args: LabelArguments, path: str, device: str):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(args.tokenizer_name_or_path or path)
    model = load_model(
        AutoModelForCausalLM,
        path,
        init_from_config=args.init_from_config,
        seed=args.seed,
        dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pad_token_id=tokenizer.pad_token_id,
    ).to(device)
    return model, tokenizer


def _max_model_len(args: LabelArguments, problems: list[ProblemRecord], tokenizer, chat: bool, model) -> int:
    """vLLM's context: the longest prompt, then the longest solution (given, or at most ``max_new_tokens``
    written), then a completion; within the model's own context."""
    prompt = max(len(render_prompt(p.prompt, tokenizer, chat)) for p in problems)
    given = [len(tokenizer(args.step_separator.join(p.steps))["input_ids"]) for p in problems if p.steps]
    need = prompt + max([args.max_new_tokens, *given]) + args.max_new_tokens + 2 * args.max_solution_steps
    return min(need, getattr(model.config, "max_position_embeddings", need))


def build_tools(args: LabelArguments, problems: list[ProblemRecord], device: str) -> Tools:
    """The policy, the completer (the policy's model when the same path), the verifier and the judge."""
    rows = args.generation_batch_size
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.max_new_tokens, rows)
    completers: dict[str, ModelCompleter] = {}

    def completer(path: str) -> ModelCompleter:
        if path not in completers:
            model, tok = _model(args, path, device)
            chat = resolve_chat_template(args.use_chat_template, tok)
            if args.engine == "vllm":
                length = _max_model_len(args, problems, tok, chat, model)
                engine = vllm_engine(
                    model, tok, args.temperature, length, args.seed, args.vllm_gpu_memory_utilization, rows
                )
            else:
                engine = hf_engine(model, tok, args.temperature)
            stops = model_stop_ids(model, tok)
            completers[path] = ModelCompleter(engine, tok, sampling, chat, args.step_separator, stops)
        return completers[path]

    needs_policy = any(p.steps is None for p in problems)
    policy = completer(args.model_name_or_path) if needs_policy else None
    complete = completer(args.completer_model_name_or_path or args.model_name_or_path)
    judge = None
    if args.judge:
        judge = FunctionJudge(args.judge)
    elif args.judge_model_name_or_path:
        model, tok = _model(args, args.judge_model_name_or_path, device)
        greedy = Sampling(1.0, 1.0, 0, args.judge_max_new_tokens, rows, do_sample=False)
        chat = resolve_chat_template(args.use_chat_template, tok)
        judge = ModelJudge(
            ModelCompleter(
                hf_engine(model, tok, 1.0), tok, greedy, chat, args.step_separator, model_stop_ids(model, tok)
            )
        )
    return Tools(complete, policy, Verifier(args.verifier), judge)


def device_here() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


# --- the run ----------------------------------------------------------------------------------------------
def label_share(args: LabelArguments, share: list[ProblemRecord], rank: int, build: Build = build_tools) -> int:
    """Process ``rank`` labels the problems of ``share``, appending each one's records as it finishes."""
    if not share:
        return 0
    store = LabelStore(args.output_dir)
    store.open(rank)
    tools = build(args, share, device_here())
    start = time.perf_counter()
    for k, problem in enumerate(share, 1):
        labelled = ProblemLabeller(problem, tools, args).label()
        store.append(rank, problem.index, labelled.records, labelled.counts)
        logger.info(
            "problem %d labelled (%d of this process's %d; %d solution(s) kept, %d completions; %.1f s per problem)",
            problem.index, k, len(share), len(labelled.records), labelled.counts["generated_completions"],
            (time.perf_counter() - start) / k,
        )  # fmt: skip
    return len(share)


def run_labelling(args: LabelArguments, source: str, build: Build = build_tools) -> dict:
    """Label the problems of ``args`` (resuming a run of the same settings in ``output_dir``); rank 0 writes
    ``labels.jsonl`` and ``report.json`` and returns the report."""
    problems = read_problems(args, source)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    store = LabelStore(args.output_dir)
    if rank == 0:
        store.claim(run_fingerprint(args).values, args.overwrite_output_dir)
        already = len(set(store.finished()) & {p.index for p in problems})
        if already:
            logger.info(
                "%s: %d of the %d problems are labelled already: resuming", args.output_dir, already, len(problems)
            )
    barrier()  # the directory is claimed before any process reads its parts
    done = store.finished()
    todo = [p for p in problems if p.index not in done]  # problem k of these goes to process k % world
    if rank == 0 and len(todo) < len(problems):
        logger.info(
            "%s: %d of the %d problems are labelled already", args.output_dir, len(problems) - len(todo), len(problems)
        )
    if args.ray_workers:
        ray_label(args, todo, build)
    else:
        barrier()  # every process has read what was done before any process writes
        label_share(args, todo[rank::world], rank, build)
        barrier()
    if rank != 0:
        return {}
    records, counts = store.merge()
    out = report(counts, records, len(problems))
    store.write_report(out)
    logger.info("labels: %s (%d records); report: %s", args.output_dir, records, out)
    return out


def init_processes() -> None:
    """Under torchrun: the process group the barriers use (gloo is enough: nothing else is exchanged)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


# --- Ray --------------------------------------------------------------------------------------------------
def _ray_share(args: LabelArguments, share: list[ProblemRecord], rank: int, build: Build) -> int:
    from llm.utils.logging import configure_logging

    configure_logging(logging.WARNING)
    logging.getLogger("llm").setLevel(logging.INFO)
    return label_share(args, share, rank, build)


def ray_label(args: LabelArguments, todo: list[ProblemRecord], build: Build) -> None:
    """``ray_workers`` Ray tasks, each a share of the problems (one device each on a CUDA cluster)."""
    try:
        import ray
    except ImportError:
        raise UserError("ray_workers is set but Ray is not installed: pip install ray, or set ray_workers 0") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=args.ray_address, include_dashboard=False)
        except ConnectionError as err:
            raise UserError(f"ray_address={args.ray_address!r}: cannot reach a Ray cluster ({err})") from None
        preemption.reassert()  # ray.init installs its own SIGTERM handler
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    task = ray.remote(_ray_share).options(
        num_cpus=1, num_gpus=1 if torch.cuda.is_available() else 0, runtime_env={"env_vars": env}
    )
    try:
        world = args.ray_workers
        refs = [task.remote(args, todo[r::world], r, build) for r in range(world)]
        try:
            ray.get(refs)
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
            raise
    finally:
        if started:
            ray.shutdown()
