"""MPI without ``mpiexec``: any Dask cluster whose scheduler listens on ``mpi://`` (mpi4dask.pm).

Every scenario runs the way a user runs it, in processes of its own: a fresh Python script (written
into ``tmp_path``) that creates the cluster, or ``dask scheduler`` / ``dask worker`` commands.  The
pytest process never touches MPI.  A script prints one ``RESULT <json>`` line; the assertions here
check it: payloads of random bytes are compared by sha256 and exact sum at both ends and against
the script's own copy, and ``mpi4dask.connections()`` on the workers shows which transport carried
them (``"mpi"`` over a ``"pair"`` of joined MPI worlds, the bytes counted on both ends).
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import BIN, Background, run_command, served_worlds, slow_served_transport

pytestmark = [served_worlds, slow_served_transport]

# What MPICH prints when it gives up on a process (MPI_Abort, a fatal error in an MPI call).
MPICH_FAILURES = ("Abort", "Fatal error")
SIGTERM_CODES = (0, -signal.SIGTERM, 128 + signal.SIGTERM)
SMALL = 16 << 10  # bytes on a connection's socket that a large transfer may add (headers, small messages)


def assert_no_mpich_failure(name: str, text: str) -> None:
    for word in MPICH_FAILURES:
        assert word not in text, f"{word!r} in the output of {name}:\n{text}"


def run_script(tmp_path: Path, name: str, text: str, timeout: float, args=()) -> tuple[dict, str]:
    """Run ``text`` as a fresh Python script; return its RESULT (parsed) and its stderr."""
    path = tmp_path / name
    path.write_text(text)
    rc, out, err = run_command([sys.executable, str(path), *map(str, args)], timeout, cwd=tmp_path)
    results = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(results) == 1, f"{name}: rc={rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert_no_mpich_failure(name, out + err)
    return json.loads(results[0]), err


# --------------------------------------------------------------------------------------------
# Code shared by the cluster scripts: payloads made on one worker, digested there and on another

COMMON = r'''
import hashlib, json, os, subprocess, sys, time
import numpy as np


def make(n, seed):
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def digest(a):
    return {"sha": sha(a), "sum": int(a.sum(dtype=np.uint64)), "nbytes": int(a.nbytes), "pid": os.getpid()}


def conns():
    import mpi4dask
    return mpi4dask.connections()


def snapshot(client, src, dst):
    """The connections dst opened to src (dst fetches from src), as seen from both ends."""
    seen = client.run(conns, workers=[src, dst])
    recv = [d for d in seen[dst] if d["peer"] == src]
    ends = {d["local"] for d in recv}
    return {"recv": recv, "send": [d for d in seen[src] if d["peer"] in ends]}


def move(client, src, dst, n, seed):
    """n random bytes made on src, digested on src and on dst (which must fetch them from src)."""
    before = snapshot(client, src, dst)
    a = client.submit(make, n, seed, workers=[src], allow_other_workers=False, pure=False)
    at_src = client.submit(digest, a, workers=[src], allow_other_workers=False, pure=False).result(timeout=120)
    at_dst = client.submit(digest, a, workers=[dst], allow_other_workers=False, pure=False).result(timeout=120)
    del a
    after = snapshot(client, src, dst)
    return {"src": src, "dst": dst, "n": n, "expected": digest(make(n, seed)), "at_src": at_src,
            "at_dst": at_dst, "before": before, "after": after}


def join_in_subprocess(address, secret, service, timeout=60):
    """A fresh process that sets these credentials and initialises MPI through them."""
    code = JOIN
    p = subprocess.run([sys.executable, "-c", code, address, secret.hex(), service], capture_output=True,
                       text=True, timeout=timeout)
    lines = [l[7:] for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    out = json.loads(lines[0]) if lines else {}
    out.update(rc=p.returncode, stderr=p.stderr[-4000:])
    return out
'''

# A process that has (maybe forged) credentials and initialises MPI through them, as a worker does.
JOIN = r'''
import json, sys, time
import mpi4dask
from mpi4dask import _mpi, pm

pm.set_credentials(pm.Credentials(sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]))
t = time.monotonic()
try:
    w = _mpi.world()
    out = {"ok": True, "served": w.served, "size": w.size}
except mpi4dask.MPIUnavailableError as exc:
    out = {"ok": False, "error": str(exc)}
except Exception as exc:
    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "wrong_type": True}
out["elapsed"] = time.monotonic() - t
print("RESULT " + json.dumps(out), flush=True)
'''


def script(body: str) -> str:
    return COMMON + f"\nJOIN = {JOIN!r}\n" + textwrap.dedent(body)


def _sum(conns: list[dict], key: str) -> int:
    return sum(d[key] for d in conns)


def assert_moved_over_mpi(m: dict) -> None:
    """The payload arrived intact, and its bytes travelled over MPI on a joined pair, not the socket."""
    n, where = m["n"], f"{m['n']} bytes {m['src']} -> {m['dst']}"
    expected = m["expected"]
    assert expected["nbytes"] == n
    for end in ("at_src", "at_dst"):
        assert m[end]["sha"] == expected["sha"], (where, end, m[end], expected)
        assert m[end]["sum"] == expected["sum"], (where, end, m[end], expected)
        assert m[end]["nbytes"] == n, (where, end, m[end])
    assert m["at_src"]["pid"] != m["at_dst"]["pid"], f"{where}: both digests ran in one process"
    before, after = m["before"], m["after"]
    recv, send = after["recv"], after["send"]
    assert recv, f"{where}: the receiver has no open connection to the sender: {after}"
    assert send, f"{where}: the sender shows no end of the receiver's connections: {after}"
    for d in recv + send:
        assert (d["transport"], d["mpi_route"]) == ("mpi", "pair"), f"{where}: {d}"
    got = _sum(recv, "mpi_bytes_received") - _sum(before["recv"], "mpi_bytes_received")
    sent = _sum(send, "mpi_bytes_sent") - _sum(before["send"], "mpi_bytes_sent")
    assert got >= n, f"{where}: only {got} MPI bytes received: {before} -> {after}"
    assert sent >= n, f"{where}: only {sent} MPI bytes sent: {before} -> {after}"
    sock_in = _sum(recv, "socket_bytes_received") - _sum(before["recv"], "socket_bytes_received")
    sock_out = _sum(send, "socket_bytes_sent") - _sum(before["send"], "socket_bytes_sent")
    assert sock_in < min(SMALL, n // 4), f"{where}: {sock_in} bytes came on the socket: {before} -> {after}"
    assert sock_out < min(SMALL, n // 4), f"{where}: {sock_out} bytes left on the socket: {before} -> {after}"


def assert_worker_links_are_pairs(conns_by_worker: dict) -> None:
    """Every open connection between two workers uses MPI through a joined pair."""
    workers = set(conns_by_worker)
    links = [(w, d) for w, ds in conns_by_worker.items() for d in ds if d["peer"] in workers]
    assert links, conns_by_worker
    for w, d in links:
        assert (d["transport"], d["mpi_route"]) == ("mpi", "pair"), (w, d)


# --------------------------------------------------------------------------------------------
# 1. LocalCluster with worker processes

LOCAL_CLUSTER = script(
    """
    SIZES = [100 << 10, 8 << 20, 64 << 20]

    if __name__ == "__main__":
        import dask.array as da
        from distributed import Client, LocalCluster

        with LocalCluster(protocol="mpi", processes=True, n_workers=3, threads_per_worker=1,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            client.wait_for_workers(3, timeout=60)
            A, B, C = sorted(client.scheduler_info()["workers"])
            moves = [move(client, A, dst, n, seed=100 + i) for i, n in enumerate(SIZES) for dst in (B, C)]
            x = da.random.default_rng(1234).random((4000, 4000), chunks=(1000, 1000))
            y = x + x.T
            a = x.compute()
            array = {"sum": float(y.sum().compute()), "np_sum": float((a + a.T).sum()),
                     "sha": sha(y.compute()), "np_sha": sha(a + a.T), "x_sha": sha(x.compute()), "a_sha": sha(a)}
            out = {"workers": [A, B, C], "moves": moves, "array": array, "conns": client.run(conns)}
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.timeout(150)
def test_local_cluster_moves_payloads_over_mpi(tmp_path):
    res, _ = run_script(tmp_path, "local_cluster.py", LOCAL_CLUSTER, 120)
    A, B, C = res["workers"]
    moves = res["moves"]
    assert [(m["src"], m["dst"], m["n"]) for m in moves] == [
        (A, dst, n) for n in (100 << 10, 8 << 20, 64 << 20) for dst in (B, C)
    ]
    for m in moves:
        assert_moved_over_mpi(m)
    # over the whole run: the receivers got at least every payload over MPI from A
    for dst in (B, C):
        recv = [d for d in res["conns"][dst] if d["peer"] == A]
        total = sum(m["n"] for m in moves if m["dst"] == dst)
        assert _sum(recv, "mpi_bytes_received") >= total, recv
        assert _sum(recv, "socket_bytes_received") < total // 100, recv
    assert_worker_links_are_pairs(res["conns"])
    arr = res["array"]
    assert arr["x_sha"] == arr["a_sha"], "x computed twice gave different data"
    assert arr["sha"] == arr["np_sha"], "x + x.T differs from numpy's on the same data"
    assert arr["sum"] == pytest.approx(arr["np_sum"], rel=1e-12)


# --------------------------------------------------------------------------------------------
# 2. dask scheduler / dask worker, started as separate commands

CLI_CLIENT = script(
    """
    if __name__ == "__main__":
        from distributed import Client

        with Client(scheduler_file=sys.argv[1], timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            W0, W1 = sorted(client.scheduler_info()["workers"])
            moves = [move(client, W0, W1, 32 << 20, seed=7), move(client, W1, W0, 32 << 20, seed=8)]
            out = {"workers": [W0, W1], "moves": moves, "conns": client.run(conns),
                   "scheduler": client.scheduler.address}
        print("RESULT " + json.dumps(out), flush=True)
    """
)


def without_batched_close_race(err: str) -> str:
    """``err`` less distributed's INFO "Batched Comm Closed" record and its traceback, which ends in
    ``CommClosedError``: a scheduler whose two workers close at once can race its batched write to
    one against the abort of that worker's stream, on tcp:// the same as on mpi://
    (test_comm_contract.py::test_a_batched_write_racing_an_abort_is_logged_as_tcp_logs_it)."""
    out, skipping = [], False
    for line in err.splitlines(keepends=True):
        if " - distributed.batched - INFO - Batched Comm Closed " in line:
            skipping = True
        elif skipping and line.startswith("distributed.comm.core.CommClosedError"):
            skipping = False
        elif not skipping:
            out.append(line)
    return "".join(out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nanny", [True, False], ids=["nanny", "no-nanny"])
def test_dask_scheduler_and_workers_commands(nanny, tmp_path):
    sf = tmp_path / "scheduler.json"
    dask = str(BIN / "dask")
    scheduler_cmd = [dask, "scheduler", "--protocol", "mpi", "--port", "0", "--scheduler-file", str(sf),
                     "--no-dashboard"]
    worker_cmd = [dask, "worker", "--scheduler-file", str(sf), "--nthreads", "1", "--no-dashboard"]
    if not nanny:
        worker_cmd.append("--no-nanny")
    with Background(scheduler_cmd, cwd=tmp_path) as scheduler:
        scheduler.wait_for_file(sf, 60)
        with Background(worker_cmd, cwd=tmp_path) as w0, Background(worker_cmd, cwd=tmp_path) as w1:
            res, _ = run_script(tmp_path, "client.py", CLI_CLIENT, 120, args=[sf])
            workers = (w0, w1)
            if nanny:  # the usual order: workers first, then the scheduler
                for w in workers:
                    w.proc.send_signal(signal.SIGTERM)
                codes = [w.wait(60) for w in workers]
                scheduler.proc.send_signal(signal.SIGTERM)
                scheduler_rc = scheduler.wait(60)
            else:  # the scheduler goes first: its workers (MPI up, service gone) end on their own
                scheduler.proc.send_signal(signal.SIGTERM)
                scheduler_rc = scheduler.wait(60)
                codes = [w.wait(60) for w in workers]
            outputs = {f"worker {i}": w.output() for i, w in enumerate(workers)}
        outputs["scheduler"] = scheduler.output()
    # a process that was sent SIGTERM may report it; one that ended on its own must end with 0
    allowed = [SIGTERM_CODES if nanny else (0,)] * 2 + [SIGTERM_CODES]
    for m in res["moves"]:
        assert_moved_over_mpi(m)
    assert res["scheduler"].startswith("mpi://")
    assert_worker_links_are_pairs(res["conns"])
    for (name, (out, err)), rc, ok in zip(outputs.items(), codes + [scheduler_rc], allowed):
        assert rc in ok, f"{name} ended with {rc}:\n{out}\n{err}"
        assert_no_mpich_failure(name, out + err)
        assert "Traceback" not in without_batched_close_race(err), f"{name}:\n{err}"


# A scheduler listening on all interfaces (the default of `dask scheduler`) must hand its workers a
# service address they can reach, every time.
WILDCARD = script(
    """
    import asyncio
    from distributed import Scheduler


    async def main():
        out = []
        for _ in range(8):
            try:
                async with Scheduler(protocol="mpi", port=0, dashboard_address=None) as s:
                    creds = s.extensions["mpi4dask"].credentials
                    host, _, port = creds.address.rpartition(":")
                    try:  # as a worker would, but on this loop: the service runs on it
                        connecting = asyncio.open_connection(host.strip("[]"), int(port))
                        reader, writer = await asyncio.wait_for(connecting, 10)
                        hello = (await asyncio.wait_for(reader.readline(), 10)).decode()
                        writer.close()
                        out.append({"address": s.address, "service": creds.service, "hello": hello})
                    except (OSError, asyncio.TimeoutError) as exc:
                        out.append({"address": s.address, "service": creds.service, "error": repr(exc)})
            except Exception as exc:
                out.append({"start_error": f"{type(exc).__name__}: {exc} / {exc.__cause__!r}"})
        return out

    if __name__ == "__main__":
        print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
    """
)


@pytest.mark.timeout(120)
def test_service_reachable_when_scheduler_listens_on_all_interfaces(tmp_path):
    res, _ = run_script(tmp_path, "wildcard.py", WILDCARD, 90)
    assert len(res) == 8
    for r in res:
        assert "start_error" not in r and "error" not in r, res
        assert r["hello"].startswith("cmd=mpi4dask-challenge ") and f"service={r['service']} " in r["hello"], r


# --------------------------------------------------------------------------------------------
# 3. Scaling up: workers that join later share MPI with the earlier ones

SCALE_UP = script(
    """
    if __name__ == "__main__":
        from distributed import Client, LocalCluster

        with LocalCluster(protocol="mpi", processes=True, n_workers=2, threads_per_worker=1,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            old = sorted(client.scheduler_info()["workers"])
            moves = [move(client, old[0], old[1], 8 << 20, seed=1)]
            cluster.scale(4)
            client.wait_for_workers(4, timeout=90)
            new = sorted(set(client.scheduler_info()["workers"]) - set(old))
            moves += [move(client, old[0], new[0], 16 << 20, seed=2),  # the new worker connects to an old one
                      move(client, new[0], new[1], 16 << 20, seed=3),  # two new ones
                      move(client, new[1], old[1], 16 << 20, seed=4)]  # an old worker connects to a new one
            out = {"old": old, "new": new, "moves": moves, "conns": client.run(conns)}
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.timeout(150)
def test_scale_up_new_workers_join_mpi(tmp_path):
    res, _ = run_script(tmp_path, "scale_up.py", SCALE_UP, 120)
    old, new = res["old"], res["new"]
    assert len(old) == 2 and len(new) == 2 and not set(old) & set(new)
    assert [(m["src"], m["dst"]) for m in res["moves"]] == [
        (old[0], old[1]), (old[0], new[0]), (new[0], new[1]), (new[1], old[1])
    ]
    for m in res["moves"]:
        assert_moved_over_mpi(m)
    assert set(res["conns"]) == set(old) | set(new)
    assert_worker_links_are_pairs(res["conns"])


# --------------------------------------------------------------------------------------------
# 4. Strangers are refused, silent peers dropped

STRANGER = script(
    """
    import hmac, hashlib, socket
    import mpi4dask._pmi


    def scheduler_attr(client, name):
        return client.run_on_scheduler(lambda dask_scheduler: getattr(dask_scheduler.extensions["mpi4dask"], name))


    def raw(address, send=None, authenticate_with=None, read_timeout=15):
        # one raw TCP connection to the service: read the challenge, answer it (or not), read to the end
        host, _, port = address.rpartition(":")
        t = time.monotonic()
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as sock:
            sock.settimeout(read_timeout)
            local = "%s:%d" % sock.getsockname()[:2]
            f = sock.makefile("rb")
            hello = f.readline().decode()
            nonce = mpi4dask._pmi.parse(hello).get("nonce", "")
            if authenticate_with is not None:
                send = "cmd=mpi4dask-auth mac=%s\\n" % hmac.new(authenticate_with, nonce.encode(),
                                                               hashlib.sha256).hexdigest()
            if send is not None:
                sock.sendall(send.encode())
            rest, closed = b"", False
            try:
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        closed = True
                        break
                    rest += chunk
            except socket.timeout:
                pass
            except ConnectionResetError:
                closed = True
        return {"local": local, "hello": hello, "rest": rest.decode(errors="replace"), "closed": closed,
                "elapsed": time.monotonic() - t}


    if __name__ == "__main__":
        from distributed import Client, LocalCluster

        out = {}
        with LocalCluster(protocol="mpi", processes=True, n_workers=1, threads_per_worker=1,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            client.wait_for_workers(1, timeout=60)
            creds = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"].credentials)
            address = client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"].credentials.address)
            out["address"], out["service"] = address, creds.service
            # (a) wrong answers to the challenge
            refused0 = scheduler_attr(client, "refused")
            out["wrong"] = [
                raw(address, send="cmd=mpi4dask-auth mac=%s\\n" % ("00" * 32)),
                raw(address, authenticate_with=os.urandom(32)),
                raw(address, send="cmd=init pmi_version=1 pmi_subversion=1\\n"),
            ]
            out["refused"] = [refused0, scheduler_attr(client, "refused")]
            # the cluster still works, and a worker that joins after the strangers gets MPI
            cluster.scale(2)
            client.wait_for_workers(2, timeout=90)
            W0, W1 = sorted(client.scheduler_info()["workers"])
            out["moves"] = [move(client, W0, W1, 1 << 20, seed=11), move(client, W1, W0, 1 << 20, seed=12)]
            # (c) silent peers are dropped after STEP_TIMEOUT (the service reads it at each step)
            mpi4dask._pmi.STEP_TIMEOUT = 1.0
            out["silent"] = [raw(address), raw(address, authenticate_with=creds.secret)]
            mpi4dask._pmi.STEP_TIMEOUT = 30.0
            # (b) processes with forged credentials, or another cluster's, initialise MPI through them
            with LocalCluster(protocol="mpi", processes=True, n_workers=0, dashboard_address=None) as other, \\
                    Client(other) as other_client:
                theirs = other_client.run_on_scheduler(
                    lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"].credentials)
            refused1 = scheduler_attr(client, "refused")
            out["forged"] = join_in_subprocess(address, os.urandom(32), creds.service)
            out["other_clusters_secret"] = join_in_subprocess(address, theirs.secret, creds.service)
            out["other_clusters_service"] = join_in_subprocess(address, creds.secret, theirs.service)
            out["refused_b"] = [refused1, scheduler_attr(client, "refused")]
            out["genuine"] = join_in_subprocess(address, creds.secret, creds.service)
            out["secrets"] = [creds.secret.hex(), theirs.secret.hex()]
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.timeout(180)
def test_strangers_are_refused(tmp_path):
    res, err = run_script(tmp_path, "stranger.py", STRANGER, 150)
    service = res["service"]
    # (a) a wrong mac, a mac made with another key, no auth at all: closed without a welcome, counted, logged
    for r in res["wrong"]:
        assert r["hello"].startswith("cmd=mpi4dask-challenge ") and f"service={service} " in r["hello"], r
        assert r["closed"], r
        assert "welcome" not in r["rest"] and r["rest"] == "", r
        assert f"refused a connection from {r['local']}" in err, (r, err)
    before, after = res["refused"]
    assert after - before == 3, res["refused"]
    # the service still serves the cluster: a worker added later moved payloads over MPI
    for m in res["moves"]:
        assert_moved_over_mpi(m)
    # (b) credentials that are not this cluster's fail with a clear error, and leak no secret
    for case, why in [("forged", "refused this process's secret"),
                      ("other_clusters_secret", "refused this process's secret"),
                      ("other_clusters_service", "not this cluster's MPI service")]:
        r = res[case]
        assert r.get("rc") == 0 and r.get("ok") is False and not r.get("wrong_type"), (case, r)
        assert why in r["error"] and res["address"] in r["error"], (case, r)
        for secret in res["secrets"]:
            assert secret not in r["error"] + r["stderr"], case
        assert_no_mpich_failure(case, r["stderr"])
    b0, b1 = res["refused_b"]
    # the two wrong secrets, and the process that found another service there and left without answering
    assert b1 - b0 == 3, res["refused_b"]
    genuine = res["genuine"]
    assert genuine.get("rc") == 0 and genuine.get("ok") is True, genuine
    assert genuine["served"].startswith(f"mpi4dask-{service}-") and genuine["size"] == 1, genuine
    # (c) a peer that says nothing, before or after authenticating, is dropped after STEP_TIMEOUT (1 s)
    for r in res["silent"]:
        assert r["closed"], r
        assert 0.8 <= r["elapsed"] <= 6, r
    assert "cmd=mpi4dask-welcome" in res["silent"][1]["rest"], res["silent"][1]
    assert err.count("silent for 1 s") >= 2, err


# --------------------------------------------------------------------------------------------
# 5. A service out of reach: a clear error, quickly


@pytest.mark.timeout(60)
def test_unreachable_service_gives_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the port is closed now: nothing listens there
    res, err = run_script(tmp_path, "join.py", JOIN, 30, args=[f"127.0.0.1:{port}", "ab" * 32, "0123456789abcdef"])
    assert res["ok"] is False and not res.get("wrong_type"), res
    assert "unreachable" in res["error"] and f"127.0.0.1:{port}" in res["error"], res
    assert res["elapsed"] < 5, res
    assert "ab" * 32 not in res["error"] + err


# --------------------------------------------------------------------------------------------
# 7. Workers restarted by their Nanny (client.restart) join MPI again, as new processes

RESTART = script(
    """
    if __name__ == "__main__":
        from distributed import Client, LocalCluster

        with LocalCluster(protocol="mpi", processes=True, n_workers=2, threads_per_worker=1,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            A, B = sorted(client.scheduler_info()["workers"])
            first = move(client, A, B, 8 << 20, seed=7)
            pids = client.run(os.getpid)
            client.restart()
            client.wait_for_workers(2, timeout=60)
            A2, B2 = sorted(client.scheduler_info()["workers"])
            again = move(client, B2, A2, 24 << 20, seed=8)
            out = {"first": first, "again": again, "pids": list(pids.values()),
                   "new_pids": list(client.run(os.getpid).values())}
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.timeout(150)
def test_workers_restarted_by_their_nanny_join_mpi_again(tmp_path):
    got, _ = run_script(tmp_path, "restart.py", RESTART, timeout=120)
    assert not set(got["pids"]) & set(got["new_pids"]), got["pids"]  # really new processes
    assert_moved_over_mpi(got["first"])
    assert_moved_over_mpi(got["again"])


# --------------------------------------------------------------------------------------------
# 8. A stranger that claims to be of the cluster in the mpi:// handshake gets no MPI port

PAIR_STRANGER = script(
    """
    import os, socket, struct

    def send_hs(sock, msg):
        data = json.dumps(msg).encode()
        sock.sendall(struct.pack("<I", len(data)) + data)

    def recv_hs(sock):
        def exact(n):
            buf = b""
            while len(buf) < n:
                chunk = sock.recv(n - len(buf))
                if not chunk:
                    raise ConnectionError("closed")
                buf += chunk
            return buf
        (n,) = struct.unpack("<I", exact(4))
        return json.loads(exact(n))

    if __name__ == "__main__":
        from distributed import Client, LocalCluster
        from mpi4dask.comm import PROTOCOL_VERSION

        with LocalCluster(protocol="mpi", processes=True, n_workers=2, threads_per_worker=1,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            A, B = sorted(client.scheduler_info()["workers"])
            service = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"]
                                              .credentials.service)
            host, port = A[len("mpi://"):].rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=20)
            send_hs(sock, {"magic": "mpi4dask", "version": PROTOCOL_VERSION, "rank": 0, "size": 1, "job": "",
                           "host": "stranger", "pid": 1, "nonce": os.urandom(16).hex(), "up": True,
                           "cluster": service, "ident": "stranger-1"})
            server = recv_hs(sock)
            send_hs(sock, {"magic": "mpi4dask", "proof": "pair", "tag": 12345, "use": None, "mac": "00" * 32})
            try:
                after = recv_hs(sock)
            except (ConnectionError, OSError) as exc:
                after = {"closed": type(exc).__name__}
            sock.close()
            # the worker still serves its own cluster over MPI
            moved = move(client, A, B, 8 << 20, seed=9)
            out = {"server_hello": {k: server.get(k) for k in ("pair", "cluster", "links")}, "after": after,
                   "moved": moved}
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.timeout(120)
def test_stranger_with_the_cluster_id_but_not_its_secret_gets_no_mpi_port(tmp_path):
    got, err = run_script(tmp_path, "pair_stranger.py", PAIR_STRANGER, timeout=90)
    assert got["server_hello"]["pair"] is True  # the id is public: the worker asks for the proof
    assert got["after"] == {"closed": "ConnectionError"}, got["after"]  # no port, no verdict: closed
    assert "refused the connection" in err and "did not prove that it knows the cluster's secret" in err, err
    assert_moved_over_mpi(got["moved"])
