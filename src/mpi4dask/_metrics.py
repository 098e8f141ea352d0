"""What mpi4dask did in this process, for Prometheus and the dashboard's MPI page (private).

Counters are plain ints in module-level dicts, incremented where the events happen (a fallback to the
socket, a join, a send window that fills, a ``run_mpi`` rank task): no lock, no Prometheus object on any
path.  Bytes and messages cost nothing more on the hot path than they did: every connection already
counts them in its ``stats`` dict (:func:`mpi4dask.connections`); those of open connections are summed
when someone reads them, and a connection's counts are added to the process's totals when it is
collected (:func:`track`), so bytes of closed connections are not lost.

:func:`activate` registers :class:`_Collector` once per process on ``prometheus_client``'s global
registry, which is what ``distributed``'s ``/metrics`` endpoints (scheduler and workers) serve; it is
called where mpi4dask's transport or MPI service starts.  Without ``prometheus_client`` nothing is
registered and the counters still count (the dashboard page reads them).

Metric names and labels are documented in ``docs/observability.md``.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
import weakref

logger = logging.getLogger(__name__)

EVENTS_KEPT = 200  # recent joins and fallbacks kept for the dashboard
JOBS_KEPT = 100  # recent run_mpi rank tasks kept for the dashboard
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 1800.0)
PAIR_JOIN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

STAT_KEYS = ("messages_sent", "messages_received", "mpi_bytes_sent", "mpi_bytes_received",
             "socket_bytes_sent", "socket_bytes_received")

# -- the counters (plain ints)
counts = {"window_stalls": 0, "busy_socket_messages": 0, "run_mpi_calls": 0, "run_mpi_retries": 0}
opened: collections.Counter = collections.Counter()  # (transport, route) -> connections made
fallbacks: collections.Counter = collections.Counter()  # reason -> connections that fell back to the socket
joins: collections.Counter = collections.Counter()  # kind ("service" | "pair") -> joins that succeeded
join_failures: collections.Counter = collections.Counter()  # (kind, reason) -> joins that failed
rank_tasks: collections.Counter = collections.Counter()  # outcome ("ok" | "failed") -> run_mpi rank tasks
durations = [0] * (len(DURATION_BUCKETS) + 1)  # run_mpi rank tasks by duration bucket (+Inf last)
duration_sum = [0.0]
pair_join_seconds = [0] * (len(PAIR_JOIN_BUCKETS) + 1)  # pair joins (both outcomes) by time in MPI (+Inf last)
pair_join_sum = [0.0]
# closed (collected) connections: (transport, route) -> stats summed; and those this process opened,
# by the address it connected to: (peer, transport, route) -> stats summed (a bounded set: listeners)
retired: dict = collections.defaultdict(lambda: dict.fromkeys(STAT_KEYS, 0))
retired_by_peer: dict = collections.defaultdict(lambda: dict.fromkeys(STAT_KEYS, 0))

events: collections.deque = collections.deque(maxlen=EVENTS_KEPT)  # recent joins and fallbacks
jobs: collections.deque = collections.deque(maxlen=JOBS_KEPT)  # recent run_mpi rank tasks

# -- connections


def _add(total: dict, stats: dict) -> None:
    for k in STAT_KEYS:
        total[k] += stats[k]


def _retire(stats: dict, transport: str, route: str, peer: str | None) -> None:
    _add(retired[(transport, route)], stats)
    if peer is not None:
        _add(retired_by_peer[(peer, transport, route)], stats)


def track(comm, transport: str, route: str, initiated: bool) -> None:
    """Count a new connection; its stats join the process's totals when it is collected."""
    opened[(transport, route)] += 1
    fin = weakref.finalize(comm, _retire, comm.stats, transport, route, comm.peer_address if initiated else None)
    fin.atexit = False  # nothing to count at exit
    comm._metrics_key = (transport, route, initiated)


def _open_comms():
    from .comm import _open_comms as comms

    return list(comms)  # strong references while they are read: none is retired meanwhile


def _totals(retired_totals: dict, key_of) -> dict:
    """Key -> {stat: total, "open": count}: ``retired_totals`` plus each live connection that ``key_of``
    gives a key (None: left out)."""
    out = collections.defaultdict(lambda: dict.fromkeys((*STAT_KEYS, "open"), 0))
    comms = _open_comms()  # first: a connection collected after this is held here, one collected before is retired
    for key, st in list(retired_totals.items()):
        _add(out[key], st)
    for c in comms:
        key = key_of(c, getattr(c, "_metrics_key", None))
        if key is None:
            continue
        _add(out[key], c.stats)
        if not c.closed():
            out[key]["open"] += 1
    return out


