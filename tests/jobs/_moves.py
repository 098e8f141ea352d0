"""Payloads made on one worker and digested there and on another, and the connections that carried them.

Imported by the job scripts of tests/test_any_cluster.py and by jobqueue_cluster.py (tests/test_slurm.py).
Their workers, and the scheduler that unpickles the task graph, may run in processes that cannot import
this module (``dask scheduler`` and ``dask worker`` commands, Slurm batch jobs, started in other
directories).  distributed sends a graph by value (cloudpickle) only where it names ``__main__``, so the
functions that run there (``make``, ``sha``, ``digest``, ``conns``) become the importing script's own, as
when this code was part of each script.
"""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# A process that sets (maybe forged) credentials and initialises MPI through them, as a worker does
JOIN = str(Path(__file__).with_name("join_with_credentials.py"))


def make(n, seed):
    """n random bytes (the generator's raw 64-bit words: 5x faster than ``Generator.bytes``)."""
    return np.random.default_rng(seed).bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()  # the array's own buffer, not a copy


def digest(a):
    return {"sha": sha(a), "sum": int(a.sum(dtype=np.uint64)), "nbytes": int(a.nbytes), "pid": os.getpid()}


def conns():
    import mpi4dask

    return mpi4dask.connections()


def _run_from_main(*functions):
    import __main__

    for f in functions:
        f.__module__ = "__main__"
        setattr(__main__, f.__name__, f)  # where pickle looks a __main__ function up


_run_from_main(make, sha, digest, conns)


def link_ends(client, src, dst):
    """The connections dst opened to src (dst fetches from src), as ``(dst's ends, src's ends)``."""
    seen = client.run(conns, workers=[src, dst])
    recv = [d for d in seen[dst] if d["peer"] == src]
    ends = {d["local"] for d in recv}
    return recv, [d for d in seen[src] if d["peer"] in ends]


def snapshot(client, src, dst):
    """The connections dst opened to src (dst fetches from src), as seen from both ends."""
    recv, send = link_ends(client, src, dst)
    return {"recv": recv, "send": send}


def made_and_fetched(client, src, dst, n, seed, digest=digest, timeout=120, while_fetching=contextlib.nullcontext):
    """n random bytes made on src and digested on src and on dst (which must fetch them from src):
    ``(at_src, at_dst)``; the bytes are released on return.  ``while_fetching()``: a context manager that
    holds while dst fetches and digests them (e.g. busy processes on the cores)."""
    a = client.submit(make, n, seed, workers=[src], allow_other_workers=False, pure=False)
    at_src = client.submit(digest, a, workers=[src], allow_other_workers=False, pure=False).result(timeout=timeout)
    with while_fetching():
        at_dst = client.submit(digest, a, workers=[dst], allow_other_workers=False, pure=False).result(timeout=timeout)
    return at_src, at_dst


def move(client, src, dst, n, seed, while_fetching=contextlib.nullcontext):
    """n random bytes made on src, digested on src and on dst (which must fetch them from src)."""
    before = snapshot(client, src, dst)
    at_src, at_dst = made_and_fetched(client, src, dst, n, seed, while_fetching=while_fetching)
    after = snapshot(client, src, dst)
    return {"src": src, "dst": dst, "n": n, "expected": digest(make(n, seed)), "at_src": at_src,
            "at_dst": at_dst, "before": before, "after": after}


def join_in_subprocess(address, secret, service, timeout=60):
    """A fresh process that sets these credentials and initialises MPI through them."""
    p = subprocess.run([sys.executable, JOIN, address, secret.hex(), service], capture_output=True,
                       text=True, timeout=timeout)
    lines = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(lines[0]) if lines else {}
    out.update(rc=p.returncode, stderr=p.stderr[-4000:])
    return out
