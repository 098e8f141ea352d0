"""The fast (de)serialization path of mpi:// (mpi4dask._wire) against distributed's own protocol."""

import hashlib
import pickle

import numpy as np
import pytest
from distributed.core import Status
from distributed.protocol import Serialized, ToPickle, deserialize, dumps, loads, to_serialize

from mpi4dask import _wire


def _copyframes(frames):
    # what a receiver has: fresh writeable buffers, not the sender's objects
    return [memoryview(bytearray(f)) for f in frames]


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).reshape(-1)).hexdigest()


def _same(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert _digest(a) == _digest(b)
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
        return
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    assert a == b and type(a) is type(b)


ARRAYS = [
    np.zeros(1, np.uint8),
    np.arange(10_000, dtype="f8").reshape(100, 100),
    np.asfortranarray(np.arange(600, dtype="i4").reshape(20, 30)),
    np.array([], dtype="c16"),
    np.arange(24, dtype=">i8").reshape(2, 3, 4),
    np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")]),
    np.array(3.5),
]


@pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_fast_path_matches_distributed(arr):
    msg = {"op": "x", "data": {"k": to_serialize(arr)}, "t": (1, [2, 3]), "s": {1, 2}, "e": Status.running,
           "b": b"\0\1"}
    frames = _wire.dumps(msg)
    assert frames is not None
    expected = loads(dumps(msg))
    got = _wire.loads(_copyframes(frames))
    _same(expected, got)
    # any distributed reader decodes the same frames
    _same(expected, loads(_copyframes(frames)))


@pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_arrays_of_one_dtype_shape_and_order_share_a_pickle_and_keep_their_own_bytes(arr):
    """The second array of a dtype, shape and order reuses the first one's pickle (its bytes go out of
    band): each decodes to its own bytes, in its own order; structured dtypes are pickled every time."""
    changed = arr.copy(order="K")
    if not arr.dtype.fields:
        changed += 1
    for x in (arr, arr.copy(order="K"), changed):
        assert (x.flags.c_contiguous, x.flags.f_contiguous) == (arr.flags.c_contiguous, arr.flags.f_contiguous)
        frames = _copyframes(_wire.dumps({"x": to_serialize(x)}))
        got = _wire.loads(frames)["x"]
        assert type(got) is np.ndarray and got.dtype == x.dtype and got.shape == x.shape
        assert (got.flags.c_contiguous, got.flags.f_contiguous) == (x.flags.c_contiguous, x.flags.f_contiguous)
        assert got.flags.writeable and _digest(got) == _digest(x)
        if x.nbytes:
            assert np.shares_memory(got, np.frombuffer(frames[-1], np.uint8)), "built on the received frame"
        # as numpy's own unpickling builds it from the same pickle and buffer
        expected = pickle.loads(frames[2], buffers=[frames[3]])
        assert (got.dtype, got.shape, got.strides) == (expected.dtype, expected.shape, expected.strides)
    cached = (arr.dtype, arr.shape, arr.flags.c_contiguous, True) in _wire._array_pickles
    assert cached == (arr.dtype.fields is None), _wire._array_pickles.keys()
    # the reader decodes a pickle it has seen without pickle (what it skips is what it knows)
    layout = _wire._array_layouts.get(bytes(frames[2]))
    assert (layout is not None) == (arr.dtype.fields is None), "structured dtypes are unpickled every time"
    if layout is not None:
        assert layout[:2] == (arr.dtype, arr.shape)


@pytest.mark.parametrize("first", ["writeable", "read-only"])
def test_fast_path_keeps_the_writeable_flag(first):
    """Whichever of a writeable and a read-only array of one dtype and shape is sent first (a read-only
    buffer is marked in the pickle itself, so the two must not share one), and also when the reader knows
    the array's pickle and builds the array itself (the later messages)."""
    n = {"writeable": 101, "read-only": 102}[first]  # shapes of their own: no earlier test made these pickles
    a = np.arange(n, dtype="u2")
    ro = a.copy()
    ro.flags.writeable = False
    arrays = {"w": a, "r": ro} if first == "writeable" else {"r": ro, "w": a}
    for _ in range(3):
        for name, x in arrays.items():
            got = _wire.loads(_copyframes(_wire.dumps({name: to_serialize(x)})))[name]
            assert got.flags.writeable == (name == "w"), (name, first)
            assert _digest(got) == _digest(a)
        both = _wire.loads(_copyframes(_wire.dumps({k: to_serialize(x) for k, x in arrays.items()})))
        assert both["w"].flags.writeable and not both["r"].flags.writeable
        # as distributed's own reader decodes the same frames
        std = loads(_copyframes(_wire.dumps({k: to_serialize(x) for k, x in arrays.items()})))
        assert std["w"].flags.writeable and not std["r"].flags.writeable


def test_decoding_caches_stay_bounded():
    """Many one-off shapes (ragged chunks) neither grow the pickle caches past their bound nor stop
    the later arrays from decoding right."""
    for n in range(1, 2 * _wire.ARRAY_PICKLES_MAX + 50):
        x = np.full(n, n % 251, dtype="u1")
        got = _wire.loads(_copyframes(_wire.dumps({"x": to_serialize(x)})))["x"]
        assert got.shape == (n,) and _digest(got) == _digest(x)
        assert len(_wire._array_pickles) <= _wire.ARRAY_PICKLES_MAX
        assert len(_wire._array_layouts) <= _wire.ARRAY_PICKLES_MAX
    assert _wire._array_layouts, "the newest shapes are cached again"


def test_fast_path_is_zero_copy():
    a = np.arange(1 << 20, dtype="u1")
    frames = _wire.dumps({"x": to_serialize(a)})
    assert any(isinstance(f, memoryview) and f.obj is a for f in frames[1:]), "the array's memory itself is sent"
    received = _copyframes(frames)
    got = _wire.loads(received)["x"]
    assert np.shares_memory(got, np.frombuffer(received[-1], dtype="u1")), "the array is built on the received frame"


def test_scheduler_side_reader_gets_serialized_objects():
    a = np.arange(50, dtype="f4")
    got = loads(_copyframes(_wire.dumps({"x": to_serialize(a)})), deserialize=False)
    assert isinstance(got["x"], Serialized)
    _same(a, deserialize(got["x"].header, got["x"].frames))


def test_reader_without_pickle_refuses_like_distributed():
    frames = _wire.dumps({"x": to_serialize(np.arange(3))})
    with pytest.raises(TypeError, match="pickle"):
        _wire.loads(_copyframes(frames), deserializers=["msgpack"])


@pytest.mark.parametrize(
    "msg",
    [
        {"x": to_serialize(np.arange(20)[::2])},  # not contiguous
        {"x": to_serialize(np.array([object(), 1], dtype=object))},
        {"x": to_serialize([1, 2, 3])},
        {"x": ToPickle(lambda: 1)},
        {"x": Serialized({"serializer": "pickle", "writeable": ()}, [b""])},
        {"x": object()},
        {"x": to_serialize(np.ma.masked_array([1, 2], [0, 1]))},
        {"x": np.arange(3)},  # not wrapped: distributed pickles it
    ],
    ids=["strided", "object-dtype", "list", "to-pickle", "serialized", "unknown-type", "subclass", "bare-array"],
)
def test_other_messages_take_distributed_path(msg):
    assert _wire.dumps(msg) is None


def test_plain_messages():
    msg = {"op": "heartbeat", "now": 1.5, "metrics": {"a": [1, 2], "b": None, "c": True}, "big": 2**63 - 1}
    got = _wire.loads(_copyframes(_wire.dumps(msg)))
    assert got == loads(dumps(msg))
    assert _wire.dumps({"too-big": 2**70}) is None


def _plain_frames():
    import pandas as pd

    n = 1000
    rng = np.random.default_rng(7)
    return {
        "two-blocks": pd.DataFrame({"key": rng.integers(0, n, n), "i": np.arange(n), "v": rng.random(n)}),
        "bool-u2-f4-c16": pd.DataFrame({"b": rng.random(n) > 0.5, "u": np.arange(n, dtype="u2"),
                                        "f": rng.random(n).astype("f4"), "c": rng.random(n) * 1j}),
        "int-index": pd.DataFrame({"v": rng.random(n)}, index=pd.Index(rng.permutation(n) * 3)),
        "series": pd.Series(rng.random(n), name="s"),
        "empty": pd.DataFrame({"a": np.array([], "i8")}),
        # a row slice of one-column blocks: each block's rows are still contiguous
        "row-slice-of-one-column-blocks": pd.DataFrame({"i": np.arange(n), "v": rng.random(n)}).iloc[10:900],
    }


def _not_plain_frames():
    import pandas as pd

    n = 100
    return {
        "object-column": pd.DataFrame({"o": [object()] * n}),
        "string-column": pd.DataFrame({"s": [f"x{i}" for i in range(n)]}),
        "categorical": pd.DataFrame({"c": pd.Categorical(["a", "b"] * (n // 2))}),
        "nullable-int": pd.DataFrame({"i": pd.array(range(n), dtype="Int64")}),
        "tz-datetime": pd.DataFrame({"t": pd.date_range("2026-01-01", periods=n, tz="UTC")}),
        "datetime-column": pd.DataFrame({"t": pd.date_range("2026-01-01", periods=n).to_numpy()}),  # pickled in band
        "timedelta-column": pd.DataFrame({"t": np.arange(n).astype("m8[s]")}),
        "multi-index": pd.DataFrame({"v": np.arange(4)}, index=pd.MultiIndex.from_product([[1, 2], [3, 4]])),
        "datetime-index": pd.DataFrame({"v": np.arange(n)}, index=pd.date_range("2026-01-01", periods=n)),
        "series-of-strings": pd.Series([f"x{i}" for i in range(n)]),
        # a row slice of a two-column block (df.iloc, from_pandas partitions): numpy pickles it in band
        "row-slice-of-a-two-column-block": pd.DataFrame({"a": np.arange(n), "b": np.arange(n)}).iloc[10:90],
        "strided-series": pd.Series(np.arange(n, dtype="f8")).iloc[::2],
    }


@pytest.mark.parametrize("name", list(_plain_frames()))
def test_plain_pandas_objects_take_the_fast_path_uncopied_and_decode_as_distributed_does(name):
    """A DataFrame or Series of plain NumPy columns is pickled here as distributed's "pickle" family
    would (no ``sizeof`` of the message first, ~0.9 ms of a cold worker's loop for a 6 MB partition):
    both readers decode the same frames to an equal object, and its column bytes are sent uncopied."""
    import pandas as pd

    x = _plain_frames()[name]
    msg = {"status": "OK", "data": {"k": to_serialize(x)}}
    frames = _wire.dumps(msg)
    assert frames is not None
    big = [np.frombuffer(f, np.uint8) for f in frames[3:] if f.nbytes >= 1000]
    columns = [x] if isinstance(x, pd.Series) else [x[c] for c in x.columns]
    for col in columns:  # every column's bytes are in a frame that is the column's own memory
        assert col.nbytes < 1000 or any(np.shares_memory(f, col.to_numpy()) for f in big), col.name
    if name == "two-blocks":  # the two blocks (int64 key and id, float64 value) as they are in the frame
        assert sorted(f.nbytes for f in big) == [8000, 16000]
    assert_equal = pd.testing.assert_series_equal if isinstance(x, pd.Series) else pd.testing.assert_frame_equal
    for reader in (_wire.loads, loads):
        got = reader(_copyframes(frames))
        assert got["status"] == "OK"
        assert_equal(got["data"]["k"], x)
    expected = loads(dumps(msg))["data"]["k"]
    assert_equal(_wire.loads(_copyframes(frames))["data"]["k"], expected)


@pytest.mark.parametrize("name", list(_not_plain_frames()))
def test_other_pandas_objects_take_distributed_path(name):
    """Objects, strings, extension arrays, datetimes (pandas pickles their bytes in band), other index
    types, blocks that are not contiguous (row slices): their pickle may grow with their rows
    (distributed then pickles a large message in a thread), so they stay with distributed's dumps."""
    assert _wire.dumps({"data": {"k": to_serialize(_not_plain_frames()[name])}}) is None


def test_a_dataframe_whose_attrs_pickle_cannot_take_is_left_to_distributed():
    import pandas as pd

    df = pd.DataFrame({"a": np.arange(10)})
    df.attrs["f"] = lambda: 1  # a local object: plain pickle refuses it, distributed's cloudpickle takes it
    assert _wire.dumps({"k": to_serialize(df)}) is None
    got = loads(dumps({"k": to_serialize(df)}))["k"]
    pd.testing.assert_frame_equal(got, df)


def test_a_pandas_object_whose_buffers_are_still_on_their_way_is_not_decoded_early():
    """A reader decodes a message before its MPI frames are in only where the objects merely point
    into them (arrays): unpickling a DataFrame may read its buffers, so it waits for them."""
    import pandas as pd

    df = _plain_frames()["two-blocks"]
    frames = _copyframes(_wire.dumps({"k": to_serialize(df), "a": to_serialize(np.arange(5000.0))}))
    late = {i for i, f in enumerate(frames) if f.nbytes >= 8000}
    assert late
    with pytest.raises(_wire.NotArrived):
        _wire.loads(frames, arrived=lambda i: i not in late)
    got = _wire.loads(frames, arrived=lambda i: True)
    pd.testing.assert_frame_equal(got["k"], df)
    # an array alone is decoded early, pointing into its frame
    frames = _copyframes(_wire.dumps({"a": to_serialize(np.arange(5000.0))}))
    got = _wire.loads(frames, arrived=lambda i: i < 3)
    assert np.shares_memory(got["a"], np.frombuffer(frames[3], np.uint8))


def test_mpi_runs_join_small_frames_and_keep_large_ones_alone():
    from mpi4dask._wire import COALESCE_MAX, mpi_runs

    big = COALESCE_MAX
    assert mpi_runs([], 1 << 30) == []
    assert mpi_runs([10, 20, big, 30, 40], 1 << 30) == [(0, 2), (2, 3), (3, 5)]
    assert mpi_runs([big, big + 1], 1 << 30) == [(0, 1), (1, 2)]
    # a run never exceeds max_chunk bytes (a single large frame is cut by the caller)
    sizes = [100] * 10
    runs = mpi_runs(sizes, 250)
    assert runs == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert [i for a, b in runs for i in range(a, b)] == list(range(10))  # every frame once, in order


def test_mpi_runs_send_a_records_few_large_frames_uncopied_and_join_many():
    """The blocks of a dataframe partition (a 4 MB and a 2 MB one) each go alone: joining them cost
    the writer a copy of 6 MB (1.2 ms) per transfer.  Many frames are still joined (MPICH's
    shared-memory queue takes a few dozen sends at once); a frame of an eighth of the record or more
    goes alone, so a record has at most ALONE_SHARE such messages."""
    from mpi4dask._wire import ALONE_SHARE, COALESCE_MAX, mpi_runs

    assert mpi_runs([4_000_000, 2_000_000], 1 << 30) == [(0, 1), (1, 2)]
    assert mpi_runs([96 << 10] * 8, 1 << 30) == [(i, i + 1) for i in range(8)]
    assert mpi_runs([128 << 10] * 40, 1 << 30) == [(0, 40)]  # 40 sends would overflow MPICH's queue
    # two blocks and a small frame between them: the small one is a run of its own, copied by no one
    assert mpi_runs([3 << 20, 70_000, 3 << 20], 1 << 30) == [(0, 1), (1, 2), (2, 3)]
    # just below an eighth of the record: joined with its neighbours
    below = [100_000] * 8 + [110_000]
    assert sum(below) // ALONE_SHARE > 110_000 and mpi_runs(below, 1 << 30) == [(0, 9)]
    # however many, frames of COALESCE_MAX bytes or more always go alone (distributed's shards)
    assert mpi_runs([COALESCE_MAX] * 20, 1 << 30) == [(i, i + 1) for i in range(20)]
    for sizes in ([4_000_000, 2_000_000], [128 << 10] * 40, [10, 3 << 20, 20, 30, 1 << 20], [70_000] * 17):
        runs = mpi_runs(sizes, 1 << 30)
        assert [i for a, b in runs for i in range(a, b)] == list(range(len(sizes)))
        assert sum(1 for a, b in runs if b == a + 1 and sizes[a] < COALESCE_MAX) <= 2 * ALONE_SHARE + 1


@pytest.mark.parametrize("sizes", [
    [],
    [1, 7, 3000],
    [300_000, 300_000],  # two large frames in a row
    [_wire.JOIN_MAX, 5],  # a large first frame
    [3000] * 20 + [(1 << 20) + 3, 70_000, 64],
    [100, 300_000, 100, 300_000],  # large, small, large
    [60_000] * 40,  # small frames split into sends of about JOIN_RUN
    [_wire.JOIN_MAX - 1, 1],
    [70_000, 70_000, 1],  # frames under JOIN_MAX, over 64 KiB: joined to the header
])
def test_socket_writes_keep_every_byte_in_order_and_send_large_frames_uncopied(sizes):
    rng = np.random.default_rng(len(sizes))
    frames = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    header = b"header"
    out = _wire.socket_writes(header, frames)
    assert b"".join(bytes(w) for w in out) == header + b"".join(bytes(f) for f in frames)
    assert all(len(w) for w in out)
    large = [f for f in frames if f.nbytes >= _wire.JOIN_MAX]
    assert [w for w in out if any(w is f for f in large)] == large  # the same objects, not copies
    small = sum(f.nbytes for f in frames if f.nbytes < _wire.JOIN_MAX)
    # the small frames and the header need no more sends than the large frames cut them into, plus
    # one per JOIN_RUN of their bytes
    assert len(out) - len(large) <= len(large) + 1 + small // _wire.JOIN_RUN


def test_routes_mark_the_shards_of_one_buffer_whatever_their_size():
    """A frame's route (_wire.frame_routes): large frames over MPI, each a buffer of its own at the reader; the
    shards that distributed cut from one buffer (slices of one memoryview) follow the first over MPI,
    the short last one too, so the reader lays them out in one buffer; two arrays never count as one."""
    from distributed.protocol.utils import frame_split_size

    big = np.arange((3 << 20) + 3, dtype=np.uint8)
    other = np.zeros(1 << 20, np.uint8)
    shards = frame_split_size(memoryview(big), n=1 << 20)
    assert [len(s) for s in shards] == [1 << 20] * 3 + [3]
    # (two slices of one memoryview count as shards of one buffer, as distributed's tcp:// counts them)
    frames = [b"header", *shards, memoryview(other), memoryview(other)[:10], b"tail"]
    views = [memoryview(f).cast("B") for f in frames]
    S, M, D = _wire.VIA_SOCKET, _wire.VIA_MPI, _wire.VIA_MPI_SHARD
    assert _wire.frame_routes(frames, views, True, 256 << 10) == [S, M, D, D, D, M, D, S]
    assert _wire.frame_routes(frames, views, False, 256 << 10) == [S] * 8  # no MPI on this connection
    small = [b"a", memoryview(other)[:100], memoryview(other)[100:200]]  # no frame large enough: no shards
    assert _wire.frame_routes(small, [memoryview(f) for f in small], True, 256 << 10) == [S] * 3


def test_a_message_of_many_mid_sized_frames_sends_them_all_over_mpi():
    """Frames under ``MPI_MIN_FRAME`` ride the socket, but not when a message's frames of ``BULK_FRAME`` or more
    carry ``BULK_BYTES`` or more (a worker's dataframe pieces, several keys at once): then they all go over
    MPI, and only the smaller ones ride the socket.  A lone mid-sized frame, or a few, stay on the socket."""
    S, M = _wire.VIA_SOCKET, _wire.VIA_MPI
    mid = [np.full(200_000, i, np.uint8) for i in range(6)]  # 1.2 MB in frames under 256 KiB
    frames = [b"header", *map(memoryview, mid), memoryview(bytes(_wire.BULK_FRAME - 1))]
    views = [memoryview(f).cast("B") for f in frames]
    assert _wire.frame_routes(frames, views, True, 256 << 10) == [S, *[M] * 6, S]
    assert _wire.frame_routes(frames, views, False, 256 << 10) == [S] * 8  # no MPI on this connection
    few = views[:6]  # 1,000,000 bytes: under BULK_BYTES
    assert sum(v.nbytes for v in few[1:]) < _wire.BULK_BYTES
    assert _wire.frame_routes(frames[:6], few, True, 256 << 10) == [S] * 6
    # frames under BULK_FRAME never count, however many
    tiny = [memoryview(bytes(_wire.BULK_FRAME - 1))] * 40
    assert _wire.frame_routes(tiny, tiny, True, 256 << 10) == [S] * 40


_BIG = _wire.JOIN_MAX
_MIN = _wire.BULK_FRAME


@pytest.mark.parametrize("via, sizes, error", [
    (b"\x00\x01\x02\x02", (1, _BIG, 2, 3), None),
    (b"\x01\x02\x00\x01", (_BIG, 2, 3, _BIG), None),
    (b"\x02\x01\x01\x01", (_BIG,) * 4, "bad frame route"),
    (b"\x01\x00\x02\x01", (_BIG,) * 4, "bad frame route"),
    (b"\x01\x03\x01\x01", (_BIG,) * 4, "bad frame route"),
    (b"\x00\x00\x01\x01", (1, 2, _MIN, _BIG), None),  # a bulk message's mid-sized frame
    (b"\x00\x00\x01\x01", (1, 2, _MIN - 1, _BIG), f"fewer than {_MIN} bytes over MPI"),
])
def test_a_shard_route_must_follow_a_frame_over_mpi(via, sizes, error):
    """A peer's record whose shard (``VIA_MPI_SHARD``) follows nothing, or a frame on the socket, or whose
    route is unknown, or that sends a small frame over MPI (each gets a buffer of its own: a million of one
    byte would cost gigabytes), is refused before anything is allocated for it; shards may be small."""
    buf = bytearray(_wire.pack_message(False, [memoryview(bytes(n)) for n in sizes], via))
    if error is None:
        assert _wire.parse_record(buf, 16, 1 << 20) == (False, False, sizes, via)
    else:
        with pytest.raises(_wire.WireError, match=error):
            _wire.parse_record(buf, 16, 1 << 20)
