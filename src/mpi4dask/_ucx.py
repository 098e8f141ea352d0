"""A peer that dies while UCX copies from it fails that connection, not this process (private).

What happens without this module
--------------------------------
The MPICH wheel (ch4:ucx, UCX 1.20) moves a large message between two processes of one node with one
copy (CMA): the receiver reads it straight out of the sender's memory with ``process_vm_readv``.  When
the sender is killed during that copy, the call fails with ``ESRCH``.  MPICH creates its UCX endpoints
without peer error handling (``UCP_ERR_HANDLING_MODE_NONE``), so UCX deems the failure unhandled, logs
it at level FATAL and calls ``abort()``: the *receiver* dies too.  Measured (a LocalCluster worker
reading a 256 MiB result from a worker SIGKILLed 10-50 ms into the move): the reader died of SIGABRT in
13 runs of 13 (``[vm:...] cma_ep.c:85 process_vm_readv(pid=...) returned -1: No such process``), and
Dask restarted both.  tcp:// loses only the dead worker.  MPICH's own fault tolerance
(``MPIR_CVAR_ENABLE_FT=1``) is no way out: ch4 asserts in ``MPI_Test`` once a peer dies.

What this module does
---------------------
:func:`install` pushes a UCX log handler (``ucs_log_push_handler``, through ctypes; only where UCX is
loaded) that stops exactly that message, at level FATAL from ``cma_ep.c``, so UCX returns the error
from the copy instead of aborting.  MPI then completes the receive *as if it had succeeded*, with only
the bytes copied so far (measured: a sum of 2**25 ones came back as 1114112.0).  So the handler also
marks every local peer process that is dead by then (:data:`failed`), and :meth:`mpi4dask._datapath.
_Link.done` turns a completion on a link to such a peer into :class:`PeerDiedMidCopy`: the connection
fails as it does over tcp://, and no message is delivered from the partial copy.

UCX has then marked its endpoint to that peer failed, and MPICH's ``MPI_Isend`` on a failed endpoint
crashes the sender (MPICH 5.0.2 writes to the request it did not create: a segfault inside libmpi, seen
once in CI in a worker that replied to the dead worker's last request on another connection, whose
close it had not seen yet; reproduced by tests/jobs/write_to_peer_dead_mid_copy.py).  So
:meth:`mpi4dask._datapath._Link.isend` raises :class:`PeerDiedMidCopy` instead of sending to a peer in
:data:`failed`, on every connection to it.

The handler lets UCX abort as before when it cannot tell whose copy failed (no local peer of an
``mpi://`` link is dead) or while ``run_mpi`` code runs in this process (its receives are the user's,
which mpi4dask cannot fail); and it is popped at interpreter exit, before MPI finalises.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading

logger = logging.getLogger(__name__)

_LEVEL_FATAL = 0  # ucs_log_level_t
_RC_STOP, _RC_CONTINUE = 0, 1  # ucs_log_func_rc_t
# ucs_log_func_t (UCX >= 1.11): file, line, function, level, component config, format, va_list
_HANDLER_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_char_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)

local_peers: set[int] = set()  # pids of this node's processes at the other end of an mpi:// link (see watch)
failed: set[int] = set()  # those that died while UCX copied from them: their links fail (see _Link.done)

_prune_at = 256  # local_peers' size at which watch() next drops the peers that ended
_lock = threading.Lock()
_installed = None  # (the pushed handler, kept alive; UCX's pop), or None


class PeerDiedMidCopy(ConnectionError):
    """The peer process died while MPI copied a message from it: what arrived is incomplete."""


def watch(pid: int) -> None:
    """A new ``mpi://`` link to process ``pid`` of this node (0: another node, nothing to watch)."""
    if pid and pid != os.getpid():
        global _prune_at
        if len(local_peers) >= _prune_at:  # a long-lived process meets many peers: forget those that ended
            local_peers.difference_update([p for p in list(local_peers) if _dead(p)])
            _prune_at = max(256, 2 * len(local_peers))  # the next scan after as many new peers again
        local_peers.add(pid)
        if pid in failed and not _dead(pid):  # a new process reuses a dead peer's pid: its links are sound
            failed.discard(pid)


def _dead(pid: int) -> bool:
    """The process is gone, a zombie, or exiting without its memory (a copy from it fails with ESRCH:
    ``process_vm_readv`` finds no memory on the process's main thread, which /proc shows as a size of 0)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # fields 3 (state) and 23 (vsize) of proc(5)
    return len(fields) > 20 and (fields[0] in (b"Z", b"X") or fields[20] == b"0")


def _on_log(file, line, function, level, comp, fmt, ap) -> int:
    """The UCX log handler: called for every message UCX logs, on the thread that made the MPI call.
    It must not raise: ctypes would return 0 for it, which UCX reads as "stop", for any message."""
    if level != _LEVEL_FATAL or not file or not file.endswith(b"cma_ep.c"):
        return _RC_CONTINUE
    try:
        return _copy_failed()
    except BaseException:  # noqa: BLE001 - UCX aborts, as it would have without this handler
        return _RC_CONTINUE


def _copy_failed() -> int:
    """A copy out of a peer's memory failed: stop UCX's abort when the peer is a dead local peer."""
    from . import _mpi

    if _mpi.running_user_code():
        return _RC_CONTINUE
    dead = {pid for pid in list(local_peers) if _dead(pid)}
    if not dead:
        return _RC_CONTINUE
    failed.update(dead)
    local_peers.difference_update(dead)
    logger.warning("mpi4dask: peer process %s died while MPI copied a message from it; its connections fail "
                   "(UCX would have aborted this process)", ", ".join(map(str, sorted(dead))))
    return _RC_STOP


def _libucs():
    """UCX's libucs as loaded by the MPI library, or None when this MPI does not use UCX."""
    try:
        return ctypes.CDLL("libucs.so.0", mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):
        return None


def install() -> bool:
    """Push the handler once, after ``MPI_Init``; True when it is in place."""
    global _installed
    with _lock:
        if _installed is not None:
            return True
        lib = _libucs()
        push = getattr(lib, "ucs_log_push_handler", None) if lib is not None else None
        pop = getattr(lib, "ucs_log_pop_handler", None) if lib is not None else None
        if push is None or pop is None:
            return False
        handler = _HANDLER_TYPE(_on_log)
        push.argtypes, push.restype = [_HANDLER_TYPE], None
        pop.argtypes, pop.restype = [], None
        push(handler)
        _installed = (handler, pop)
        atexit.register(uninstall)  # Python callbacks must not run while MPI finalises after the interpreter
        return True


def uninstall() -> None:
    """Pop the handler if it is in place (at exit; once: a second pop would take UCX's own)."""
    global _installed
    with _lock:
        if _installed is not None:
            _installed[1]()
            _installed = None
