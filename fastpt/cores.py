"""The CPU cores this process may use: the count that data preparation's workers
(fastpt.prepare) and a run's torch threads (distributed.cpu_threads) start from."""

from __future__ import annotations

import os


def all_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS keeps one (a container's or
    taskset's limit), else every core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
