"""PPO roles in Ray actors: placement only. The roles (whatever ``build(config, name, place)`` makes: the
caller, build.py, hands over ``build_role``) are each built inside Ray actor processes and reached
through a proxy with the same methods (``resource_pool.use_ray``); nothing here knows the algorithm.

    driver: PPOTrainer --RemoteRole("actor_rollout")--ray.get(timeout)--> [rank 0][rank 1]  ActorRole, FSDP2 over 2
                       --RemoteRole("ref")------------------------------> [ ]               PolicyModel
                       --RemoteRole("critic")---------------------------> [ ]               CriticRole + ORMReward
                       --RemoteRole("reward")---------------------------/                   (colocated)
                       --RemoteRole("rollout")--------------------------> [ ]               PolicyModel (rollout copy)

(``actor_rollout: 2``, ``colocate: [["critic", "reward"]]``, ``rollout: 0.5``; the others a share).
One worker process per rank: a role (or colocated group) given a share of one device (< 1) or one
device is one worker; given N devices, N workers that join one torch.distributed group (gloo on CPU,
NCCL on GPU) and shard the role's models with FSDP2 (stage 3). The group is data parallel too:

- forward calls (``log_probs``, ``values``, ``score``, ``generate``): the proxy sends rank r its
  contiguous slice of the samples (prompts), the first ``B % N`` ranks one more, and concatenates the
  results in order (token tensors zero-padded to the longest response), equal to one process. Each
  forward all-gathers parameters, so ranks with fewer micro-batches run spare forwards (output
  dropped) up to the most any rank has (``engine.micro_batches``, one all-reduce of the count);
  ``generate`` steps the ranks together with HF's ``synced_gpus`` and rank r samples from
  ``seed * N + r``, so sampled responses depend on N (greedy ones do not).
- ``update``: every rank gets the whole batch and mini-batch orders and runs its contiguous share of
  each mini-batch, plus zero-weighted spare micro-batches up to the largest share's count; the loss
  stays normalised by the whole mini-batch's tokens and the gradients are summed over the ranks
  (divide factor 1, ``fsdp.sum_gradients``), so each optimizer step is one process's on the whole
  mini-batch. The stats (losses, clipfrac, KL, entropy) are summed over the ranks (one all-reduce).
- weights, checkpoints: every rank takes part in the gathers; the first rank's result is the answer.

Each role counts the samples it ran forwards over (``samples_seen``; ``RemoteRole.per_rank``).
Placement: one placement group, one bundle per worker (``{"CPU": share}``,
``{"GPU": share, "CPU": 1}``, one whole device per rank of a group), packed onto as few nodes as fit.

Failures never hang the run: every call waits at most ``resource_pool.call_timeout`` seconds and the
weight sync ``resource_pool.weight_sync_timeout``; the first worker that dies ends the wait at once
(its group's other ranks would block in a collective), and a death or a timeout raises
``RoleFailure`` naming the role, the call and the processes; the trainer adds where its last
checkpoint is. On exit every worker is killed and the placement group removed.

Ray is imported only here, when a config asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llm.alignment.ppo.interfaces import RoleFailure
from llm.settings.ppo import PPOConfig, ResourcePool
from llm.utils import preemption
from llm.utils.distributed import share
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError(
            "resource_pool.use_ray is true but Ray is not installed: pip install ray (or set use_ray false to run "
            "every role in this process)"
        ) from None
    return ray


class RoleWorker:
    """The body of one Ray actor: builds its roles in its own process (``build``: a module-level function, or a
    ``functools.partial`` of one, pickled by reference, so the worker imports its module; the partial's arguments
    travel by value) and runs their methods."""

    def __init__(self, config: PPOConfig, build: Callable) -> None:
        self.config, self.build_role = config, build
        self.roles: dict = {}

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, for the group's first rank to listen on."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def build(
        self, names: list[str], device: str, rank: int, world: int, master: tuple[str, int] | None
    ) -> tuple[int, str]:
        """Join the group (``world`` > 1) and build ``names`` here. A separate call from the constructor,
        so that a bad config arrives as the UserError it is."""
        import torch
        import torch.distributed as dist

        from llm.alignment.ppo.loading import Place
        from llm.utils.distributed import Layout, backend
        from llm.utils.logging import configure_logging

        configure_logging(logging.WARNING)
        logging.getLogger("llm").setLevel(logging.INFO)
        layout = None
        if world > 1:
            # Ray shows each worker only its own device: it is device 0 here.
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            if device == "cuda":
                torch.cuda.set_device(0)
            init = f"tcp://{master[0]}:{master[1]}"
            dist.init_process_group(backend(), init_method=init, rank=rank, world_size=world)
            layout = Layout(world, shard=world, stage=3)
        for name in names:
            self.roles[name] = self.build_role(self.config, name, Place(device, layout), self.roles)
        return os.getpid(), socket.gethostname()

    def call(self, role: str, method: str, *args, **kwargs):
        return getattr(self.roles[role], method)(*args, **kwargs)

    def attribute(self, role: str, name: str):
        return getattr(self.roles[role], name)


def wait(ray, refs: list, role: str, where: str, what: str, timeout: float, setting: str) -> list:
    """The results of ``refs`` within ``timeout``. The first failure ends the wait at once; a dead worker
    or a timeout becomes one ``RoleFailure``, a role's own UserError stays one."""
    deadline = time.monotonic() + timeout
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise RoleFailure(
                    f"PPO role {role!r} ({where}) did not finish {what} within {timeout:g} s "
                    f"(resource_pool.{setting}); raise it if the call is just slow, else the worker is stuck"
                )
            ray.get(done[0])  # raises that worker's error now
        return ray.get(list(refs))
    except ray.exceptions.RayActorError as err:
        raise _died(role, where, what, err) from None
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, UserError):  # a bad config or bad data, reported by the role
            raise type(err.cause)(str(err.cause)) from None
        # A rank whose collective broke because a peer died can fail before Ray reports the death:
        # the death is the cause to report.
        death = _death_among(ray, pending, PEER_DEATH_GRACE)
        if death is not None:
            raise _died(role, where, what, death) from None
        raise


