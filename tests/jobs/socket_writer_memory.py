"""A connection that carries every frame on the socket (two processes of no common MPI world: an outside
client, a Nanny's worker talking to its scheduler) writes a large array to a reader whose handler waits
before its read() (tests/test_comm.py, test_socket_only_writes_hold_no_copy_of_large_frames_and_close_
delivers_them).

Usage: socket_writer_memory.py PROTOCOL            (the writer; starts the reader itself)
       socket_writer_memory.py PROTOCOL killed     (the same writer, which kills the reader mid-message)
       socket_writer_memory.py PROTOCOL serve FILE (the reader: writes its address to FILE)

The writer prints ``WRITER <growth MiB> <uses_mpi>``: how far its peak RSS rose above the array's while
the message went out (reset before the write, read once the reader confirmed the bytes), then writes a
second array and closes at once; the reader prints ``READER <sha256 ok> <sha256 ok>`` for both.
"""

import asyncio
import hashlib
import os
import subprocess
import sys
import time

import numpy as np
from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize

import mpi4dask  # noqa: F401 - registers mpi://

SIZE = 256 << 20
WAIT = 1.0  # seconds the reader's handler waits before its first read()


def data(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def peak_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


async def serve(protocol: str, path: str) -> None:
    done = asyncio.get_running_loop().create_future()

    async def handler(comm):
        try:
            await asyncio.sleep(WAIT)
            first = (await comm.read())["x"]
            ok1 = hashlib.sha256(first).digest() == hashlib.sha256(data(1, SIZE)).digest()
            del first
            await comm.write("got it")
            second = (await comm.read())["x"]
            ok2 = hashlib.sha256(second).digest() == hashlib.sha256(data(2, SIZE // 4)).digest()
            try:
                await comm.read()
            except CommClosedError:
                pass
            print("READER", ok1, ok2, flush=True)
            done.set_result(None)
        except BaseException as exc:  # fail at once, not at the deadline
            done.set_exception(exc)
            raise

    listener = listen(f"{protocol}://127.0.0.1:0", handler)
    await listener.start()
    with open(path + ".tmp", "w") as f:
        f.write(listener.contact_address)
    os.rename(path + ".tmp", path)
    await asyncio.wait_for(done, 120)
    listener.stop()


async def connect_to_reader(path: str):
    """Connect to the reader once it has written its address to ``path``."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError("the reader did not start")
        await asyncio.sleep(0.05)
    return await connect(open(path).read())


async def write(protocol: str, path: str) -> None:
    comm = await connect_to_reader(path)
    a, b = data(1, SIZE), data(2, SIZE // 4)
    reset_peak()
    before = peak_mib()
    await comm.write({"x": to_serialize(a)})
    assert await comm.read() == "got it"
    grew = peak_mib() - before
    await comm.write({"x": to_serialize(b)})
    await comm.close()  # at once, and the loop ends: what was written still arrives
    print("WRITER", round(grew, 1), getattr(comm, "uses_mpi", None), flush=True)


async def write_to_killed(protocol: str, path: str, reader: subprocess.Popen) -> None:
    """Kill the reader while the writer's 256 MiB message is still going out (the reader's handler waits
    before its first read(), so the socket is full): the writer's read and its next write must fail with
    CommClosedError, soon.  Prints ``KILLED <seconds until the read failed> <read's error> <write's error>``."""
    comm = await connect_to_reader(path)
    await comm.write({"x": to_serialize(data(1, SIZE))})
    await asyncio.sleep(0.3)
    reader.kill()
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(comm.read(), 30)
        read_error = "none"
    except CommClosedError:
        read_error = "CommClosedError"
    took = time.monotonic() - t0
    try:
        await comm.write({"x": to_serialize(data(2, SIZE // 4))})
        write_error = "none"
    except CommClosedError:
        write_error = "CommClosedError"
    await comm.close()
    print("KILLED", round(took, 2), read_error, write_error, flush=True)


if __name__ == "__main__":
    if sys.argv[2:3] == ["serve"]:
        asyncio.run(serve(sys.argv[1], sys.argv[3]))
    else:
        path = f"/tmp/mpi4dask-socket-writer-{os.getpid()}"
        reader = subprocess.Popen([sys.executable, __file__, sys.argv[1], "serve", path])
        try:
            if sys.argv[2:3] == ["killed"]:
                asyncio.run(write_to_killed(sys.argv[1], path, reader))
                sys.exit(0)
            asyncio.run(write(sys.argv[1], path))
            sys.exit(reader.wait(120))
        finally:
            if reader.poll() is None:
                reader.kill()
            if os.path.exists(path):
                os.unlink(path)