def connection_totals() -> dict:
    """(transport, route) -> {stat: total} over every connection this process ever made; and open counts."""
    return _totals(retired, lambda c, key: None if key is None else key[:2])


def by_peer() -> list[dict]:
    """What moved on the connections this process opened, by the address it connected to (the peer's
    listener), closed connections included."""
    out = _totals(retired_by_peer,
                  lambda c, key: None if key is None or not key[2] else (c.peer_address, *key[:2]))
    return [{"peer": p, "transport": t, "route": r, **st} for (p, t, r), st in sorted(out.items())]


# -- events


def fallback(reason: str, peer: str) -> None:
    fallbacks[reason] += 1
    events.append({"time": time.time(), "event": "fallback", "reason": reason, "peer": peer})


def _pair_join_took(seconds: float | None) -> dict:
    """Observe a pair join's time inside MPI_Comm_accept/connect; the event's field for it."""
    if seconds is None:
        return {}
    pair_join_seconds[bisect.bisect_left(PAIR_JOIN_BUCKETS, seconds)] += 1
    pair_join_sum[0] += seconds
    return {"seconds": seconds}


def joined(kind: str, peer: str, seconds: float | None = None) -> None:
    """A join succeeded; ``seconds``: a pair join's time inside MPI_Comm_accept/connect."""
    joins[kind] += 1
    events.append({"time": time.time(), "event": "join", "kind": kind, "peer": peer, **_pair_join_took(seconds)})


def join_failed(kind: str, reason: str, peer: str, seconds: float | None = None) -> None:
    """A join failed; ``seconds`` as for :func:`joined` (None when the MPI call did not start)."""
    join_failures[(kind, reason)] += 1
    events.append({"time": time.time(), "event": "join_failed", "kind": kind, "reason": reason, "peer": peer,
                   **_pair_join_took(seconds)})


def window_stall() -> None:
    counts["window_stalls"] += 1


def busy_socket_message() -> None:
    counts["busy_socket_messages"] += 1


