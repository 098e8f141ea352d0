"""The wire format of ``mpi://`` connections, and a fast path for (de)serializing their messages.

Records on a connection's socket
--------------------------------
After the handshake (JSON, see :mod:`mpi4dask._handshake`) each direction of the socket carries a stream
of records, each starting with one kind byte (integers little-endian):

``F`` a message::

    b"F" | u32 count | u64 size[count] | u8 via[count] | the bytes of the via == 0 frames, in order

  ``count``'s high bit (``FAST``) says that the frames come from :func:`dumps` (the reader may decode
  them with :func:`loads`), the next (``JOINED``) that its MPI frames are joined into runs (below); the low
  30 bits are the number of frames.  ``via[i]`` is ``VIA_SOCKET``
  (0: the frame's bytes follow on the socket), ``VIA_MPI`` (1: the frame travels over MPI
  point-to-point, to the receive tag the reader chose in the handshake, and the reader gives it a
  buffer of its own; at least ``BULK_FRAME`` bytes, or the reader refuses the record) or
  ``VIA_MPI_SHARD`` (2: over MPI too, the next shard of the buffer that the
  frame before it, itself over MPI, came from: distributed splits a large buffer into shards, and the
  reader lays them out one after the other in one buffer, which distributed then joins without a
  copy; :func:`frame_routes`).  So, as over distributed's tcp://, two objects of one message never share
  memory at the reader: one that lives on keeps only its own bytes.  The MPI frames of
  a record, in order, form one byte stream, cut into MPI messages: each frame its own (pieces of at most
  ``MAX_CHUNK`` bytes), or, with ``JOINED``, by :func:`mpi_runs`: a frame of
  ``COALESCE_MAX`` bytes or more, or of an eighth of the record's MPI bytes or more, on its own; runs
  of smaller consecutive frames joined into one message (the writer copies them together: a
  dataframe of 100 small columns costs one MPI message, not 100, and MPI never queues more sends
  than its shared-memory queue holds, while the few blocks of a typical dataframe go uncopied);
  each message of at most ``MAX_CHUNK`` bytes (:mod:`mpi4dask._datapath`; a larger frame goes as
  several); messages in the order of the records.

``A`` the reader has *read* one more message that had ``VIA_MPI`` frames: the writer's send window
  (the MPI bytes it may have unread by the peer) grows back by that message's MPI bytes.

``N`` a nudge, from the reader: it has been waiting for MPI frames for a while.  MPI moves some
  messages only when the *sender* calls MPI (e.g. when its shared-memory queue was full), and an
  idle event loop makes no MPI call: the writer tests its sends on receipt, which moves them on.

``B`` goodbye: the writer closed the connection, or will write nothing more on it; nothing follows.
  A connection whose ends share MPI answers the peer's goodbye with its own as soon as it reads it
  (whether or not anyone reads the connection), and the side that closed first reads on until that
  answer: every message the peer will ever send is then announced, so the closing side knows when
  nothing more can arrive over MPI for it (``SocketComm.close`` in :mod:`mpi4dask.comm`).

``X`` abort: the writer aborted the connection (``abort()``, or a read or write of it cancelled): it reads
  none of the peer's messages any more, announces nothing more, and nothing follows.  The peer treats the
  connection as lost (its reads and writes raise), answers with ``B`` and closes its socket; the aborting
  side reads on until that answer, as after its goodbye, so both ends know when nothing more can arrive
  over MPI.  A connection whose socket, records or MPI transfers broke aborts without it.

So a message's header arrives with the event that wakes the reader (the socket), and the only
thing MPI carries is the bulk of large frames, whose receives are posted as soon as the header is
parsed.  A connection whose ends are not in one MPI world sends every frame with ``VIA_SOCKET``.

Fast (de)serialization
----------------------
``distributed.protocol.dumps`` serializes a NumPy array in ``to_serialize(...)`` through the
``"dask"`` family: dispatch, a header describing dtype and strides, frame splitting, a compression
check; its ``loads`` undoes all of it.  On this project's 2-core VM that costs ~50 us + ~30 us per
message, far more than MPI's 2 us.  Contiguous arrays do not need any of it: pickle protocol 5 with
out-of-band buffers gives the same array back with zero copies in ~12 us for both directions.
A pandas DataFrame or Series goes through distributed's ``"pickle"`` family anyway, after a
``sizeof`` of the whole message that only decides whether to pickle it in a thread: ~0.9 ms of a
cold worker's event loop for a 6 MB partition of three numeric columns, to pickle it in 0.6 ms.
One whose columns and index are plain NumPy numbers or booleans pickles in a time that does not
grow with its rows (its column bytes go out of band), so it needs no thread either.

:func:`dumps` writes **the standard distributed frame layout** (message msgpack first, then for
each serialized object a msgpack sub-header and its frames), choosing the ``"pickle"`` family for
C- or F-contiguous, non-object NumPy arrays and for such plain pandas objects
(:func:`_plain_pandas`).  So any reader can decode it with ``distributed.protocol.loads`` (a
scheduler reading with ``deserialize=False`` gets ``Serialized`` objects that workers later
unpickle), and :func:`loads` decodes it faster when the reader deserializes.  Messages with
anything else in ``Serialize``, or with ``ToPickle``/``Serialized``/``Pickled`` objects, or that
msgpack cannot encode, return ``None``: the caller then uses distributed's own ``dumps``, so
behaviour is unchanged for them.
"""

