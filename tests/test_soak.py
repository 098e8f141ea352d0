"""Soak of the ``mpi://`` comm: many messages, several connections, both directions at once.

``mpiexec -n 2 python -m mpi4dask.bench.soak_job`` (the job behind ``mpi4dask stress soak``) runs
3 connections between two ranks, each sending 300 messages of 0 B..4 MiB (1..8 numpy arrays each,
SHA-256 of every array, a sequence number) while receiving the peer's 300.  Every message must
arrive exactly once, in order, intact.  The checker itself is tested against a fake comm that
delivers damaged, duplicated, reordered and missing messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

import numpy as np
import pytest

from conftest import MPIEXEC, run_command

CONNECTIONS = 3
MESSAGES = 300
MAX_SIZE = 4 << 20
JOB_TIMEOUT = 90


@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_soak_mpi_both_directions_no_integrity_problems(tmp_path):
    from mpi4dask.bench.soak import SoakOptions

    result, config = tmp_path / "soak.json", tmp_path / "config.json"
    # the job's configuration as the driver hands it over: the options (their defaults, less these), as JSON
    options = SoakOptions(connections=CONNECTIONS, messages=MESSAGES, max_size=MAX_SIZE, read_timeout=30.0)
    config.write_text(json.dumps({**dataclasses.asdict(options), "protocols": ["mpi"]}))
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4dask.bench.soak_job", "--config", str(config),
           "--result", str(result)]
    rc, out, err = run_command(cmd, JOB_TIMEOUT, cwd=tmp_path)
    report = f"exit {rc}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
    assert result.exists(), report
    data = json.loads(result.read_text())
    (rec,) = data["records"]
    problems = {k: rec[k] for k in ("corrupted", "lost", "duplicated", "out_of_order")}
    assert problems == {"corrupted": 0, "lost": 0, "duplicated": 0, "out_of_order": 0}, (
        f"INTEGRITY FAILURE over mpi://: {problems}; first problems: {rec['details']}\n{report}"
    )
    assert rc == 0, report
    assert rec["protocol"] == "mpi" and rec["connections"] == CONNECTIONS
    total = 2 * CONNECTIONS * MESSAGES
    assert rec["messages"] == total and rec["received_ok"] == total, rec
    assert rec["all_ends_seen"] and rec["ok"] and data["ok"], rec
    # Both directions of every connection carried their messages.
    streams = {(s["conn"], s["direction"]): s for s in rec["streams"]}
    assert set(streams) == {(c, d) for c in range(CONNECTIONS) for d in (0, 1)}
    for s in streams.values():
        assert s["received"] == MESSAGES and s["end_seen"] and not s["details"], s
    # The sizes really spanned 0 B..4 MiB: some empty messages, some of several MiB.
    from mpi4dask.bench.soak_job import plan

    sizes = [sum(m[0]) for c in range(CONNECTIONS) for d in (0, 1)
             for m in plan(data["config"]["seed"], 0, c, d, MESSAGES, MAX_SIZE, 8)]
    assert min(sizes) == 0 and max(sizes) > MAX_SIZE // 4
    assert rec["bytes"] == sum(sizes)


# ------------------------------------------------------------------------------------------------
# The checker, against a fake comm
# ------------------------------------------------------------------------------------------------


class FakeComm:
    """Delivers a prepared list of messages, then blocks (like a silent peer)."""

    def __init__(self, msgs):
        self.msgs = list(msgs)

    async def read(self):
        if not self.msgs:
            await asyncio.sleep(3600)
        return self.msgs.pop(0)


def _messages(n=6, max_size=4096, conn=0, direction=1):
    from mpi4dask.bench.soak_job import digests, make_pool, plan

    msgs = plan(1, 0, conn, direction, n, max_size, 4)
    pool = make_pool(max_size, 1, 1)
    out = []
    for seq, (sizes, offsets) in enumerate(msgs):
        frames = [pool[o:o + s].copy() for o, s in zip(offsets, sizes)]
        out.append({"op": "msg", "run": 0, "conn": conn, "dir": direction, "seq": seq, "sizes": tuple(sizes),
                    "digests": tuple(digests(frames)), "frames": tuple(frames)})
    end = {"op": "end", "run": 0, "conn": conn, "dir": direction, "count": n}
    return msgs, out, end


def _check(delivered, msgs, timeout=5.0):
    from mpi4dask.bench.soak_job import receive_all

    return asyncio.run(receive_all(FakeComm(delivered), msgs, 0, 1, 0, timeout)).as_dict()


def _counts(c):
    return {k: c[k] for k in ("received", "corrupted", "lost", "duplicated", "out_of_order")}


def test_checker_accepts_a_faithful_stream():
    msgs, out, end = _messages()
    c = _check(out + [end], msgs)
    assert _counts(c) == {"received": 6, "corrupted": 0, "lost": 0, "duplicated": 0, "out_of_order": 0}
    assert c["end_seen"] and not c["details"]


def test_checker_counts_every_kind_of_problem():
    msgs, out, end = _messages(n=8)
    bad_frame = dict(out[1])
    frames = [f.copy() for f in bad_frame["frames"]]
    k = max(range(len(frames)), key=lambda i: frames[i].size)
    assert frames[k].size > 0
    frames[k][frames[k].size // 2] ^= 1  # one bit in the middle of the largest frame
    bad_frame["frames"] = tuple(frames)
    misrouted = dict(out[5], conn=3)
    delivered = [out[0], bad_frame, out[3], out[2], out[3], misrouted, out[6], end]  # 4 and 7 never come
    c = _check(delivered, msgs)
    assert c["corrupted"] == 2, c  # the flipped bit and the message of another connection
    assert c["duplicated"] == 1 and c["out_of_order"] == 1, c
    assert c["lost"] == 3, c  # 4, 7 and the misrouted 5
    assert any("SHA-256 mismatch" in d for d in c["details"]), c["details"]


def test_checker_catches_truncated_and_wrong_sized_frames():
    msgs, out, end = _messages(n=4)
    k = next(i for i, m in enumerate(out) if any(f.size for f in m["frames"]))
    short = dict(out[k], frames=tuple(f[:-1] if f.size else f for f in out[k]["frames"]))
    c = _check([m if i != k else short for i, m in enumerate(out)] + [end], msgs)
    assert c["corrupted"] == 1 and c["received"] == 3, c


def test_checker_reports_a_stalled_stream_as_lost():
    msgs, out, _ = _messages(n=5)
    c = _check(out[:2], msgs, timeout=0.2)
    assert c["lost"] == 3 and not c["end_seen"], c
    assert any("stalled" in d for d in c["details"]), c["details"]


def test_plan_is_seeded_and_log_uniform():
    from mpi4dask.bench.soak_job import plan

    a = plan(5, 0, 1, 0, 2000, 32 << 20, 8)
    assert a == plan(5, 0, 1, 0, 2000, 32 << 20, 8)
    assert a != plan(5, 0, 1, 1, 2000, 32 << 20, 8)
    totals = np.array([sum(s) for s, _ in a])
    assert totals.min() >= 0 and totals.max() <= 32 << 20
    assert {len(s) for s, _ in a} == set(range(1, 9))
    # log-uniform over 25 octaves: 12/25 of the messages below 4 KiB, 5/25 above 1 MiB
    assert 0.42 < np.mean(totals < 1 << 12) < 0.54 and 0.15 < np.mean(totals > 1 << 20) < 0.25
