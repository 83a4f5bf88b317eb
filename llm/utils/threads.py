"""How many CPU threads torch uses when the user did not say (``OMP_NUM_THREADS`` unset).

PyTorch's own default is one thread per core. On a machine whose cores other work also uses, its threads wait
for each other at every parallel region: on 2 shared cores the tiny PRM demo took 26 minutes with the default
and 1:51 with one thread; measured here (bench/README "CPU threads"), 2 threads on 2 busy cores ran the demo's
steps 2.4x slower than 1 thread, while on 2 idle cores they ran SmolLM2-135M's 1.7x faster. So the default is
the cores the machine leaves free at start-up (its one-minute load average), at least one:

    threads = max(1, cores - round(load average))

Load that arrives after the start is not seen: on a shared machine set ``OMP_NUM_THREADS=1``.

``OMP_NUM_THREADS`` overrides it (scripts/test.sh sets 1; torchrun sets 1 per process itself). The choice is
one log line.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def default_threads(cores: int, load: float) -> int:
    """The thread count for ``cores`` cores at load average ``load`` (module docstring)."""
    return max(1, cores - round(load))


def choose_threads() -> int | None:
    """Set torch's thread count when ``OMP_NUM_THREADS`` is unset; returns the count set (None: left alone)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = default_threads(cores, load)
    torch.set_num_threads(threads)
    logger.info(
        "torch uses %d CPU thread(s): %d cores, load average %.1f (OMP_NUM_THREADS=N sets it yourself)",
        threads,
        cores,
        load,
    )
    return threads
