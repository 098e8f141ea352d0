"""Hand Dask data to MPI code: :func:`run_mpi` and :func:`map_blocks_mpi`.

The pattern, done once and right: find which worker holds which chunk, give every participating
worker exactly one task, carve an MPI communicator of just those workers out of the job's world,
and call the MPI function on a worker thread with the chunks that worker already holds.

How a call goes (client side):

1. Collections passed together are checked to have the same block indexes (before anything is
   computed), then persisted if they are not, and their chunks computed; a chunk that failed
   raises here.
2. Each block index is assigned to a worker: the one that already holds most of the blocks with that
   index (over all collections), so only the chunks needed to co-locate them move.  Participants
   are the assigned workers plus ``workers=``; their comm ranks follow their MPI world ranks.
3. The workers' MPI is checked (and started where it is not up, through the cluster's MPI service,
   :mod:`mpi4dask.pm`): ranks of one launched job get a communicator carved out of their world;
   workers that are worlds of their own (any cluster Dask started: LocalCluster, ``dask worker``,
   jobqueue...) get their worlds joined (:func:`_join_worlds`), once per set of participants.
4. One lock per participant (``distributed.Lock``) is taken in address order: overlapping calls
   queue and never deadlock; disjoint ones run at once.
5. One task per participant is pinned to it.  The tasks wait at a start barrier until every one of
   them runs (a dead or departed participant is noticed here, never left as a task waiting forever),
   then all call ``MPI_Comm_create_group`` (collective over the participants only) and ``fn``.  The
   communicator is set up so that no call on it waits for other ranks with the GIL held (which would
   stop the worker's event loop): see :func:`_comm_class`.
6. The first exception on any rank is raised at once, with its rank and remote traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import numbers
import operator
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import _metrics, _mpi, _sources
from ._jobs import bounded

logger = logging.getLogger(__name__)

POLL_MIN = 0.002  # the client's checks of a starting or running job: first after this many seconds,
POLL_MAX = 0.2  # ... then backing off to this
START_ABANDON = 600.0  # a rank task that gets no word from its client for this long gives up
GONE_CHECK = 0.5  # seconds between the client's checks that every participant of a running job is alive
LOST_BLOCKS_WAIT = 60.0  # seconds to wait for blocks lost with a dead worker to be computed again
UNRUNNABLE_CHECK = 5.0  # seconds between two looks for blocks that no worker may run (twice: an error)
RECOVERY_WAIT = 10.0  # seconds a retry waits for the Nannies to bring the cluster back to its size
LEAVE_WAIT = 5.0  # seconds for the scheduler to drop a worker whose connection broke while a call was set up
END_ASK = 2.0  # seconds the blocked ranks' workers get to end themselves before their Nannies restart them
RELEASE_WAIT = 10.0  # seconds to wait for the scheduler to drop the workers whose blocked ranks were ended

__all__ = ["MPIJobError", "run_mpi", "map_blocks_mpi"]


class MPIJobError(RuntimeError):
    """An MPI job of :func:`run_mpi` (or :func:`map_blocks_mpi`) failed on one of its ranks.

    The original exception, where there is one, is the ``__cause__``.

    Parameters
    ----------
    message : str
        What failed, where, and (for a failure of ``fn``) the remote traceback.
    rank, worker, remote_traceback, lost
        Stored as the attributes below.

    Attributes
    ----------
    rank : int or None
        The rank, in the participants' communicator, that failed; None when no rank is known.
    worker : str or None
        The address of that participant's worker.
    remote_traceback : str
        The traceback text of the exception on that rank ("" when there was none).
    lost : bool
        True when the participant died or left the cluster (or lost the blocks it held): the kind
        of failure that ``run_mpi(..., retries=k)`` runs the call again after.
    """

    def __init__(self, message: str, *, rank: int | None = None, worker: str | None = None,
                 remote_traceback: str = "", lost: bool = False):
        super().__init__(message)
        self.rank = rank
        self.worker = worker
        self.remote_traceback = remote_traceback
        self.lost = lost  # a participant died or left (run_mpi's ``retries`` run the call again)


# --------------------------------------------------------------------------------------------
# Worker side: the rank task and the per-process job table


class _JobState:
    __slots__ = ("go", "abort", "rank", "phase", "since", "fn")

    def __init__(self):
        self.go = threading.Event()
        self.abort: str | None = None
        self.rank: int | None = None
        self.phase = "announced"  # -> waiting (task started) -> running (in fn) -> done
        self.since = time.time()
        self.fn = ""


_jobs: dict[str, _JobState] = {}
_jobs_lock = threading.Lock()


def _job(job: str) -> _JobState:
    with _jobs_lock:
        st = _jobs.get(job)
        if st is None:
            now = time.time()
            for k in [k for k, s in _jobs.items() if s.phase in ("announced", "done") and now - s.since > 3600]:
                del _jobs[k]  # word about jobs whose task never came or ended long ago
            st = _jobs[job] = _JobState()
        return st


async def _worker_mpi_info() -> dict:
    """Runs on a worker (``client.run``, on its event loop): where it sits in MPI, starting MPI (through
    the cluster's MPI service, :mod:`mpi4dask.pm`) where it is not up yet and that is safe."""
    import os

    w = _mpi.initialized_world()
    if w is None:
        if not _mpi.initialized_by_others() and _mpi.launched_with_peers():
            return {"pid": os.getpid(), "error": "MPI is not initialized in this worker, and it was started by an "
                    "MPI launcher with peers (MPI_Init is collective there)"}
        try:
            w = await asyncio.wrap_future(_mpi.start())
        except Exception as e:  # MPIUnavailableError, ...
            return {"pid": os.getpid(), "error": str(e)}
    return {"pid": os.getpid(), "host": w.host, "rank": w.rank, "size": w.size, "job": w.job_key,
            "dynamic": w.dynamic, "alone": w.alone, "ident": w.ident,
            "formed": sorted(_formed), "unsafe": _mpi.joins_unsafe()}


def _job_status(job: str) -> dict:
    with _jobs_lock:
        st = _jobs.get(job)
        return {"phase": st.phase if st else "unknown", "rank": st.rank if st else None}


def _job_go(job: str) -> None:
    _job(job).go.set()


def _job_abort(job: str, why: str) -> None:
    st = _job(job)
    st.abort = why
    st.go.set()


def _jobs_running() -> list[dict]:
    with _jobs_lock:
        return [
            {"job": k, "rank": s.rank, "phase": s.phase, "fn": s.fn, "seconds": round(time.time() - s.since, 1)}
            for k, s in _jobs.items() if s.phase in ("waiting", "running")
        ]


def _check_blocks(result, expected: dict, rank: int, fname: str) -> tuple:
    """map_blocks_mpi: ``fn`` must return {index: block} for exactly the blocks it was given."""
    if not isinstance(result, dict):
        raise TypeError(f"map_blocks_mpi: {fname} returned {type(result).__name__} on rank {rank}; it must return "
                        f"a dict {{block index: new block}} for the blocks in its parts: {sorted(expected)}")
    missing = [i for i in expected if i not in result]
    extra = [i for i in result if i not in expected]
    if missing or extra:
        raise KeyError(f"map_blocks_mpi: {fname} on rank {rank} must return exactly the block indexes it was given; "
                       f"missing {missing}, unexpected {extra}")
    for i, shape in expected.items():
        if shape is not None:  # arrays keep their chunk structure
            got = getattr(result[i], "shape", None)
            if got != shape:
                raise ValueError(f"map_blocks_mpi: {fname} returned block {i} with shape {got} on rank {rank}; the "
                                 f"chunk structure is kept, so it must have shape {shape}")
    first = next(iter(result.values()), None)
    meta = None  # an empty sample of the new blocks, for the output collection's metadata
    if hasattr(first, "iloc"):
        meta = first.iloc[:0]
    elif hasattr(first, "dtype") and hasattr(first, "ndim"):
        meta = first[(slice(0, 0),) * first.ndim] if first.ndim else first.reshape(1)[:0]
    return result, meta


def _check_sendable(result, rank: int, fname: str) -> None:
    """run_mpi: ``fn``'s result goes back to the client, so Dask must be able to serialise it.  Checked on
    the rank, where the error can say which rank and what (otherwise the worker logs a traceback per try
    and the client gets distributed's bare ``Could not serialize object of type ...``).  The check is
    distributed's own serialisation of a task's result (``serialize(Serialize(x))``, as ``get_data``
    sends it: containers item by item, Dask's serialisers before pickle), so it accepts exactly what
    the worker can send; its frames are dropped (arrays' out of band, not copied; a pickled result,
    e.g. a DataFrame's object columns, is serialised twice)."""
    from distributed.protocol.serialize import Serialize, serialize

    pickle_log = logging.getLogger("distributed.protocol.pickle")  # logs each failure with a traceback
    quiet = _OtherThreadsOnly()  # ... which the error below says better; other threads log as ever
    pickle_log.addFilter(quiet)
    try:
        serialize(Serialize(result), on_error="raise")
    except Exception as exc:
        cause = exc.__cause__
        why = f"{exc.args[0] if exc.args else exc}" + (f": {cause}" if cause is not None else "")
        raise TypeError(
            f"run_mpi: {fname} returned a {type(result).__module__}.{type(result).__qualname__} on rank {rank}, which "
            f"Dask cannot send back to the client ({why}); return plain data (numbers, strings, NumPy arrays, "
            f"pandas objects, or lists/dicts/tuples of them), e.g. the values you need from that object, and keep "
            f"objects such as locks, files and MPI handles inside fn") from exc
    finally:
        pickle_log.removeFilter(quiet)


class _OtherThreadsOnly(logging.Filter):
    """Drops the records of the thread that made it."""

    def __init__(self):
        super().__init__()
        self._thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self._thread


@functools.cache
def _comm_class() -> type:
    """The class of the communicator ``fn`` gets; built on first use, as importing mpi4py.MPI starts MPI."""
    MPI = _mpi.world().MPI

    class Intracomm(MPI.Intracomm):
        """An mpi4py intracommunicator on which no call holds the GIL while it waits for other ranks.

        mpi4py releases the GIL around every MPI call that can wait for another rank (blocking
        point-to-point and collective calls, lowercase and uppercase, ``Wait``/``Test``, ``Probe``,
        ``Mprobe``), except in two places.  Those hold it, and so stop every other thread of the
        process -- the worker's event loop included: no heartbeats, no transfers, no ``client.run``
        -- until the slowest rank arrives:

        * The first lowercase ``reduce``, ``allreduce``, ``scan`` or ``exscan`` on a communicator
          (and the gather, scatter, allgather and alltoall of ``mpi4py.util.pkl5``) makes a private
          duplicate of it for their messages, with ``MPI_Comm_dup``: a collective, called with the
          GIL held.  When one rank computes 2 s longer than the others before its first
          ``comm.allreduce``, the event loops of all the others stop for those 2 s.
        * ``Reduce_scatter``, ``Ireduce_scatter`` and ``Reduce_scatter_init`` without
          ``recvcounts`` gather the counts with ``MPI_Allgather``, with the GIL held.

        This class makes that duplicate as soon as the communicator exists, while its ranks are in
        step (they all just left the collective that created it), and lets the count gathering
        first wait in ``Barrier``, which releases the GIL: what is left of either call takes no
        longer than the ranks take to get their GIL back.  Communicators made from this one with
        ``Dup``, ``Clone``, ``Dup_with_info``, ``Create``, ``Create_group``, ``Split`` and
        ``Split_type`` are of this class too.  Not covered: communicators from ``Idup``, the
        topology constructors (``Create_cart``, ...) and intercommunicators; make their first
        lowercase reduction right after creating them.
        """

        @classmethod
        def adopt(cls, comm):
            """``comm`` (an intracommunicator just created, on all its ranks) as this class, ready."""
            if comm == MPI.COMM_NULL:
                return comm
            comm = comm if isinstance(comm, cls) else cls(comm)
            comm.reduce(0, root=0)  # mpi4py makes the duplicate now, while every rank is here
            return comm

        def Clone(self):
            return self.adopt(super().Clone())

        def Dup(self, info=None):
            return self.adopt(super().Dup(info))

        def Dup_with_info(self, info):
            return self.adopt(super().Dup_with_info(info))

        def Create(self, group):
            return self.adopt(super().Create(group))

        def Create_group(self, group, tag=0):
            return self.adopt(super().Create_group(group, tag))

        def Split(self, color=0, key=0):
            return self.adopt(super().Split(color, key))

        def Split_type(self, split_type, key=0, info=MPI.INFO_NULL):
            return self.adopt(super().Split_type(split_type, key, info))

        def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
            if recvcounts is None:
                self.Barrier()
            return super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)

        def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
            if recvcounts is None:
                self.Barrier()
            return super().Ireduce_scatter(sendbuf, recvbuf, recvcounts, op)

        def Reduce_scatter_init(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM, info=MPI.INFO_NULL):
            if recvcounts is None:
                self.Barrier()
            return super().Reduce_scatter_init(sendbuf, recvbuf, recvcounts, op, info)

    Intracomm.__qualname__ = "Intracomm"
    return Intracomm