from __future__ import annotations

import pickle
import struct
import sys

import msgpack
import numpy as np
from distributed.protocol import loads as _std_loads
from distributed.protocol.serialize import Serialize, msgpack_decode_default, msgpack_encode_default
from distributed.protocol.utils import msgpack_opts

_ndarray = np.ndarray
_sub_headers: dict[tuple, bytes] = {}  # writeable flags -> packed pickle-family sub-header
_array_pickles: dict[tuple, bytes] = {}  # (dtype, shape, C-contiguous, writeable) -> the pickle, buffers out of band
_array_layouts: dict[bytes, tuple] = {}  # an array's pickle -> what it decodes to (see _layout)
ARRAY_PICKLES_MAX = 1024


class _NotFast(Exception):
    pass


def _sub_header(writeable: tuple) -> bytes:
    h = _sub_headers.get(writeable)
    if h is None:
        h = msgpack.dumps(
            {"serializer": "pickle", "writeable": writeable, "num-sub-frames": 1 + len(writeable)},
            use_bin_type=True,
        )
        if len(_sub_headers) < 64:
            _sub_headers[writeable] = h
    return h


def _array_pickle(x) -> tuple[list, bytes]:
    """The out-of-band buffers and the pickle (protocol 5) of a contiguous array.  The pickle holds only
    the array's dtype, shape and order, and whether its buffer is read-only (its bytes travel out of
    band), so arrays that agree on those share it: it is made once (~4 us) and reused."""
    dt = x.dtype
    flags = x.flags
    key = (dt, x.shape, flags.c_contiguous, flags.writeable) if dt.fields is None and dt.metadata is None else None
    pik = _array_pickles.get(key) if key is not None else None
    if pik is not None:
        return [pickle.PickleBuffer(x).raw()], pik
    buffers: list = []
    pik = pickle.dumps(x, protocol=5, buffer_callback=buffers.append)
    if key is not None and len(buffers) == 1:
        _keep(_array_pickles, key, pik)
    return [b.raw() for b in buffers], pik


def _keep(cache: dict, key, value) -> None:
    """Add to one of the module's caches, emptied when full (a working set of many one-off shapes moved on)."""
    if len(cache) >= ARRAY_PICKLES_MAX:
        cache.clear()
    cache[key] = value


def _unpickle(pik, buffers: list):
    """``pickle.loads(pik, buffers=buffers)``; for the pickle of a plain contiguous array seen before (its
    dtype, shape, order and read-only flag: see :func:`_array_pickle`), the array numpy's unpickling makes
    (``frombuffer`` and ``reshape``, as ``numpy._core.numeric._frombuffer`` does), built directly on the
    one buffer.  The pickle machinery costs 7-8 us warm and 55-61 us cold, on the critical path of every
    message that carries an array; this path 1.5 us warm.  Measured, mpi:// ping-pong one way, medians
    of 6 runs interleaved with ``pickle.loads``: 64 KiB 182 against 236 us, 8 MiB 1398 against 1514 us."""
    if len(buffers) != 1:
        return pickle.loads(pik, buffers=buffers)
    key = pik if type(pik) is bytes else bytes(pik)
    layout = _array_layouts.get(key)
    if layout is not None:
        return _rebuild(buffers[0], *layout)
    obj = pickle.loads(key, buffers=buffers)
    layout = _layout(obj, buffers[0], key)
    if layout is not None:
        _keep(_array_layouts, key, layout)
    return obj


