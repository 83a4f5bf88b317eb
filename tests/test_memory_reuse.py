"""``keep_freed_memory`` (llm/utils/memory.py): freed memory stays resident and is reused without page faults;
the environment's allocator settings and the memory-first mode (``release_between_layers``) win over it."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from llm.utils import memory

ROOT = __file__.rsplit("/tests/", 1)[0]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

PROBE = textwrap.dedent(
    """
    import json, resource, sys
    sys.path.insert(0, {root!r})
    import torch
    from llm.utils import memory

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    kept = memory.keep_freed_memory("probe") if {keep} else False
    if {release}:  # a later model that saves memory: glibc's thresholds back
        memory.release_between_layers(torch.nn.Linear(1, 1), "probe")
    base = rss_mb()
    acts = [torch.ones(1 << 18) for _ in range(200)]  # 200 x 1 MiB, like one step's activations
    held = rss_mb() - base
    del acts
    after_free = rss_mb() - base
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    acts = [torch.ones(1 << 18) for _ in range(200)]  # the next step
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    print(json.dumps({{"kept": kept, "held": held, "after_free": after_free, "faults": faults}}))
    """
)


def probe(keep: bool, release: bool = False, **env) -> dict:
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=ROOT, keep=keep, release=release)],
        capture_output=True,
        text=True,
        check=True,
        env=environ,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only (elsewhere keep_freed_memory is a no-op)")
def test_freed_memory_stays_resident_and_is_reused_without_faults():
    default, kept = probe(keep=False), probe(keep=True)
    assert kept["kept"] is True
    assert default["held"] > 150 and kept["held"] > 150  # 200 MiB were touched either way
    # glibc's default hands the freed 200 MiB back (trim / munmap) and faults it in again for the next step
    assert default["after_free"] < default["held"] - 100
    assert default["faults"] > 100 * 256  # > 100 MiB of 4 KiB pages
    # kept: resident after the free, and the next step's tensors land in it without a fault per page
    assert kept["after_free"] > kept["held"] - 10
    assert kept["faults"] < 20 * 256


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_the_environments_allocator_settings_win():
    env = probe(keep=True, MALLOC_TRIM_THRESHOLD_="131072")
    assert env["kept"] is False
    assert env["after_free"] < env["held"] - 100  # the user's trim threshold, not ours


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_a_later_memory_saving_model_puts_the_defaults_back():
    switched = probe(keep=True, release=True)
    assert switched["kept"] is True
    assert switched["after_free"] < switched["held"] - 100


def test_allocator_chosen_by_environment_names_the_variable():
    assert memory.allocator_chosen_by_environment({}) is None
    assert memory.allocator_chosen_by_environment({"MALLOC_MMAP_MAX_": "0"}) == "MALLOC_MMAP_MAX_"
    assert memory.allocator_chosen_by_environment({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == (
        "GLIBC_TUNABLES"
    )
    assert memory.allocator_chosen_by_environment({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"}) is None
    assert memory.allocator_chosen_by_environment({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "LD_PRELOAD"


def test_memory_first_wins_over_keeping(monkeypatch, caplog):
    """Once a model hands its heap back between layers, a later keep_freed_memory in the process does nothing."""
    monkeypatch.setattr(memory, "_policy", {"mode": "release"})
    caplog.set_level("INFO", logger="llm.utils.memory")
    assert memory.keep_freed_memory("critic") is False
    assert "memory first" in caplog.text
