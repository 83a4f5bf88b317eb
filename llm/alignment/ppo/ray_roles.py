"""PPO roles in Ray actors: the role classes of roles.py, each built inside Ray actor processes and
reached through a proxy with the same methods (``resource_pool.use_ray``).

    driver: PPOTrainer --RemoteRole("actor_rollout")--ray.get(timeout)--> [rank 0][rank 1]  ActorRole, FSDP2 over 2
                       --RemoteRole("ref")------------------------------> [ ]               PolicyModel
                       --RemoteRole("critic")---------------------------> [ ]               CriticRole + ORMReward
                       --RemoteRole("reward")---------------------------/                   (colocated)
                       --RemoteRole("rollout")--------------------------> [ ]               PolicyModel (rollout copy)

(``actor_rollout: 2``, ``colocate: [["critic", "reward"]]``, ``rollout: 0.5``; the others a share).
One worker process per rank: a role (or colocated group) given a share of one device (< 1) or one
device is one worker; given N devices, N workers that join one torch.distributed group (gloo on CPU,
NCCL on GPU) and shard the role's models with FSDP2. Every rank runs each call on the same batch
(sharded parameters, replicated data: memory scales, throughput does not), and the first rank's
result is the answer. Placement: one placement group, one bundle per worker (``{"CPU": share}``,
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
import logging
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from llm.alignment.ppo.config import PPOConfig, ResourcePool
from llm.alignment.ppo.roles import RoleFailure
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
    """The body of one Ray actor: builds its roles in its own process and runs their methods."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
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

        from llm.alignment.ppo.build import Place, build_role
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
            self.roles[name] = build_role(self.config, name, Place(device, layout))
        return os.getpid(), socket.gethostname()

    def call(self, role: str, method: str, *args, **kwargs):
        return getattr(self.roles[role], method)(*args, **kwargs)


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
        reason = str(err).strip().splitlines()[0]
        raise RoleFailure(f"PPO role {role!r} ({where}) died during {what}: {reason}") from None
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, UserError):  # a bad config or bad data, reported by the role
            raise type(err.cause)(str(err.cause)) from None
        raise


class RemoteRole:
    """A role living in Ray workers (one, or the ranks of an FSDP2 group): each method call goes to every
    rank and is waited for (``call_timeout``); the first rank's result is returned."""

    def __init__(self, ray, name: str, workers: list, pids: list[int], hosts: list[str], pool: ResourcePool) -> None:
        self._ray, self.name, self.workers, self.pids, self._pool = ray, name, workers, pids, pool
        ranks = f"{len(pids)} ranks, " if len(pids) > 1 else ""
        self.where = f"Ray actor {ranks}pid {', '.join(map(str, pids))} on {', '.join(sorted(set(hosts)))}"

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args, **kwargs):
            refs = [w.call.remote(self.name, method, *args, **kwargs) for w in self.workers]
            pool = self._pool
            return wait(self._ray, refs, self.name, self.where, f"{method}()", pool.call_timeout, "call_timeout")[0]

        return call

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
def ray_roles(c: PPOConfig, names: list[str]) -> Iterator[dict[str, RemoteRole]]:
    """Start (or join) Ray, place the workers, build the roles in them; yield the proxies by role name."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pool = c.resource_pool
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=pool.address, include_dashboard=False)
        except ConnectionError as err:
            raise UserError(
                f"resource_pool.address={pool.address!r}: cannot reach a Ray cluster ({err}); start one with "
                "`ray start --head --port 6379`, or set address null to start a local one"
            ) from None
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
                workers.append(remote_class.options(runtime_env={"env_vars": env}, **options).remote(c))
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