def _rebuild(buf: memoryview, dtype, shape: tuple, order: str, readonly: bool):
    if readonly and not buf.readonly:
        buf = buf.toreadonly()  # the pickle marked its buffer read-only
    return np.frombuffer(buf, dtype).reshape(shape, order=order)


def _layout(obj, buf: memoryview, pik: bytes) -> tuple | None:
    """What :func:`_rebuild` needs to make ``obj`` again from another buffer: ``(dtype, shape, order,
    read-only)`` when ``obj`` is a plain contiguous array that numpy's ``_frombuffer`` made on ``buf`` and
    the rebuild gives the same array (dtype, shape, strides, flags, memory); None otherwise."""
    if type(obj) is not _ndarray or b"_frombuffer" not in pik or obj.nbytes != buf.nbytes:
        return None
    dt, flags = obj.dtype, obj.flags
    order = "C" if flags.c_contiguous else "F" if flags.f_contiguous else None
    if order is None or dt.fields is not None or dt.metadata is not None or dt.hasobject:
        return None
    layout = (dt, obj.shape, order, not flags.writeable)
    again = _rebuild(buf, *layout)
    same = (again.dtype == dt and again.shape == obj.shape and again.strides == obj.strides
            and again.flags.writeable == flags.writeable and again.flags.f_contiguous == flags.f_contiguous)
    if not same or (obj.nbytes and again.ctypes.data != obj.ctypes.data):
        return None
    return layout


_PLAIN_KINDS = "biufc"  # numpy dtype kinds whose pandas columns pickle out of band: booleans, numbers (not datetimes)


def _plain_dtype(dt) -> bool:
    return isinstance(dt, np.dtype) and dt.kind in _PLAIN_KINDS


def _plain_array(a) -> bool:
    """A NumPy array of numbers or booleans that pickles out of band (C- or F-contiguous)."""
    return type(a) is _ndarray and a.dtype.kind in _PLAIN_KINDS and (a.flags.c_contiguous or a.flags.f_contiguous)


def _plain_pandas(x) -> bool:
    """Whether ``x`` is a pandas DataFrame or Series whose blocks and index are plain NumPy arrays of
    numbers or booleans in contiguous memory (no objects, strings, extension arrays, or datetimes, whose
    bytes pandas pickles in band): its protocol-5 pickle is short and its column bytes go out of band.
    (The column labels, one per column, pickle in band.)  A row slice of a frame (``df.iloc[a:b]``, the
    partitions of ``from_pandas``) is a view whose blocks of two or more columns are not contiguous:
    numpy pickles those bytes in band, a copy that distributed makes in a thread for a large message,
    so such a frame is left to distributed.  The blocks are pandas' own (``_mgr.blocks``: each pickles
    as one array; an extension or datetime block's values are no NumPy array); a pandas without them
    leaves every frame to distributed."""
    pd = sys.modules.get("pandas")  # no pandas imported: x is no pandas object
    if pd is None or (type(x) is not pd.DataFrame and type(x) is not pd.Series):
        return False
    try:
        arrays = [b.values for b in x._mgr.blocks]
        index = x.index
        if type(index) is not pd.RangeIndex:
            if type(index) is not pd.Index or not _plain_dtype(index.dtype):
                return False
            arrays.append(index.to_numpy())  # its own array, not a copy, for a NumPy dtype
    except AttributeError:
        return False
    return all(_plain_array(a) for a in arrays)