PEER_DEATH_GRACE = 10.0  # seconds a failed rank's group is watched for the death that may have caused it


def _died(role: str, where: str, what: str, err) -> RoleFailure:
    reason = str(err).strip().splitlines()[0]
    return RoleFailure(f"PPO role {role!r} ({where}) died during {what}: {reason}")


def _death_among(ray, refs: list, grace: float):
    """The ``RayActorError`` of the first of ``refs`` whose worker dies within ``grace`` seconds, else None."""
    deadline = time.monotonic() + grace
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return err
            except ray.exceptions.RayTaskError as other:  # that rank's own failure: keep looking
                logger.debug("another rank failed too: %s", str(other).strip().splitlines()[0])
    return None


# The forward calls: their first argument is the batch (``Samples``; ``generate``: the prompts' ids), and a
# group splits it over its ranks, with the per-sample tensors among their keyword arguments (first dimension:
# the samples; ``log_probs(ref_hidden=...)``: the reference's hidden states for the actor's exact KL).
SPLIT = ("generate", "log_probs", "values", "score")
PER_SAMPLE = ("ref_hidden",)


def _concat(parts: list):
    """The ranks' results, in rank order, as one: lists joined; tensors zero-padded along every dimension
    but the first to the largest (a slice's ``T`` is its own longest response) and concatenated; tuples
    and records (``RewardOutput``) field by field."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, list):
        return [x for p in parts for x in p]
    if isinstance(first, tuple):
        return tuple(_concat(list(xs)) for xs in zip(*parts))
    if dataclasses.is_dataclass(first):
        return type(first)(**{f.name: _concat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(first)})
    if isinstance(first, torch.Tensor):
        size = [max(p.shape[d] for p in parts) for d in range(first.dim())]
        pad = lambda p: [x for d in reversed(range(1, p.dim())) for x in (0, size[d] - p.shape[d])]
        return torch.cat([F.pad(p, pad(p)) if any(pad(p)) else p for p in parts])
    raise TypeError(f"cannot concatenate the ranks' {type(first).__name__} results")


class RemoteRole:
    """A role living in Ray workers (one, or the ranks of an FSDP2 group), each call waited for
    (``call_timeout``). A group splits the batch of a forward call (``SPLIT``): each rank gets its
    contiguous slice and the slices' results are concatenated in order. Every other call (``update``,
    weights, checkpoints) goes whole to every rank and the first rank's result is returned."""

    def __init__(self, ray, name: str, workers: list, pids: list[int], hosts: list[str], pool: ResourcePool) -> None:
        self._ray, self.name, self.workers, self.pids, self._pool = ray, name, workers, pids, pool
        ranks = f"{len(pids)} ranks, " if len(pids) > 1 else ""
        self.where = f"Ray actor {ranks}pid {', '.join(map(str, pids))} on {', '.join(sorted(set(hosts)))}"

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args, **kwargs):
            if method in SPLIT and len(self.workers) > 1 and args and len(args[0]):
                return self._split_call(method, args[0], args[1:], kwargs)
            refs = [w.call.remote(self.name, method, *args, **kwargs) for w in self.workers]
            return self._wait(refs, f"{method}()")[0]

        return call

    def _wait(self, refs: list, what: str) -> list:
        return wait(self._ray, refs, self.name, self.where, what, self._pool.call_timeout, "call_timeout")

    def _split_call(self, method: str, batch, rest: tuple, kwargs: dict):
        """Rank r runs ``method`` on its contiguous slice of ``batch``; the results, concatenated in rank
        order, are the whole batch's. A rank left without samples (fewer than ranks) runs on the first
        one, to keep up with the group's collectives, and its result is dropped. ``generate``: rank r
        samples from ``seed * world + r`` (distinct streams; sampled responses depend on the group size,
        greedy ones do not)."""
        world = len(self.workers)
        refs, kept = [], []
        for rank, worker in enumerate(self.workers):
            idx = share(len(batch), rank, world) or range(1)
            part = [batch[i] for i in idx] if isinstance(batch, list) else batch.select(list(idx))
            kw = dict(kwargs)
            for name in PER_SAMPLE:
                if kw.get(name) is not None:
                    kw[name] = kw[name][list(idx)]
            if method == "generate" and kw.get("seed") is not None:
                kw["seed"] = kw["seed"] * world + rank
            refs.append(worker.call.remote(self.name, method, part, *rest, **kw))
            kept.append(bool(share(len(batch), rank, world)))
        return _concat([r for r, k in zip(self._wait(refs, f"{method}()"), kept) if k])

    def per_rank(self, attribute: str) -> list:
        """An attribute of the role on every rank, e.g. ``samples_seen`` (what each rank computed)."""
        refs = [w.attribute.remote(self.name, attribute) for w in self.workers]
        return self._wait(refs, f"reading {attribute}")

    def sync_from(self, source: RemoteRole) -> None:
        """Weight sync: the source's full ``weights()`` (gathered by all its ranks, held by the first) go
        worker to worker through the object store, never through this process, into every rank's
        ``load_weights``, within ``weight_sync_timeout``."""
        weights = [w.call.remote(source.name, "weights") for w in source.workers]
        loads = [w.call.remote(self.name, "load_weights", weights[0]) for w in self.workers]
        what = f"the weight sync from {source.name!r} ({source.where})"
        timeout = self._pool.weight_sync_timeout
        wait(self._ray, loads + weights[1:], self.name, self.where, what, timeout, "weight_sync_timeout")


