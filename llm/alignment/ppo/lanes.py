"""Independent role calls, at the same time where the roles live in different processes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def together(calls, concurrent: bool) -> list:
    """The results of independent role calls, each ``(role, zero-argument callable)``, in order. ``concurrent``
    (Ray roles with ``resource_pool.concurrent_roles``): the calls to roles in different processes run at the
    same time, each waiting on its own actors; calls to colocated roles (one process) run one after another in
    call order, as they would there anyway, so a failure is reported by the call that met it. Otherwise: one
    after another. The first failure is raised once every call has ended (each is bounded by ``call_timeout``)."""
    if not concurrent or len(calls) < 2:
        return [fn() for _, fn in calls]
    lanes: dict = {}  # process group -> indices of its calls
    for i, (role, _) in enumerate(calls):
        lanes.setdefault(tuple(getattr(role, "pids", ())) or id(role), []).append(i)
    results: list = [None] * len(calls)

    def run(indices):
        for i in indices:
            results[i] = calls[i][1]()

    with ThreadPoolExecutor(len(lanes), thread_name_prefix="ppo-role") as executor:
        futures = [executor.submit(run, indices) for indices in lanes.values()]
        for f in futures:
            f.result()
    return results
