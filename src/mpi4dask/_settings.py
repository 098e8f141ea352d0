"""The numeric ``MPI4DASK_*`` environment settings, read and checked in one place (docs/configuration.md).

A bad value is an error that names the variable, the value and what it takes, raised where the setting is
first read (at import for the transport's, when the scheduler starts its MPI service for the port).
"""

from __future__ import annotations

import os


def number(name: str, default: float, *, low: float, high: float, what: str, integer: bool = False) -> float:
    """``name`` from the environment as a number from ``low`` to ``high``; ``default`` when unset or blank.

    ``what`` completes "give ...": what the setting means and its range, for the error a bad value gets.
    """
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"{name}={raw!r}: give {what}")
    return value