def rank_task_done(record: dict) -> None:
    """A run_mpi rank task ended here (``record``: job, rank, size, workers, mode, retry, start, seconds,
    outcome, error)."""
    seconds = record["seconds"]
    rank_tasks[record["outcome"]] += 1
    if record["rank"] == 0:
        counts["run_mpi_calls"] += 1
        if record.get("retry"):
            counts["run_mpi_retries"] += 1
    durations[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1  # the first bucket whose bound it does not pass
    duration_sum[0] += seconds
    jobs.append(record)


def report() -> dict:
    """This process's view, for the dashboard (JSON-ready)."""
    import os

    return {"pid": os.getpid(), "peers": by_peer(), "events": list(events), "jobs": list(jobs),
            "fallbacks": dict(fallbacks), "joins": dict(joins),
            "join_failures": [{"kind": k, "reason": r, "count": n} for (k, r), n in join_failures.items()]}


# -- Prometheus


class _Collector:
    """Reads the counters when ``/metrics`` is scraped (a ``prometheus_client`` custom collector)."""

    def describe(self):
        return []  # no checks of names at registration: collect() is only called on a scrape

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        labels = ["transport", "route"]
        sent_b = CounterMetricFamily("mpi4dask_sent_bytes", "Bytes this process sent on mpi:// connections, by the "
                                     "channel they travelled (transport: mpi or socket) and the connection's MPI "
                                     "route (world, pair, or none for a socket-only connection).", labels=labels)
        recv_b = CounterMetricFamily("mpi4dask_received_bytes", "Bytes this process received on mpi:// connections "
                                     "(labels as mpi4dask_sent_bytes).", labels=labels)
        sent_m = CounterMetricFamily("mpi4dask_sent_messages", "Messages this process sent, by the connection's "
                                     "transport (mpi: large frames over MPI; socket: all on the socket) and route.",
                                     labels=labels)
        recv_m = CounterMetricFamily("mpi4dask_received_messages", "Messages this process received (labels as "
                                     "mpi4dask_sent_messages).", labels=labels)
        conns = CounterMetricFamily("mpi4dask_connections", "mpi:// connections this process made or accepted, by "
                                    "transport and route.", labels=labels)
        open_ = GaugeMetricFamily("mpi4dask_open_connections", "Open mpi:// connections of this process, by "
                                  "transport and route.", labels=labels)
        totals = connection_totals()
        for key in sorted(set(opened) | set(totals)):
            transport, route = key
            st = totals.get(key) or dict.fromkeys((*STAT_KEYS, "open"), 0)
            if transport == "mpi":
                sent_b.add_metric(["mpi", route], st["mpi_bytes_sent"])
                recv_b.add_metric(["mpi", route], st["mpi_bytes_received"])
            sent_b.add_metric(["socket", route], st["socket_bytes_sent"])
            recv_b.add_metric(["socket", route], st["socket_bytes_received"])
            sent_m.add_metric([transport, route], st["messages_sent"])
            recv_m.add_metric([transport, route], st["messages_received"])
            conns.add_metric([transport, route], opened[key])
            open_.add_metric([transport, route], st["open"])
        yield from (sent_b, recv_b, sent_m, recv_m, conns, open_)

        fb = CounterMetricFamily("mpi4dask_socket_fallbacks", "Connections whose handshake settled on the socket "
                                 "instead of MPI, by reason.", labels=["reason"])
        for reason, n in sorted(fallbacks.items()):
            fb.add_metric([reason], n)
        yield fb
        j = CounterMetricFamily("mpi4dask_joins", "Joins into MPI: kind=service (a process joined MPI through "
                                "this scheduler's MPI service) or kind=pair (two worlds joined by "
                                "connect/accept for mpi:// connections).", labels=["kind"])
        for kind in ("service", "pair"):
            j.add_metric([kind], joins[kind])
        yield j
        jf = CounterMetricFamily("mpi4dask_join_failures", "Joins into MPI that failed, by kind and reason.",
                                 labels=["kind", "reason"])
        for (kind, reason), n in sorted(join_failures.items()):
            jf.add_metric([kind, reason], n)
        yield jf
        yield CounterMetricFamily("mpi4dask_send_window_stalls", "Times a sender's messages waited because the peer "
                                  "had a full send window of unread MPI bytes.", value=counts["window_stalls"])
        yield CounterMetricFamily("mpi4dask_busy_socket_messages", "Messages with frames for MPI that went on the "
                                  "socket because every core was taken and this MPI's copy needs both ends' calls "
                                  "(MPICH 4, Intel MPI).", value=counts["busy_socket_messages"])
        yield CounterMetricFamily("mpi4dask_run_mpi_calls", "run_mpi calls whose rank 0 ran in this process.",
                                  value=counts["run_mpi_calls"])
        yield CounterMetricFamily("mpi4dask_run_mpi_retries", "run_mpi calls run again after a participant died "
                                  "(counted where their rank 0 ran).", value=counts["run_mpi_retries"])
        rt = CounterMetricFamily("mpi4dask_run_mpi_rank_tasks", "run_mpi rank tasks that ended in this process, by "
                                 "outcome (ok, failed).", labels=["outcome"])
        for outcome in ("ok", "failed"):
            rt.add_metric([outcome], rank_tasks[outcome])
        yield rt
        h = HistogramMetricFamily("mpi4dask_run_mpi_duration_seconds", "Seconds run_mpi rank tasks of this process "
                                  "took, from the go-ahead to the end (forming the communicator and the function).")
        h.add_metric([], _cumulative(DURATION_BUCKETS, durations), sum_value=duration_sum[0])
        yield h
        h = HistogramMetricFamily("mpi4dask_pair_join_seconds", "Seconds this process's pair joins (kind=pair, "
                                  "succeeded or failed) spent inside MPI_Comm_accept/connect.")
        h.add_metric([], _cumulative(PAIR_JOIN_BUCKETS, pair_join_seconds), sum_value=pair_join_sum[0])
        yield h


def _cumulative(bounds, counts_by_bucket) -> list:
    """Prometheus histogram buckets: (upper bound, observations at or below it), +Inf last."""
    buckets, acc = [], 0
    for bound, n in zip((*map(str, bounds), "+Inf"), counts_by_bucket):
        acc += n
        buckets.append((bound, acc))
    return buckets


_registered = False


def activate() -> None:
    """Put mpi4dask's metrics on this process's ``/metrics`` endpoints (once; nothing without
    ``prometheus_client``)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        import prometheus_client
    except ImportError:
        return
    try:
        prometheus_client.REGISTRY.register(_Collector())
    except ValueError as exc:  # a name taken by another collector: say so, keep working
        logger.warning("mpi4dask: its Prometheus metrics are not registered: %s", exc)