@dataclass
class WorkerGroup:
    """The roles that share processes (one role, or a ``colocate`` group) and their ranks' bundles."""

    names: list[str]
    bundles: list[dict[str, float]]  # one per rank


def worker_groups(pool: ResourcePool, names: list[str]) -> list[WorkerGroup]:
    """The ``colocate`` groups (roles of this run only), then each remaining role alone."""
    groups = [[n for n in group if n in names] for group in pool.colocate]
    groups = [g for g in groups if g]
    placed = {n for g in groups for n in g}
    groups += [[n] for n in names if n not in placed]
    out = []
    for g in groups:
        amount = pool.amount(g[0])
        share = min(amount, 1.0)  # a share of one device, or one whole device per rank
        bundle = {"CPU": share} if pool.device == "cpu" else {"GPU": share, "CPU": 1}
        out.append(WorkerGroup(g, [bundle] * max(1, math.ceil(amount))))
    return out


def _check_fits(ray, groups: list[WorkerGroup]) -> None:
    """Stop at once when the cluster is too small, rather than wait for resources that cannot come."""
    have = ray.cluster_resources()
    for kind in ("CPU", "GPU"):
        need = sum(b.get(kind, 0) for g in groups for b in g.bundles)
        if need > have.get(kind, 0) + 1e-9:
            per = ", ".join(f"{'+'.join(g.names)}: {sum(b.get(kind, 0) for b in g.bundles):g}" for g in groups)
            raise UserError(
                f"resource_pool asks for {need:g} {kind}(s) in all ({per}) but the Ray cluster has "
                f"{have.get(kind, 0):g}: give roles shares (< 1), colocate them, or add nodes (ray start --address)"
            )