def _pandas_pickle(x) -> tuple[list, bytes]:
    """The out-of-band buffers and the pickle (protocol 5) of a plain pandas object (:func:`_plain_pandas`),
    as distributed's ``"pickle"`` family makes them; one that refers to ``__main__`` (its ``attrs``)
    is left to distributed, which pickles it by value."""
    buffers: list = []
    try:
        pik = pickle.dumps(x, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
    except Exception as exc:  # noqa: BLE001 - e.g. attrs that pickle cannot take: distributed's dumps decides
        raise _NotFast from exc
    if b"__main__" in pik:
        raise _NotFast
    return views, pik


def dumps(msg) -> list | None:
    """Frames for ``msg`` in distributed's layout, or ``None`` when it needs distributed's dumps."""
    frames: list = [None]

    def default(obj):
        if type(obj) is Serialize:
            x = obj.data
            if type(x) is _ndarray and not x.dtype.hasobject and (x.flags.c_contiguous or x.flags.f_contiguous):
                views, pik = _array_pickle(x)
            elif _plain_pandas(x):
                views, pik = _pandas_pickle(x)
            else:
                raise _NotFast
            offset = len(frames)
            frames.append(_sub_header(tuple(not v.readonly for v in views)))
            frames.append(pik)
            frames.extend(views)
            return {"__Serialized__": offset}
        if isinstance(obj, Serialize):  # subclasses (ToPickle is not one) and the like
            raise _NotFast
        encoded = msgpack_encode_default(obj)
        if encoded is obj:
            raise _NotFast  # msgpack cannot encode it; distributed's dumps falls back to pickle
        return encoded

    try:
        frames[0] = msgpack.dumps(msg, default=default, use_bin_type=True)
    except (_NotFast, TypeError, ValueError, OverflowError):
        return None
    return frames


def decodes_alike(deserializers) -> bool:
    """Whether :func:`loads` decodes with these ``deserializers`` as with none given."""
    return deserializers is None or "pickle" in deserializers


class NotArrived(Exception):
    """:func:`loads` needs a frame whose bytes have not arrived yet."""


def _only_points(pik) -> bool:
    """Whether unpickling ``pik`` only points into its out-of-band buffers, never reads them: an array's
    pickle (numpy's ``_frombuffer`` is its first global).  Other objects (a pandas DataFrame) are
    decoded early only once their buffers are in."""
    return b"_frombuffer" in bytes(pik[:48])


def loads(frames, deserializers=None, arrived=None):
    """Decode frames written by :func:`dumps` for a reader that deserializes.

    ``arrived``: for decoding a message before all its bytes are in, ``arrived(i)`` says whether frame
    ``i`` is; a frame that decoding parses (the message's msgpack, an object's sub-header and pickle)
    and that has not arrived raises :class:`NotArrived`.  Only the out-of-band buffers of arrays, which
    the decoded arrays merely point into, may still be on their way (:func:`_only_points`)."""
    if not decodes_alike(deserializers):
        return _std_loads(frames, deserialize=True, deserializers=deserializers)
    if arrived is not None and not arrived(0):
        raise NotArrived(0)

    def hook(obj):
        offset = obj.get("__Serialized__", 0)
        if offset > 0:
            if arrived is not None and not (arrived(offset) and arrived(offset + 1)):
                raise NotArrived(offset)
            header = msgpack.loads(frames[offset], use_list=False, **msgpack_opts)
            if arrived is not None and not _only_points(frames[offset + 1]):
                late = [i for i in range(len(header["writeable"])) if not arrived(offset + 2 + i)]
                if late:
                    raise NotArrived(offset + 2 + late[0])  # unpickling a pandas object may read them
            buffers = []
            for i, writeable in enumerate(header["writeable"]):
                b = frames[offset + 2 + i]
                mv = b if type(b) is memoryview else memoryview(b)
                if writeable and mv.readonly:
                    if arrived is not None and not arrived(offset + 2 + i):
                        raise NotArrived(offset + 2 + i)  # a copy of bytes still on their way
                    mv = memoryview(bytearray(mv))
                elif not writeable and not mv.readonly:
                    mv = mv.toreadonly()
                buffers.append(mv)
            return _unpickle(frames[offset + 1], buffers)
        return msgpack_decode_default(obj)

    return msgpack.loads(frames[0], object_hook=hook, use_list=False, **msgpack_opts)


# --------------------------------------------------------------------------------------------
# Records

ACK = b"A"
BYE = b"B"
ABORT = b"X"
NUDGE = b"N"
MSG = b"F"
VIA_SOCKET = 0
VIA_MPI = 1
VIA_MPI_SHARD = 2
FAST = 1 << 31
JOINED = 1 << 30
JOIN_MAX = 256 << 10  # socket frames smaller than this are joined to the header and to each other ...
JOIN_RUN = 1 << 20  # ... into sends of at most about this many bytes; larger frames are sent as they are
_COUNT = struct.Struct("<I")
_sizes_structs: dict[int, struct.Struct] = {}


_ONE_BYTE = {ACK: ACK, BYE: BYE, ABORT: ABORT, NUDGE: NUDGE}


class WireError(ValueError):
    """The peer broke the wire format, or announced more than this process accepts."""


def socket_writes(header: bytes, frames) -> list:
    """What a message puts on the socket, in order: the header and its small socket ``frames``
    joined into few sends (each send is a system call, and a GIL release that a busy compute thread
    answers by keeping the GIL for up to its switch interval), frames of ``JOIN_MAX`` bytes or more as
    they are (no copy).  ``frames`` are byte memoryviews, none empty."""
    if sum(v.nbytes for v in frames) < JOIN_MAX:  # the common case: one send
        return [b"".join([header, *frames])]
    out: list = []
    run: list = [header]
    size = len(header)

    def flush():
        if run:
            out.append(b"".join(run) if len(run) > 1 else run[0])

    for v in frames:
        if v.nbytes >= JOIN_MAX:
            flush()
            out.append(v)
            run, size = [], 0
            continue
        if size + v.nbytes > JOIN_RUN:
            flush()
            run, size = [], 0
        run.append(v)
        size += v.nbytes
    flush()
    return out


COALESCE_MAX = 4 << 20  # VIA_MPI frames this large always go alone ...
ALONE_SHARE = 8  # ... and so do those of at least 1/ALONE_SHARE of their record's VIA_MPI bytes


def mpi_runs(sizes, max_chunk: int, joined: bool = True) -> list[tuple[int, int]]:
    """The MPI messages of a record's MPI frames (``VIA_MPI`` and ``VIA_MPI_SHARD``: their ``sizes``, in order): ranges
    ``(first, end)`` of frame indices whose bytes go together (a one-frame range larger than
    ``max_chunk`` is then cut into pieces of ``max_chunk``).  Writer and reader both call it, with
    the record's ``JOINED`` bit: without it, every frame goes alone.

    A frame goes alone when it has ``COALESCE_MAX`` bytes or more, or an ``ALONE_SHARE``-th of the
    record's bytes or more (so at most ``ALONE_SHARE`` frames below ``COALESCE_MAX`` go alone, and
    a record has at most about twice that many messages of them); smaller frames are joined,
    which the writer pays with a copy.  Measured (mpi:// round trips of one message of N frames
    each way, 20 ms apart as a worker's transfers are, medians, 2026-11-29): 8 frames of
    96 KiB-1 MiB 10-40% faster alone than joined (8 x 512 KiB 4.8 against 6.1-7.5 ms, 8 x 1 MiB 7.6-8.1
    against 10.0-10.5 ms), 16 x 128 KiB 4.2 against 4.6-5.0 ms, 24 the same within noise, 40 x 128 KiB
    twice as slow (16-17 against 8-9 ms: more sends than MPICH's shared-memory queue takes at once);
    a dataframe partition of a 4 MB and a 2 MB block: its writer's ``send`` 1.45 -> 0.23 ms."""
    if not joined:
        return [(i, i + 1) for i in range(len(sizes))]
    runs: list[tuple[int, int]] = []
    alone = min(COALESCE_MAX, -(-sum(sizes) // ALONE_SHARE))
    start, total = -1, 0
    for i, n in enumerate(sizes):
        if n >= alone:
            if start >= 0:
                runs.append((start, i))
                start = -1
            runs.append((i, i + 1))
            continue
        if start >= 0 and total + n > max_chunk:
            runs.append((start, i))
            start = -1
        if start < 0:
            start, total = i, 0
        total += n
    if start >= 0:
        runs.append((start, len(sizes)))
    return runs


BULK_FRAME = 64 << 10  # the smallest frame that may go over MPI: in a message whose frames this large ...
BULK_BYTES = 1 << 20  # ... carry this many bytes or more, every one of them does


def frame_routes(frames, views, mpi: bool, min_mpi: int) -> list[int]:
    """Each frame's ``via``: ``VIA_MPI`` for a frame of ``min_mpi`` bytes or more when the connection has
    MPI (``mpi``) -- or of ``BULK_FRAME`` bytes or more when such frames of the message carry ``BULK_BYTES``
    or more --, ``VIA_MPI_SHARD`` for the frames that follow such a frame and come from the same buffer
    (distributed's shards of one large buffer: slices of one memoryview, as distributed's tcp:// tells
    them apart), whatever their size, else ``VIA_SOCKET``.  ``views`` are the ``frames`` as byte
    memoryviews.

    The bulk rule: a lone frame under ``min_mpi`` is faster on the socket (one send, one read, no
    second wake-up), but a message of many such frames (a worker's dataframe pieces of ~250 KB, several
    keys per transfer) put megabytes on the socket, which the writer's event loop must flush turn by turn
    while its task thread competes for the GIL; over MPI the reader copies them alone.  Measured
    (2026-11-30, `bench merge --workers 2 --shuffle tasks`, mpi://): half of a 4 MB transfer's bytes
    rode the socket; with this rule the transfers ran at 0.566 against 0.488 GB/s (medians of five runs,
    the code before and after taking turns; docs/benchmark-log.md, "Dataframe pieces in bulk")."""
    if not mpi:
        return [VIA_SOCKET] * len(views)
    if min_mpi > BULK_FRAME and sum(v.nbytes for v in views if v.nbytes >= BULK_FRAME) >= BULK_BYTES:
        min_mpi = BULK_FRAME
    if all(v.nbytes < min_mpi for v in views):
        return [VIA_SOCKET] * len(views)
    via, before = [], None  # the buffer of the frame before, when it went over MPI
    for f, v in zip(frames, views):
        source = f.obj if type(f) is memoryview else None
        if before is not None and source is before:
            via.append(VIA_MPI_SHARD)
        elif v.nbytes >= min_mpi:
            via.append(VIA_MPI)
            before = source
        else:
            via.append(VIA_SOCKET)
            before = None
    return via


def _shards_follow_mpi(via: bytes) -> bool:
    """Every ``VIA_MPI_SHARD`` frame follows an MPI frame."""
    return all(i and via[i - 1] != VIA_SOCKET for i, v in enumerate(via) if v == VIA_MPI_SHARD)


def pack_message(fast: bool, views, via, joined: bool = False) -> bytes:
    """The header of a message record (its socket frames follow it)."""
    n = len(views)
    count = n | (FAST if fast else 0) | (JOINED if joined else 0)
    return b"".join([MSG, _COUNT.pack(count), _sizes(n).pack(*(v.nbytes for v in views)), bytes(via)])


def _sizes(n: int) -> struct.Struct:
    s = _sizes_structs.get(n)
    if s is None:
        s = struct.Struct(f"<{n}Q")
        if len(_sizes_structs) < 256:
            _sizes_structs[n] = s
    return s


def parse_record(buf: bytearray, max_frames: int, max_bytes: int):
    """Take one whole record off the front of ``buf``: :data:`ACK`, :data:`BYE`, :data:`ABORT`, :data:`NUDGE`, a
    message header ``(fast, joined, sizes, via)`` (its socket frames then follow in ``buf``), or ``None`` when the
    record is not complete yet.  Raises :class:`WireError` on garbage, and on a message of more than
    ``max_frames`` frames or ``max_bytes`` bytes before anything is allocated for it."""
    kind = bytes(buf[:1])
    if kind in _ONE_BYTE:
        del buf[:1]
        return _ONE_BYTE[kind]
    if kind != MSG:
        raise WireError(f"the peer sent a record of unknown kind {kind!r}")
    if len(buf) < 1 + _COUNT.size:
        return None
    (count,) = _COUNT.unpack_from(buf, 1)
    fast, joined, n = bool(count & FAST), bool(count & JOINED), count & ~(FAST | JOINED)
    if not n:  # (every message of distributed's, and of dumps(), has a first frame: its header)
        raise WireError("the peer sent a message record of no frames")
    if n > max_frames:
        raise _too_much(n, 0, max_frames, max_bytes)
    end = 1 + _COUNT.size + 9 * n
    if len(buf) < end:
        return None
    sizes = _sizes(n).unpack_from(buf, 1 + _COUNT.size)
    total = sum(sizes)
    if total > max_bytes:
        raise _too_much(n, total, max_frames, max_bytes)
    via = bytes(buf[end - n : end])
    if via.translate(None, b"\x00\x01\x02") or (VIA_MPI_SHARD in via and not _shards_follow_mpi(via)):
        raise WireError("the peer sent a message record with a bad frame route")
    if VIA_MPI in via and any(v == VIA_MPI and size < BULK_FRAME for v, size in zip(via, sizes)):
        # (each gets a receive buffer of its own: a million frames of one byte would cost gigabytes)
        raise WireError(f"the peer sent a frame of fewer than {BULK_FRAME} bytes over MPI")
    del buf[:end]
    return fast, joined, sizes, via


def _too_much(n: int, total: int, max_frames: int, max_bytes: int) -> WireError:
    return WireError(
        f"the peer announced a message of {n} frames and {total} bytes, more than this process accepts "
        f"({max_frames} frames, {max_bytes} bytes: the machine's memory)"
    )