FORM_TIMEOUT = 10.0  # seconds each step of forming a communicator may wait in MPICH (holding its lock)

# communicators of joined worlds formed by earlier calls, by the identities of their members in rank
# order: reused while the set of participants is unchanged (a worker that left or restarted has
# another identity, so a set with it is another key)
_formed: dict[str, Any] = {}


def _kv(op: str, **kw):
    """The scheduler's rendezvous values (:class:`mpi4dask.pm.PMService`), from a worker thread."""
    from distributed import get_worker
    from distributed.utils import sync

    worker = get_worker()
    return sync(worker.loop, getattr(worker.scheduler, f"mpi4dask_kv_{op}"), **kw)


def _join_worlds(idents: list, me: int, fid: str):
    """An intracommunicator of worlds that were not launched together, ranks in ``idents`` order.

    Recursive doubling: in round ``step`` (1, 2, 4, ...) the group of ranks ``[g, g+step)`` with
    ``g // step`` even accepts the group that follows it (its first rank opens an MPI port and puts
    its name on the scheduler; the other group's first rank reads it), and both merge, the lower
    group first: ``ceil(log2 n)`` rounds of ``MPI_Comm_accept``/``connect`` + ``Intercomm_merge``.
    """
    MPI = _mpi.world().MPI
    info = MPI.Info.Create()
    info.Set("timeout", str(int(FORM_TIMEOUT)))
    n = len(idents)
    comm = MPI.COMM_SELF.Dup()
    step = 1
    try:
        while step < n:
            start = (me // step) * step
            lower = (start // step) % 2 == 0
            partner = start + step if lower else start - step
            if partner >= n:  # no group to join this round
                step *= 2
                continue
            key = f"{fid}/{step}/{min(start, partner)}"
            opened = ""  # the port this group's first rank opened (the lower group accepts on it)
            if lower:
                port = opened = MPI.Open_port() if comm.Get_rank() == 0 else ""
                if port:
                    _kv("put", key=key, value=port)
            else:
                port = ""
                if comm.Get_rank() == 0:
                    port = _kv("get", key=key, timeout=FORM_TIMEOUT)
                    if port is None:
                        raise TimeoutError(f"run_mpi: rank {me} waited {FORM_TIMEOUT:.0f} s for rank {partner} to "
                                           f"open its MPI port (round of {step}); is that worker alive?")
            try:
                with _mpi.joining(f"run_mpi forming (round of {step})", FORM_TIMEOUT):
                    inter = (comm.Accept if lower else comm.Connect)(port, info, 0)
                    merged = inter.Merge(high=not lower)
            finally:
                if opened:
                    MPI.Close_port(opened)
            inter.Free()
            comm.Free()
            comm = merged
            step *= 2
    except BaseException:
        comm.Free()
        raise
    finally:
        info.Free()
    if comm.Get_rank() != me or comm.Get_size() != n:
        raise RuntimeError(f"run_mpi: forming the communicator gave rank {comm.Get_rank()} of {comm.Get_size()}, "
                           f"expected {me} of {n}")
    if me == 0:
        _kv("drop", prefix=fid + "/")
    return comm


def _participants_comm(plan: dict, rank: int):
    """The communicator of the participants (collective over them only), as :func:`_comm_class`."""
    if plan["mode"] == "world":
        world = _mpi.world().comm
        group = world.Get_group()
        sub = group.Incl(plan["world_ranks"])
        group.Free()
        try:
            comm = world.Create_group(sub, plan["ctag"])
        finally:
            sub.Free()
        return _comm_class().adopt(comm)
    key = "\n".join(plan["idents"])
    base = _formed.get(key) if plan["reuse"] else None
    if base is None:
        base = _formed[key] = _join_worlds(plan["idents"], rank, plan["fid"])
    return _comm_class().adopt(base.Dup())  # each call its own communicator; the formed one stays


def _rank_task(job: str, rank: int, plan: dict, fn: Callable, kwargs: dict,
               indexes: list, blocks: list, expected_shapes):
    st = _job(job)
    st.rank = rank
    st.fn = getattr(fn, "__name__", repr(fn))
    st.phase = "waiting"
    st.since = time.time()
    _metrics.activate()
    began = None  # the go-ahead's time
    error = ""
    try:
        deadline = time.monotonic() + START_ABANDON
        while not st.go.wait(0.05):
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_mpi job {job}: rank {rank} got no go-ahead from its client in "
                                   f"{START_ABANDON:.0f} s; giving up without entering MPI")
        if st.abort:
            raise RuntimeError(f"run_mpi job {job} was called off before it started: {st.abort}")
        began = time.monotonic()
        st.phase = "forming"
        comm = _participants_comm(plan, rank)
        st.phase = "running"
        try:
            parts = [dict(zip(idx, blk)) for idx, blk in zip(indexes, blocks)]
            with _mpi.user_code():
                result = fn(comm, *parts, **kwargs)
        finally:
            comm.Free()
        if expected_shapes is not None:
            return _check_blocks(result, dict(zip(indexes[0], expected_shapes)), rank, st.fn)
        _check_sendable(result, rank, st.fn)
        return result
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        st.phase = "done"
        st.since = time.time()
        if began is not None:  # it went ahead: a communicator was formed (or failed to be)
            seconds = time.monotonic() - began
            _metrics.rank_task_done({
                "job": job, "fn": st.fn, "rank": rank, "size": len(plan.get("workers", ())),
                "workers": list(plan.get("workers", ())), "mode": plan["mode"], "retry": bool(plan.get("retry")),
                "start": st.since - seconds, "seconds": seconds, "outcome": "failed" if error else "ok",
                "error": error})


def _pick(result, index):
    return result[0][index]


# --------------------------------------------------------------------------------------------
# Client side: the collections


@dataclass
class _Input:
    kind: str  # "array" | "dataframe" | "bag" | "futures"
    collection: Any
    indexes: list  # block index per block, in block order
    futures: list  # one Future per block, same order
    shapes: list = field(default_factory=list)  # arrays: the shape of each block


def _kind(c) -> str:
    from distributed import Future

    if isinstance(c, (list, tuple)):
        if not all(isinstance(f, Future) for f in c):
            bad = next(f for f in c if not isinstance(f, Future))
            raise TypeError(f"run_mpi: a list must hold distributed Futures only; it holds a {type(bad).__name__}. "
                            f"Pass Dask collections directly, or client.scatter(...) plain objects first")
        return "futures"
    mod = type(c).__module__
    if mod.startswith("dask.array"):
        return "array"
    if mod.startswith("dask.dataframe"):
        return "dataframe"
    if mod.startswith("dask.bag"):
        return "bag"
    raise TypeError(f"run_mpi takes dask arrays, dask dataframes/series, dask bags and lists of Futures; "
                    f"got {type(c).__module__}.{type(c).__name__}")


def _describe(c, kind: str) -> str:
    if kind == "array":
        return f"a dask array of shape {c.shape} with numblocks {c.numblocks}"
    if kind == "futures":
        return f"a list of {len(c)} Futures"
    return f"a dask {kind} with {c.npartitions} partitions"


def _check_aligned(collections: tuple, kinds: list[str]) -> None:
    """Collections passed together must have the same block indexes (see :func:`run_mpi`)."""
    first, k0 = collections[0], kinds[0]
    for n, (c, k) in enumerate(zip(collections[1:], kinds[1:]), 1):
        what = f"collection 0 is {_describe(first, k0)}, collection {n} {_describe(c, k)}"
        if (k0 == "array") != (k == "array"):
            raise ValueError(
                f"run_mpi: {what}: an array's block indexes are tuples (i, j, ...), the others' partition numbers, "
                f"so no block would meet its partner. Pass collections of one family, e.g. "
                f"df.to_dask_array(lengths=True) beside y[:, None]")
        if k != "array":
            if _count(c, k) != _count(first, k0):
                raise ValueError(
                    f"run_mpi: {what}: fn gets the blocks with one index together, so dataframes, bags and lists "
                    f"of Futures passed together need as many partitions (items) as each other. Repartition one "
                    f"(df.repartition(npartitions=...)); data that every rank needs goes in a keyword argument")
            continue
        if c.numblocks != first.numblocks:
            raise ValueError(
                f"run_mpi: {what}: fn gets the blocks with one index together, so arrays passed together need the "
                f"same numblocks. Rechunk one like the other, or add axes (y[:, None] beside an X of numblocks "
                f"(n, 1))")
        for axis, (a, b) in enumerate(zip(first.chunks, c.chunks)):
            if a != b and sum(a) == sum(b):  # unknown (nan) chunk sizes never compare equal
                raise ValueError(
                    f"run_mpi: {what}: along axis {axis} (length {sum(a)} in both) collection 0 has chunks {a}, "
                    f"collection {n} {b}, so blocks with one index would hold different ranges. Rechunk one like "
                    f"the other, e.g. y.rechunk({{{axis}: x.chunks[{axis}]}})")


def _count(c, kind: str) -> int:
    return len(c) if kind == "futures" else c.npartitions


def _prepare(client, c, kind: str, position: int) -> _Input:
    from distributed import futures_of

    if kind == "futures":
        if not c:
            raise ValueError(f"run_mpi: collection {position} is an empty list of Futures")
        return _Input(kind, list(c), list(range(len(c))), list(c))

    def block_keys(c):
        if kind == "array":
            import numpy as np

            idxs = [tuple(int(i) for i in idx) for idx in np.ndindex(*c.numblocks)]
            return idxs, [(c.name, *idx) for idx in idxs]
        ks = list(c.__dask_keys__())
        return list(range(len(ks))), ks

    def block_futures(c, keys) -> list | None:
        """The Future behind each block key (through aliases, as dask-expr persists), or None."""
        by_key = {f.key: f for f in futures_of(c)}
        if not by_key:
            return None
        graph = c.__dask_graph__()
        out = []
        for k in keys:
            for _ in range(16):
                if k in by_key:
                    out.append(by_key[k])
                    break
                target = getattr(graph.get(k), "target", None)  # dask._task_spec.Alias
                if target is None:
                    return None  # a real task: this collection is not persisted (only things it uses are)
                k = target
            else:
                return None
        return out

    indexes, keys = block_keys(c)
    futures = block_futures(c, keys)
    if futures is None:
        c = client.persist(c)
        indexes, keys = block_keys(c)
        futures = block_futures(c, keys)
        if futures is None:
            raise RuntimeError(f"run_mpi: collection {position} has blocks without a Future even after persist(); "
                               f"pass client.persist(collection) with this client")
    shapes = [tuple(c.chunks[d][i] for d, i in enumerate(idx)) for idx in indexes] if kind == "array" else []
    return _Input(kind, c, indexes, futures, shapes)


def _unrunnable(dask_scheduler, keys) -> dict:
    """(On the scheduler) the keys among these that no worker of the cluster may run, with the workers
    they are restricted to: the scheduler's state ``no-worker`` while workers are running."""
    if not dask_scheduler.running:
        return {}
    out = {}
    for k in keys:
        ts = dask_scheduler.tasks.get(k)
        if ts is not None and ts.state == "no-worker":
            out[k] = sorted(ts.worker_restrictions or ()) + sorted(ts.host_restrictions or ())
    return out


def _wait_computed(client, futures) -> None:
    """Wait for these futures, however long they compute; but a block that no worker may run (restricted
    with ``workers=`` to workers that have left, which distributed keeps waiting for even with
    ``allow_other_workers=True`` once they are all gone) fails at once instead of waiting for ever."""
    from distributed import wait

    stuck_before: set = set()
    while True:
        try:
            wait(futures, timeout=UNRUNNABLE_CHECK)
            return
        except (TimeoutError, asyncio.TimeoutError):  # the same class from Python 3.11 on, not in 3.10
            pass
        pending = [f.key for f in futures if f.status in ("pending", "lost")]
        stuck = client.run_on_scheduler(_unrunnable, keys=pending) if pending else {}
        both = {k: v for k, v in stuck.items() if k in stuck_before}  # seen twice, UNRUNNABLE_CHECK s apart
        if both:
            key, where = next(iter(both.items()))
            raise MPIJobError(
                f"run_mpi: {len(both)} block(s) can run on no worker of the cluster, e.g. {key!r}, restricted to "
                f"{', '.join(where) or 'workers that are gone'}, which left the cluster (the scheduler holds it "
                "as 'no-worker'); submit the blocks without workers= (or with workers that are there) and call "
                "again", lost=False)
        stuck_before = set(stuck)


def _wait_blocks(client, inputs: list[_Input]) -> None:
    futures = [f for inp in inputs for f in inp.futures]
    deadline = time.monotonic() + LOST_BLOCKS_WAIT
    for pause in _mpi.delays(POLL_MIN, POLL_MAX):
        _wait_computed(client, futures)
        # a block whose worker died is "lost" until the scheduler computes it again
        if all(f.status != "lost" for f in futures) or time.monotonic() > deadline:
            break
        time.sleep(pause)
    for n, inp in enumerate(inputs):
        for idx, f in zip(inp.indexes, inp.futures):
            if f.status == "error":
                exc = f.exception()
                raise MPIJobError(f"run_mpi: block {idx} of collection {n} failed to compute: {exc!r}") from exc
            if f.status != "finished":
                raise MPIJobError(f"run_mpi: block {idx} of collection {n} is {f.status}; recompute or persist the "
                                  f"collection again", lost=f.status == "lost")


def _assign(inputs: list[_Input], who_has: dict, nbytes: dict) -> tuple[dict, int]:
    """Worker for each block index: the holder of most of its blocks (fewest moves)."""
    blocks_of: dict = {}
    for inp in inputs:
        for idx, f in zip(inp.indexes, inp.futures):
            blocks_of.setdefault(idx, []).append(f.key)
    load: dict = {}
    owner = {}
    moves = 0
    for idx, keys in blocks_of.items():
        count: dict = {}
        size: dict = {}
        for k in keys:
            for w in who_has.get(k, ()):
                count[w] = count.get(w, 0) + 1
                size[w] = size.get(w, 0) + (nbytes.get(k) or 0)
        if not count:
            raise MPIJobError(f"run_mpi: no worker holds block {idx} (it was lost with a worker); recompute the "
                              f"collection, or pass retries=", lost=True)
        best = max(count, key=lambda w: (count[w], size[w], -load.get(w, 0)))
        owner[idx] = best
        load[best] = load.get(best, 0) + 1
        moves += len(keys) - count[best]
    return owner, moves


# --------------------------------------------------------------------------------------------
# Client side: the participants


def _resolve_workers(workers, known: dict, retrying: bool = False) -> list[str]:
    """``workers=`` as addresses: None, one worker's address or name, or an iterable of them.  When a
    call runs again after a participant died (``retrying``), workers that are gone are left out."""
    if workers is None:
        return []

    def is_one(w) -> bool:
        return isinstance(w, (str, numbers.Integral)) and not isinstance(w, bool)

    if is_one(workers):
        workers = [workers]
    elif isinstance(workers, bytes) or not isinstance(workers, Iterable):
        raise TypeError(f"run_mpi: workers={workers!r:.80} is a {type(workers).__name__}; give a worker's address "
                        f"or name, or a list of them")
    by_name = {str(info.get("name")): addr for addr, info in known.items()}
    out = []
    for w in workers:
        if not is_one(w):
            raise TypeError(f"run_mpi: workers= holds {w!r:.80}, a {type(w).__name__}; give workers' addresses (str) "
                            f"or names")
        if w in known:
            out.append(w)
        elif str(w) in by_name:
            out.append(by_name[str(w)])
        elif retrying:
            logger.info("mpi4dask: run_mpi runs again without %r, which is gone", w)
        else:
            hint = " (workers= takes addresses or names, not a number of workers)" if not isinstance(w, str) else ""
            raise ValueError(f"run_mpi: workers= names {w!r}, which is not a worker of this cluster{hint}; its "
                             f"workers are {sorted(known)}, named {sorted(by_name)}")
    return out


_serviced: set = set()  # ids of schedulers known to run the MPI service (mpi4dask.pm)


def _plan(client, members: list[str]) -> tuple[list[str], dict]:
    """The participants in rank order, and how their communicator is made: ``world`` (ranks of one
    launched job: ``MPI_Comm_create_group``) or ``joined`` (worlds joined on demand through the
    cluster's MPI service, :mod:`mpi4dask.pm`; formed once per set of participants and reused)."""
    from . import pm

    scheduler_id = client.scheduler_info().get("id")
    if scheduler_id not in _serviced:  # once per scheduler: its workers get their credentials
        client.run_on_scheduler(pm.install_on_scheduler)
        _serviced.add(scheduler_id)
    info = _run_on(client, _worker_mpi_info, workers=members)  # asked every time: a worker may be new
    missing = sorted(set(members) - set(info))
    if missing:
        raise _mpi.MPIUnavailableError(f"run_mpi: worker {missing[0]} did not answer (it left the cluster?)")
    errors = {a: i["error"] for a, i in info.items() if "error" in i}
    if errors:
        a, e = sorted(errors.items())[0]
        raise _mpi.MPIUnavailableError(f"run_mpi: worker {a} cannot use MPI: {e}")
    shared: dict[str, list[str]] = {}
    for a in sorted(members):  # by MPI process (its world's identity), not pid: containers share pids
        shared.setdefault(info[a]["ident"], []).append(a)
    for together in shared.values():
        if len(together) > 1:  # one process is one MPI rank: its workers would be one rank twice
            first = info[together[0]]
            raise _mpi.MPIUnavailableError(
                f"run_mpi: workers {together[0]} and {together[1]} run in one process (pid {first['pid']} on "
                f"{first['host']}), and a process is one MPI rank: run_mpi needs each worker it uses in a process "
                "of its own.  Start the workers as processes (LocalCluster(processes=True) or "
                "Client(processes=True), the default; `dask worker`), or keep one worker in this process "
                "(n_workers=1)")
    worlds = {(i["job"], i["size"]) for i in info.values()}
    ranks = [i["rank"] for i in info.values()]
    if len(members) == 1 or (len(worlds) == 1 and len(set(ranks)) == len(ranks) and next(iter(worlds))[1] > 1):
        participants = sorted(members, key=lambda a: info[a]["rank"])
        return participants, {"mode": "world", "world_ranks": [info[a]["rank"] for a in participants],
                              "ctag": 1 + int(uuid.uuid4().int % 30000)}
    static = [a for a in members if not info[a]["dynamic"]]
    if static:
        a = static[0]
        raise _mpi.MPIUnavailableError(
            f"run_mpi: worker {a} (pid {info[a]['pid']}) cannot join other MPI processes: {info[a]['alone']}")
    participants = sorted(members)
    unsafe = sorted(a for a in participants if info[a].get("unsafe"))
    if unsafe:
        _restart_unsafe(client, unsafe, info[unsafe[0]]["unsafe"])
    idents = [info[a]["ident"] for a in participants]
    key = "\n".join(idents)
    reuse = all(key in info[a]["formed"] for a in participants)
    fid = f"mpi4dask-form-{uuid.uuid4().hex}"
    return participants, {"mode": "joined", "idents": idents, "reuse": reuse, "fid": fid}


def _restart_unsafe(client, workers: list[str], why: str):
    """Workers whose MPI may not join another world (:func:`mpi4dask._mpi.joining`) are restarted
    through their Nannies (Dask recomputes what they held); the call fails as if they had died, so
    ``retries`` run it again over the new workers."""
    nannies = {a: w.get("nanny") for a, w in _scheduler_workers(client).items()}
    without = [a for a in workers if not nannies.get(a)]
    if without:
        raise _mpi.MPIUnavailableError(f"run_mpi: worker {without[0]} cannot join other MPI processes any more ({why}) "
                                       "and has no Nanny to restart it: restart that worker")
    client.restart_workers(workers, timeout=60, raise_for_error=False)
    raise MPIJobError(f"run_mpi: worker {workers[0]} could not join other MPI processes any more ({why}); it was "
                      "restarted through its Nanny (run_mpi(..., retries=k) runs the call again)",
                      worker=workers[0], lost=True)


def _lock_name(addr: str) -> str:
    return f"mpi4dask-run_mpi-{addr}"


# --------------------------------------------------------------------------------------------
# The call


@dataclass
class _Launched:
    client: Any
    job: str
    participants: list  # addresses in rank order
    futures: list  # rank tasks, rank order
    owner: dict  # block index -> worker address
    inputs: list
    cluster_size: int = 0  # workers in the cluster when the call started
    code: tuple = ()  # what the call pickled of the user's code (fn, kwargs): where its tracebacks' lines are


def _launch(fn, collections, workers, client, timeout, kwargs, map_blocks: bool, retrying: bool = False):
    from distributed import Client, Lock, get_client

    if not callable(fn):
        raise TypeError(f"run_mpi: fn must be callable (fn(comm, parts, ...)); got {fn!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"run_mpi: timeout={timeout!r}; give seconds > 0, or None for no limit")
    if client is None:
        try:
            client = get_client()
        except ValueError:
            raise ValueError("run_mpi needs a distributed Client: create one (Client(...)) or pass client=") from None
    elif not isinstance(client, Client):
        raise TypeError(f"run_mpi: client={client!r:.80} is a {type(client).__name__}, not a distributed.Client; pass "
                        f"a Client, or leave client=None to use the current one")
    if map_blocks and not collections:
        raise TypeError("map_blocks_mpi needs at least one collection: its blocks are the output's blocks")
    kinds = [_kind(c) for c in collections]
    if len(collections) > 1:
        _check_aligned(collections, kinds)
    _wait_for_endings()
    # every argument is checked before anything is computed: bad input costs the cluster nothing
    extra = _resolve_workers(workers, _scheduler_workers(client), retrying)
    inputs = [_prepare(client, c, k, n) for n, (c, k) in enumerate(zip(collections, kinds))]
    _wait_blocks(client, inputs)
    all_blocks = [f for inp in inputs for f in inp.futures]
    who_has = client.who_has(all_blocks) if all_blocks else {}
    nbytes = client.nbytes([f.key for f in all_blocks], summary=False) if all_blocks else {}
    owner, moves = _assign(inputs, who_has, nbytes)
    members = sorted(set(owner.values()) | set(extra))
    if not members:
        raise ValueError("run_mpi: no participants: the collections are empty and workers= names nobody")
    with _members_may_die(client, members):
        participants, plan = _plan(client, members)
    plan = {**plan, "workers": participants, "retry": retrying}  # for the metrics and dashboard of the workers
    fname = getattr(fn, "__name__", type(fn).__name__)
    job = f"run_mpi-{fname}-{uuid.uuid4().hex[:12]}"
    logger.debug("mpi4dask: %s on %d workers; %d blocks move to co-locate", job, len(participants), moves)

    # one lock per worker, taken in address order: overlapping calls queue and never deadlock
    locks = {a: Lock(_lock_name(a), scheduler_rpc=client.scheduler, loop=client.loop) for a in sorted(participants)}
    held: list[str] = []
    futures: list = []
    try:
        for a, lk in locks.items():
            waited = time.monotonic()
            while not lk.acquire(timeout=30):
                logger.warning("mpi4dask: run_mpi %s has waited %.0f s for worker %s, which is busy with: %s",
                               job, time.monotonic() - waited, a, _busy(client, a))
            held.append(a)
        for rank, a in enumerate(participants):
            mine = [[i for i in inp.indexes if owner[i] == a] for inp in inputs]
            blocks = [[f for i, f in zip(inp.indexes, inp.futures) if owner[i] == a] for inp in inputs]
            shapes = None
            if map_blocks:
                first = inputs[0]
                first_shapes = first.shapes or [None] * len(first.indexes)
                shapes = [s for i, s in zip(first.indexes, first_shapes) if owner[i] == a]
            futures.append(client.submit(
                _rank_task, job, rank, plan, fn, kwargs, mine, blocks, shapes,
                key=f"{job}-rank-{rank}", workers=[a], allow_other_workers=False, pure=False, retries=0,
            ))
        launched = _Launched(client, job, participants, futures, owner, inputs, len(_scheduler_workers(client)),
                             code=(fn, kwargs))
        with _members_may_die(client, participants):
            _start(launched)
        _watch(launched, timeout, fname)
        return launched
    finally:
        _release_when_done(client, locks, held, participants, futures)


def _busy(client, addr: str) -> str:
    try:
        running = client.run(_jobs_running, workers=[addr]).get(addr, [])
    except Exception as e:  # the worker may be gone
        return f"(cannot ask it: {e!r})"
    if not running:
        return "another run_mpi call"
    return "; ".join(f"{r['job']} rank {r['rank']} ({r['phase']} for {r['seconds']} s in {r['fn']})" for r in running)


def _scheduler_workers(client) -> dict:
    """The scheduler's current workers (address -> info), asked now: the client's copy may lag."""
    return client.sync(client.scheduler.identity)["workers"]


def _gone(launched: _Launched) -> list[tuple[int, str]]:
    live = _scheduler_workers(launched.client)
    return [(r, a) for r, a in enumerate(launched.participants) if a not in live]


def _raise_failed(launched: _Launched, fname: str) -> None:
    for rank, f in enumerate(launched.futures):
        if f.status == "error":
            exc = f.exception()
            remote = _sources.client_traceback(f.traceback(), *launched.code)  # the user's file and line
            tb = _sources.format_traceback(remote)
            raise MPIJobError(
                f"run_mpi: {fname} failed on rank {rank} of {len(launched.futures)} (worker "
                f"{launched.participants[rank]}): {type(exc).__name__}: {exc}\n\nRemote traceback (rank {rank}):\n{tb}",
                rank=rank, worker=launched.participants[rank], remote_traceback=tb,
            ) from exc.with_traceback(remote)
        if f.status == "cancelled":
            raise MPIJobError(f"run_mpi: the task of rank {rank} (worker {launched.participants[rank]}) was "
                              f"cancelled", rank=rank, worker=launched.participants[rank])


def _abort(launched: _Launched, why: str) -> None:
    try:
        live = sorted(set(launched.participants) & set(_scheduler_workers(launched.client)))
        if live:
            launched.client.run(_job_abort, launched.job, why, workers=live)
    except Exception:
        logger.debug("mpi4dask: could not call off %s", launched.job, exc_info=True)


def _gather(launched: _Launched, fname: str) -> list:
    """The ranks' results.  A rank whose worker dies after ``fn`` returned loses its result, and its
    task, pinned to that worker, could never run again: that is a participant lost, not a wait."""
    def check():
        gone = _gone(launched)
        if gone:
            rank, a = gone[0]
            for f in launched.futures:
                f.cancel()
            raise MPIJobError(f"run_mpi: participant {a} (rank {rank}) died after {fname} returned there, before its "
                              "result was fetched", rank=rank, worker=a, lost=True)

    return _unless_gone(lambda: launched.client.gather(launched.futures), "mpi4dask-gather", check)


def _run_on(client, fn, *args, workers: list) -> dict:
    """``client.run(fn, *args, workers=workers)`` for the steps that set a call up, but a worker that
    leaves the scheduler meanwhile ends the wait at once (``CommClosedError``, which
    :func:`_members_may_die` makes a lost participant).  Without this, the scheduler's run on a
    worker that has just died or been retired retries its connection for distributed's connect
    timeout (30 s, measured in chaos runs) before it fails."""
    from distributed.comm import CommClosedError

    def check():
        live = _scheduler_workers(client)
        gone = [a for a in workers if a not in live]
        if gone:
            raise CommClosedError(f"worker {gone[0]} left the cluster while {getattr(fn, '__name__', fn)} ran on it")

    return _unless_gone(lambda: client.run(fn, *args, workers=workers), "mpi4dask-run-on", check)


def _unless_gone(call: Callable, name: str, check: Callable[[], None]):
    """``call()`` (a client request that waits for workers) on a thread of its own, its result or
    its exception handed back; every ``GONE_CHECK`` seconds while it runs, ``check()`` may raise to
    stop waiting (a participant left: the request could wait for it long or forever).  No scheduler
    question while the answer comes in time (warm calls: milliseconds)."""
    box = bounded(None, call, name, check, GONE_CHECK)
    if "error" in box:
        raise box["error"]
    return box["value"]


@contextlib.contextmanager
def _members_may_die(client, members: list):
    """A connection to a participant that breaks while the call is set up (a ``client.run`` on it)
    is that participant dying or leaving: an ``MPIJobError`` with ``lost`` (which ``retries`` retry)."""
    from distributed.comm import CommClosedError

    try:
        yield
    except (CommClosedError, OSError) as exc:
        # the connection can break before the scheduler drops the worker (measured in a chaos run: the
        # broadcast failed, the worker was still listed, and the raw error ended a call with retries)
        deadline = time.monotonic() + LEAVE_WAIT
        for pause in _mpi.delays(POLL_MIN, POLL_MAX):
            live = _scheduler_workers(client)
            gone = [a for a in members if a not in live]
            if gone or time.monotonic() > deadline:
                break
            time.sleep(pause)
        if not gone:
            raise
        err = MPIJobError(f"run_mpi: participant {gone[0]} died or left the cluster while the call was being set "
                          f"up ({type(exc).__name__}); nothing ran. Call run_mpi again (or pass retries=) to use the "
                          f"workers that are left", worker=gone[0], lost=True)
        if hasattr(exc, "_recovery"):  # _start ended ranks that the go had reached
            err._recovery = exc._recovery
        raise err from exc


def _start(launched: _Launched) -> None:
    """Wait until every rank task runs, then let them all into MPI at once."""
    client, job = launched.client, launched.job
    going = False
    try:
        for pause in _mpi.delays(POLL_MIN, POLL_MAX):
            gone = _gone(launched)
            if gone:
                rank, a = gone[0]
                raise MPIJobError(f"run_mpi: participant {a} (rank {rank}) is not in the cluster any more (it died "
                                  f"or left before the job started); nothing ran. Call run_mpi again (or pass "
                                  f"retries=) to use the workers that are left", rank=rank, worker=a, lost=True)
            _raise_failed(launched, "the rank task")
            status = _run_on(client, _job_status, job, workers=launched.participants)
            if all(status[a]["phase"] == "waiting" for a in launched.participants):
                break
            time.sleep(pause)
        going = True
        _run_on(client, _job_go, job, workers=launched.participants)
    except BaseException as e:
        _abort(launched, f"{type(e).__name__}: {e}")
        gone = {a for _, a in _gone(launched)} if going else set()
        if gone:  # the go reached some ranks: they may wait in MPI for the one that left
            logger.warning("mpi4dask: run_mpi %s: %s left as the ranks were let go%s", job, sorted(gone),
                           _release_blocked(launched, gone))
            e._recovery = (launched.client, launched.cluster_size)
        for f in launched.futures:
            f.cancel()
        raise


def _watch(launched: _Launched, timeout: float | None, fname: str) -> None:
    from distributed import wait

    deadline = None if timeout is None else time.monotonic() + timeout
    last_check = time.monotonic()
    while True:
        if any(f.status in ("error", "cancelled") for f in launched.futures):
            _raise_failed(launched, fname)
        pending = [f for f in launched.futures if not f.done()]
        if not pending:
            return
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            running = [r for r, f in enumerate(launched.futures) if not f.done()]
            raise TimeoutError(
                f"run_mpi: {fname} did not finish within timeout={timeout} s; ranks {running} (workers "
                f"{[launched.participants[r] for r in running]}) are still running. MPI cannot cancel them: they keep "
                f"their worker threads until {fname} returns, and later run_mpi calls on those workers wait for "
                f"them. If they are stuck in a collective, restart the workers")
        if now - last_check > GONE_CHECK:  # a participant that leaves mid-job (under mpiexec, MPI ends the job)
            last_check = now
            gone = [(r, a) for r, a in _gone(launched) if launched.futures[r] in pending]
            if gone:
                rank, a = gone[0]
                released = _release_blocked(launched, {g for _, g in gone})
                err = MPIJobError(f"run_mpi: participant {a} (rank {rank}) died or left the cluster while {fname} "
                                  f"ran{released}", rank=rank, worker=a, lost=True)
                err._recovery = (launched.client, launched.cluster_size)
                raise err
        step = GONE_CHECK if deadline is None else max(0.001, min(GONE_CHECK, deadline - now))
        try:  # wakes as soon as a rank finishes (or fails)
            wait(pending, timeout=step, return_when="FIRST_COMPLETED")
        except (TimeoutError, asyncio.TimeoutError):  # the same class from Python 3.11 on, not in 3.10
            pass


async def _end_process() -> None:
    """Runs on a worker (``client.run``) whose rank waits in MPI for a dead one: end its process at once
    (a graceful close would wait for the thread stuck in MPI); its Nanny starts a new one."""
    os._exit(70)


async def _kill_if_serving(address: str, dask_worker=None) -> bool:
    """Runs on a Nanny (``client.run(..., nanny=True)``): kill its worker process if it is still the one
    at ``address`` (its Nanny then starts a new one).  Asked of the Nanny, which alone knows: a worker
    that ended itself meanwhile has been replaced, or is being replaced, and its new one is left alone."""
    if dask_worker.worker_address != address:
        return False
    await dask_worker.kill(reason="mpi4dask-run_mpi-blocked-rank")
    return True


def _still_listed(client, workers: list, seconds: float) -> list:
    """Wait up to ``seconds`` for ``workers`` to leave the scheduler; those still listed then."""
    deadline = time.monotonic() + seconds
    for pause in _mpi.delays(POLL_MIN, POLL_MAX):
        still = sorted(set(workers) & set(_scheduler_workers(client)))
        if not still or time.monotonic() > deadline:
            return still
        time.sleep(pause)
    raise AssertionError("unreachable")


def _release_blocked(launched: _Launched, gone: set) -> str:
    """A participant died: the ranks still in ``fn`` may wait in MPI for it forever (MPICH cannot tell
    them; no fault tolerance).  Cancel every rank task, and end the processes of the workers whose
    rank is still running: their Nannies start new ones, and Dask recomputes the data they held, as
    after any worker's death.  Returns a sentence for the error message."""
    client = launched.client
    running = [a for a, f in zip(launched.participants, launched.futures) if not f.done() and a not in gone]
    for f in launched.futures:
        f.cancel()
    if not running:
        return ""
    nannies = {a: w.get("nanny") for a, w in _scheduler_workers(client).items()}
    restartable = [a for a in running if nannies.get(a)]
    if restartable:
        def ask():
            try:
                client.run(_end_process, workers=restartable, wait=False)
            except Exception as e:  # noqa: BLE001 - the workers may be going already
                logger.debug("mpi4dask: ending %s failed: %r", restartable, e)

        def end():
            # the ask can wait for a frozen worker's answer (measured: a chaos run hung there for
            # minutes), so it runs on a thread of its own; the workers get END_ASK seconds to leave
            asking = threading.Thread(target=ask, name="mpi4dask-end-ranks-ask", daemon=True)
            asking.start()
            try:
                still = _still_listed(client, restartable, END_ASK)
            except Exception as e:  # noqa: BLE001 - the client is closing: the Nannies act on their own
                logger.debug("mpi4dask: watching %s leave failed: %r", restartable, e)
                return
            # a rank that waits inside MPICH holding its lock (MPI_Comm_accept for a dead partner) stops
            # its worker's event loop too: its Nanny, a process of its own, kills it instead.  Only if
            # that worker is still the Nanny's: a Nanny told to restart while it already starts a new
            # worker (its old one ended itself late) ended that new one, which a retry had chosen (seen in CI)
            for a in still:
                try:
                    client.run(_kill_if_serving, a, workers=[a], nanny=True)
                except Exception as e:  # noqa: BLE001 - it left meanwhile: it ended itself
                    logger.debug("mpi4dask: restarting %s failed: %r", a, e)

        # on a thread of its own: the caller goes on as soon as the workers are gone from the scheduler;
        # the next call (a retry or the user's) waits for it to finish (_wait_for_endings)
        ending = threading.Thread(target=end, name="mpi4dask-end-ranks", daemon=True)
        _endings.add(ending)
        ending.start()
        _still_listed(client, restartable, RELEASE_WAIT)  # gone from the scheduler before the caller goes on
    stuck = sorted(set(running) - set(restartable))
    said = f"; the {len(restartable)} ranks still in MPI were ended, their Nannies start new workers" \
        if restartable else ""
    if stuck:
        said += (f"; the ranks still in MPI on {stuck} (workers without a Nanny) keep their threads: restart those "
                 "workers")
    return said


def _release_when_done(client, locks: dict, held: list, participants: list, futures: list) -> None:
    """Each worker's lock is released when its rank task ends (at once if it never got one); a release
    that comes after the client began to close is skipped (the client's leases end with it; distributed
    would log the refused release as an ERROR with a traceback)."""
    task_of = dict(zip(participants, futures))

    def release(lk, done: threading.Event):
        try:
            if client.status not in ("closing", "closed"):
                lk.release()
        except Exception:  # already released, or the client is closing: the lease expires on its own
            logger.debug("mpi4dask: releasing %s failed", lk.name, exc_info=True)
        finally:
            done.set()
            _unreleased.pop(id(done), None)

    for a in held:
        lk, f, done = locks[a], task_of.get(a), threading.Event()
        if f is None or f.done():
            release(lk, done)
        else:
            _unreleased[id(done)] = (f, done)
            f.add_done_callback(
                lambda _f, lk=lk, done=done: threading.Thread(target=release, args=(lk, done), daemon=True).start())


_unreleased: dict = {}  # id -> (rank task, set once its lock is released): locks of tasks still running at launch


def _wait_for_releases(timeout: float = 5.0) -> None:
    """Before run_mpi returns or raises: the locks of the rank tasks that have ended are released (one
    scheduler call each), so a client closed right after the call finds no release under way; a task
    still running releases its lock when it ends."""
    deadline = time.monotonic() + timeout
    for f, done in list(_unreleased.values()):
        if f.done():
            done.wait(max(0.0, deadline - time.monotonic()))


_endings: set = set()  # threads of _release_blocked still ending blocked ranks


def _wait_for_endings() -> None:
    """Before a call picks its participants: the ranks that an earlier call's failure left blocked are
    ended (up to ``RECOVERY_WAIT`` s).  A Nanny restart asked for later would end the new worker that
    its Nanny has started meanwhile, one the call may have chosen (seen in CI: a retry failed so)."""
    deadline = time.monotonic() + RECOVERY_WAIT
    for t in list(_endings):
        t.join(max(0.0, deadline - time.monotonic()))
        if not t.is_alive():
            _endings.discard(t)


def _wait_for_workers_back(client, size: int) -> None:
    """Before running a call again: give the Nannies up to ``RECOVERY_WAIT`` s to bring the cluster
    back to ``size`` workers (the dead one and the ranks that were ended restart); go on with fewer."""
    _wait_for_endings()
    deadline = time.monotonic() + RECOVERY_WAIT
    for pause in _mpi.delays(POLL_MIN, POLL_MAX):
        if len(_scheduler_workers(client)) >= size or time.monotonic() > deadline:
            return
        time.sleep(pause)


def _with_retries(retries, launch):
    """Run ``launch(retrying)``; when a participant dies (``MPIJobError.lost``), run it again, up to ``retries``
    more times, on the workers there are then (the lost chunks recomputed by Dask).  However it ends
    (a result, an error, a timeout, an interrupt), the locks of the rank tasks that ended are released
    before it returns (:func:`_wait_for_releases`)."""
    try:
        return _attempts(retries, launch)
    finally:
        _wait_for_releases()


def _attempts(retries, launch):
    if not (isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0):
        raise ValueError(f"run_mpi: retries={retries!r}; give a whole number >= 0 (how many times to run the call "
                         "again after a participant dies)")
    for attempt in range(retries + 1):
        try:
            return launch(attempt > 0)
        except MPIJobError as e:
            if not e.lost or attempt == retries:
                raise
            logger.warning("mpi4dask: %s; running the call again (%d of %d)", e, attempt + 1, retries)
            recovery = getattr(e, "_recovery", None)
            if recovery is not None:
                _wait_for_workers_back(*recovery)
    raise AssertionError("unreachable")


def run_mpi(fn: Callable, *collections, workers=None, client=None, timeout: float | None = None, retries: int = 0,
            **kwargs) -> list:
    """Call the MPI function ``fn(comm, parts, ..., **kwargs)`` inside every worker holding chunks.

    Parameters
    ----------
    fn
        Runs on a worker thread (never the event loop) of each participant, as
        ``fn(comm, parts_1, parts_2, ..., **kwargs)``. ``comm`` is an mpi4py intracommunicator of
        exactly the participating workers, ranked in their MPI world order; ``parts_n`` is
        ``{block index: chunk}`` for the blocks of the n-th collection that this worker holds: the
        chunk objects from the worker's memory, not copies.  Block indexes: dask arrays
        ``(i, j, ...)``, dask dataframes and bags the partition number, lists of Futures the position.
        While ``fn`` waits for other ranks in any call on ``comm`` (lowercase or uppercase,
        point-to-point or collective, ``Wait``, ``Probe``), the worker's event loop goes on serving
        heartbeats, transfers and ``client.run``: ``comm`` is an ``MPI.Intracomm`` subclass that
        keeps mpi4py from waiting with the GIL held, and so are the communicators made from it with
        ``Dup``, ``Split``, ``Create_group`` and the like (see ``mpi4dask.handoff._comm_class``).
    *collections
        dask arrays, dask dataframes/series, dask bags, or lists of Futures.  Unpersisted collections
        are persisted first.  Blocks with the same index (over all collections) are put on the same
        worker, moving the fewest chunks needed, and given to ``fn`` together, so collections passed
        together must have the same block indexes, or ``ValueError``:

        * arrays: the same ``numblocks``, and along every axis where they have the same length, the
          same chunks (blocks with one index cover the same range).  Along axes of different
          lengths chunk sizes may differ: ``X`` with chunks ``((1000,) * 6, (40,))`` goes with
          ``y[:, None]`` with chunks ``((1000,) * 6, (1,))``;
        * dataframes/series, bags and lists of Futures: as many partitions (items); divisions are
          not compared;
        * arrays cannot go with the others (tuple indexes against partition numbers): convert one,
          e.g. ``df.to_dask_array(lengths=True)``.

        Data that every rank needs goes in ``**kwargs`` (Futures there are resolved on each rank).
    workers
        Extra workers to take part with empty ``parts``: one worker's address or name, or an
        iterable of them; by default only the workers that hold blocks take part.
    client
        The :class:`distributed.Client` to use; default: the current one.
    timeout
        Seconds the MPI phase may take; then ``TimeoutError`` (the ranks still running cannot be
        cancelled and keep their worker threads).
    retries
        How many times to run the call again when a participant dies or leaves (default 0): each
        time on the workers there are then, the lost chunks recomputed by Dask, the communicator
        formed anew.  Failures of ``fn`` itself are never retried.
    **kwargs
        Passed to ``fn``.

    Returns
    -------
    list
        ``fn``'s return value of every rank, in rank order.

    Raises
    ------
    TypeError, ValueError
        Arguments of the wrong type or value (the message names the value), collections whose
        blocks do not line up, ``workers=`` naming no worker of the cluster.
    MPIJobError
        ``fn`` raised on a rank (message: rank, worker, remote traceback), or a participant died or
        left (``lost``; within about a second of its death).  The first failure is raised as soon as it
        happens.  After a death, the ranks still in ``fn`` are restarted by their Nannies (they could
        wait in MPI for the dead one forever: MPICH has no fault tolerance), so the next call finds
        the cluster free.
    mpi4dask.MPIUnavailableError
        A participant cannot use MPI (the message names the worker and the cause: the cluster's MPI
        service unreachable or refusing it, MPI missing, no ``MPI_THREAD_MULTIPLE``, a singleton
        MPI initialised before mpi4dask could serve it).

    Concurrent calls on overlapping workers queue (one MPI job at a time per worker).
    """
    def launch(retrying: bool):
        launched = _launch(fn, collections, workers, client, timeout, kwargs, map_blocks=False, retrying=retrying)
        return _gather(launched, getattr(fn, "__name__", type(fn).__name__))

    return _with_retries(retries, launch)


def map_blocks_mpi(fn: Callable, *collections, workers=None, client=None, timeout: float | None = None,
                   retries: int = 0, meta=None, divisions=None, **kwargs):
    """Like :func:`run_mpi`, but ``fn`` returns new blocks, and the result is a Dask collection.

    ``fn(comm, parts_1, ...)`` must return ``{block index: new block}`` for exactly the block
    indexes of the first collection that it was given (``parts_1``'s keys; ``{}`` when it got
    none).  The new blocks stay on the workers that made them (no copies).

    Parameters
    ----------
    fn : callable
        ``fn(comm, parts_1, parts_2, ..., **kwargs)``, as in :func:`run_mpi`, returning
        ``{block index: new block}``.
    *collections
        As in :func:`run_mpi`; at least one.  The first one gives the result its type and blocks.
    workers, client, timeout, retries
        As in :func:`run_mpi`.
    meta : optional
        For a dataframe/series result: its metadata (default: the first new partition's empty slice).
    divisions : optional
        For a dataframe/series result: its divisions (default: unknown; pass the old ones if the
        index is kept).
    **kwargs
        Passed to ``fn``.

    Returns
    -------
    dask collection or list of Futures
        A collection like the first one:

        * dask array: same chunks (each new block must have its chunk's shape; the dtype may change);
        * dask dataframe/series: same number of partitions;
        * dask bag: same number of partitions;
        * list of Futures: a list of Futures in the same order.

    Raises
    ------
    TypeError, KeyError, ValueError
        As in :func:`run_mpi`, and (as an :class:`MPIJobError` from the rank) when ``fn`` does not
        return a dict, returns other block indexes than it was given, or changes an array block's
        shape.
    MPIJobError
        As in :func:`run_mpi`.
    """
    launched = _with_retries(retries, lambda retrying: _launch(fn, collections, workers, client, timeout, kwargs,
                                                               map_blocks=True, retrying=retrying))
    c = launched.client
    first = launched.inputs[0]
    rank_of = {a: r for r, a in enumerate(launched.participants)}
    picks = []
    for idx in first.indexes:
        a = launched.owner[idx]
        picks.append(c.submit(_pick, launched.futures[rank_of[a]], idx, key=f"{launched.job}-block-{idx}",
                              workers=[a], allow_other_workers=True, pure=False))
    try:
        metas = c.gather([c.submit(operator.itemgetter(1), f, workers=[launched.participants[r]], pure=False)
                          for r, f in enumerate(launched.futures)])
    finally:
        _wait_for_releases()  # the rank tasks have ended (or failed)
    sample = next((m for m in metas if m is not None), None)
    return _collection_like(first, picks, meta if meta is not None else sample, divisions)


def _collection_like(first: _Input, picks: list, meta, divisions):
    if first.kind == "futures":
        return picks
    if first.kind == "bag":
        import dask.bag as db

        return db.from_delayed(picks)
    if first.kind == "dataframe":
        import dask.dataframe as dd

        return dd.from_delayed(picks, meta=meta, divisions=divisions, verify_meta=False)
    import dask.array as da

    x = first.collection
    blocks = [da.from_delayed(p, shape=s, dtype=meta.dtype if meta is not None else x.dtype, meta=meta)
              for p, s in zip(picks, first.shapes)]
    grid = _nest(blocks, x.numblocks)
    return da.block(grid) if x.ndim else blocks[0]


def _nest(flat: list, shape: tuple):
    if len(shape) <= 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