@contextlib.contextmanager
def _sigterm_blocked_in_ray_processes() -> Iterator[None]:
    """SIGTERM blocked while ``ray.init`` starts the local cluster: its processes (GCS, raylet, and the workers
    the raylet starts) inherit the mask, as Ray itself starts them with SIGINT blocked. A SIGTERM sent to the
    whole process group or job (``timeout``, Slurm's scancel) then reaches the driver alone, which finishes the
    step in progress and saves it before ``ray.shutdown`` stops them (SIGKILL after one second each; they
    still die with the driver if it is killed). The driver's own mask is restored after."""
    import signal

    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    except (AttributeError, OSError, ValueError):  # no pthread_sigmask on this platform
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def ray_roles(c: PPOConfig, names: list[str], build: Callable) -> Iterator[dict[str, RemoteRole]]:
    """Start (or join) Ray, place the workers, build the roles in them with ``build(c, name, place, roles)`` (a
    module-level function, or a partial of one); yield the proxies by role name."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pool = c.resource_pool
    started = not ray.is_initialized()
    if started:
        try:
            with _sigterm_blocked_in_ray_processes():
                ray.init(address=pool.address, include_dashboard=False)
                # ray.init replaced the run's SIGTERM handler with its own (kill the workers, exit 1): put the
                # run's back (llm.utils.preemption), before a SIGTERM that came meanwhile is delivered.
                preemption.reassert()
        except ConnectionError as err:
            raise UserError(
                f"resource_pool.address={pool.address!r}: cannot reach a Ray cluster ({err}); start one with "
                "`ray start --head --port 6379`, or set address null to start a local one"
            ) from None
    preemption.reassert()
    groups = worker_groups(pool, names)
    bundles = [b for g in groups for b in g.bundles]
    workers: list = []
    pg = None
    try:
        _check_fits(ray, groups)
        pg = placement_group(bundles, strategy="PACK")
        what = f"placing {len(bundles)} worker(s) {bundles}"
        wait(ray, [pg.ready()], "+".join(names), "Ray", what, pool.call_timeout, "call_timeout")
        # Workers import this package by module path: the repository must sit at the same path on every node.
        env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        remote_class = ray.remote(RoleWorker)
        device = "cpu" if pool.device == "cpu" else "cuda"
        building = []
        for g in groups:
            ranks = []
            for b in g.bundles:
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=len(workers))
                options = {"num_cpus": b["CPU"], "num_gpus": b.get("GPU", 0), "scheduling_strategy": strategy}
                workers.append(remote_class.options(runtime_env={"env_vars": env}, **options).remote(c, build))
                ranks.append(workers[-1])
            master = None
            if len(ranks) > 1:
                ref = [ranks[0].rendezvous.remote()]
                master = wait(ray, ref, "+".join(g.names), "Ray", "rendezvous", pool.call_timeout, "call_timeout")[0]
            building.append([w.build.remote(g.names, device, r, len(ranks), master) for r, w in enumerate(ranks)])
        roles, start = {}, 0
        for g, refs in zip(groups, building):
            ranks = workers[start : start + len(refs)]
            start += len(refs)
            label = "+".join(g.names)
            built = wait(ray, refs, label, "Ray workers", "building", pool.call_timeout, "call_timeout")
            pids, hosts = [p for p, _ in built], [h for _, h in built]
            logger.info("roles %s: Ray actor(s) pid %s on %s, %s each", label, pids, sorted(set(hosts)), g.bundles[0])
            roles.update({n: RemoteRole(ray, n, ranks, pids, hosts, pool) for n in g.names})
        yield roles
    finally:
        for w in workers:
            ray.kill(w)
        if pg is not None:
            remove_placement_group(pg)
        if started:
            ray.shutdown()
