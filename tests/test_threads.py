"""The CPU thread default (llm/utils/threads.py): the cores the load leaves free, at least one; the user's
OMP_NUM_THREADS wins."""

from __future__ import annotations

import os

import torch

from llm.utils import threads


def test_default_threads_by_hand():
    assert threads.default_threads(2, 0.2) == 2  # idle: every core (torch's own default)
    assert threads.default_threads(2, 0.9) == 1  # one core busy: one thread
    assert threads.default_threads(2, 3.2) == 1  # overloaded: never below one
    assert threads.default_threads(16, 12.4) == 4  # what the load leaves
    assert threads.default_threads(1, 0.0) == 1


def test_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    assert threads.choose_threads() is None and torch.get_num_threads() == before


def test_unset_picks_the_default(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (12.4, 0.0, 0.0))
    before = torch.get_num_threads()
    try:
        assert threads.choose_threads() == 4 and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
