"""Simulated hosts for tests: Linux network namespaces on one bridge, looking like separate machines.

A :class:`Network` of K hosts looks like this::

    root namespace (pytest)                               host namespaces
    ---------------------------------------------         ------------------------------------------------
    veth m4r<tok> 10.X.Y.254/24 == m4q<tok> --+           (netns m4d-<pid>-<tok>-0, hostname m4d-h0)
                                  bridge m4b<tok> --+-- m4v<tok>0 == eth0 10.X.Y.1/24
                                                    +-- m4v<tok>1 == eth0 10.X.Y.2/24  (netns ...-1, m4d-h1)
                                                    ...

* every host has ``lo`` up, one interface ``eth0`` with its own address and a default route via ``net.gateway``;
* the root namespace (where pytest runs) reaches every host at ``host.addr`` and hosts reach the root at
  ``net.gateway`` (10.X.Y.254), so a server started by the test in the root namespace must listen on
  ``net.gateway`` (or ``0.0.0.0``), not on ``127.0.0.1``. The gateway address is on a veth of the root plugged
  into the bridge, not on the bridge itself, because UCX's tcp transport skips bridge devices (it would need
  ``UCX_TCP_BRIDGE_ENABLE=y``; without it an MPI process in the root namespace crashes connecting to a host);
* ``10.X.Y.0/24`` is picked at random among subnets that clash with no address or route of the root namespace;
* ``hostnames=True`` (default): every command run on a host gets a UTS namespace of its own with hostname
  ``host.hostname`` (``m4d-h0``, ``m4d-h1``, ...), and sees an ``/etc/hosts`` (``/etc/netns/<ns>/hosts``,
  bind-mounted by ``ip netns exec``) resolving every host name to its address;
* ``machine_ids=True`` (default): every command run on a host sees a boot id of its own
  (``/proc/sys/kernel/random/boot_id``, bind-mounted in the command's private mount namespace) and an
  ``/etc/machine-id`` of its own. This is what makes UCX treat the hosts as different machines: UCX's "same
  machine" test is the boot id, not the hostname. With a shared boot id UCX picks its shared-memory transports
  (sysv/posix + cma) between hosts, and MPI Connect/Accept between two namespaces then spins forever, because the
  shared-memory transport wakes its peer through an abstract AF_UNIX socket, which is per network namespace
  (``sendto ... ECONNREFUSED``). With distinct boot ids UCX uses ``tcp/eth0`` with no environment settings.

Still shared with the root namespace (same kernel, no container): the file system (``/tmp`` included), the pid
space (so CMA / ``process_vm_readv`` works between hosts if a library chooses it), ``/dev/shm`` and System V IPC.

Typical use in a test::

    from netns import netns_network_fixture, requires_netns  # noqa: F401  (provides fixture "netns_network")

    @requires_netns
    def test_something(netns_network, tmp_path):
        net = netns_network(2)                       # two hosts, torn down after the test
        a, b = net.hosts
        srv = a.popen([sys.executable, "server.py", a.addr], stdout=open(tmp_path / "a.out", "w"))
        res = b.run([sys.executable, "client.py", a.addr], timeout=30)  # CompletedProcess (text)
        assert res.returncode == 0, res.stderr

Outside pytest, use the context manager ``with Network(2) as net: ...``.

Teardown (``Network.down``: fixture finalizer, context-manager exit, and an ``atexit`` hook as a last resort) SIGKILLs
every process group started through the helper and every process still in the namespaces (``ip netns pids``),
then deletes the namespaces, veths, bridge, ``/etc/netns/<ns>`` and ``/run/m4d/<ns>``. Leftovers of a process that
died without teardown (SIGKILL, ``os._exit`` from a hard timeout) carry its pid in their names (namespaces, dirs)
or interface alias (bridge, veths) and are swept by the next :class:`Network` brought up, once that pid is gone.

The module skips (``requires_netns``, or ``pytest.skip`` in :class:`Network`) only when the process is not root or
the ``ip`` command is missing (``NETNS_SKIP_REASON``); any other failure to set up is a test error.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

_SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
IP = shutil.which("ip", path=_SBIN)
UNSHARE = shutil.which("unshare", path=_SBIN)
MOUNT = shutil.which("mount", path=_SBIN)

#: Why network-namespace tests cannot run here, or None when they can (root and ``ip`` present).
NETNS_SKIP_REASON: str | None = (
    "network-namespace hosts need root (os.geteuid() != 0)"
    if os.geteuid() != 0
    else "network-namespace hosts need the iproute2 'ip' command, which is not installed"
    if IP is None
    else None
)

#: Marker for tests that need simulated hosts.
requires_netns = pytest.mark.skipif(NETNS_SKIP_REASON is not None, reason=NETNS_SKIP_REASON or "")

PREFIX = "m4d"  # namespaces "m4d-<pid>-<tok>-<i>"; links m4b<tok> (bridge), m4v<tok><i>, m4r<tok>, m4q<tok>
ETC_NETNS = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/<ns>/<file> over /etc/<file>
RUN_DIR = Path("/run/m4d")  # per-host boot_id files: /run/m4d/<ns>/boot_id
BOOT_ID = "/proc/sys/kernel/random/boot_id"
_LIVE: set[Network] = set()
_LIVE_LOCK = threading.Lock()


def _ip(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` (``input`` for ``-batch -``); raise RuntimeError with ip's message when it fails and check."""
    res = subprocess.run([IP, *args], input=input, capture_output=True, text=True, timeout=60)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}\n{input or ''}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _links() -> list[dict]:
    return json.loads(_ip("-j", "link", "show").stdout or "[]")


def _ns_pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()]


def _kill_ns_processes(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in namespace ``ns`` until none is left (processes may fork while we kill)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in netns {ns} survive SIGKILL")
        time.sleep(0.02)


def _delete_ns(ns: str) -> None:
    _kill_ns_processes(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    shutil.rmtree(RUN_DIR / ns, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Delete namespaces, links and /etc/netns dirs left by helper users whose process is gone; return their names."""
    removed = []
    for ns in _netns_names():
        parts = ns.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _delete_ns(ns)
            removed.append(ns)
    for link in _links():
        alias = link.get("ifalias", "")
        parts = alias.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _ip("link", "del", link["ifname"], check=False)
            removed.append(link["ifname"])
    for top in (ETC_NETNS, RUN_DIR):
        for d in top.glob(f"{PREFIX}-*") if top.is_dir() else ():
            parts = d.name.split("-")
            if len(parts) >= 3 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
    return removed


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for a in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
        for info in a.get("addr_info", []):
            nets.append(ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}").network)
    for r in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = r.get("dst")
        if dst and dst != "default":
            try:
                nets.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                pass
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    rng = random.SystemRandom()
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{rng.randint(100, 250)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet found")


class Host:
    """One simulated host: a network namespace with ``eth0`` at ``addr`` (and its own hostname if enabled)."""

    def __init__(
        self,
        network: Network,
        index: int,
        netns: str,
        addr: str,
        hostname: str | None,
        veth: str,
        boot_id_file: Path | None,
    ):
        self.network = network
        self.index = index
        self.netns = netns  #: namespace name (``ip netns exec <netns>``)
        self.addr = addr  #: IPv4 address of eth0, reachable from the root namespace and every other host
        self.hostname = hostname  #: hostname seen by commands on this host, or None (shares the root's)
        self.ifname = "eth0"  #: the host's network interface (inside its namespace)
        self.veth = veth  #: the outer end of its veth pair, in the root namespace, on the bridge
        #: file bind-mounted over /proc/sys/kernel/random/boot_id for commands on this host, or None (shared)
        self.boot_id_file = boot_id_file
        self._procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host({self.index}, netns={self.netns!r}, addr={self.addr!r}, hostname={self.hostname!r})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run on this host.

        ``ip netns exec <ns> [unshare --uts] sh -c '[set hostname &&] [mount --bind <id> <BOOT_ID> &&] exec "$@"'
        <hostname> argv...``. ``ip netns exec`` gives each command a private mount namespace (a slave of the root's),
        so the boot-id bind mount is seen by that command and its children only. Every step execs: the final
        process has the pid of the Popen.
        """
        argv = [os.fspath(a) for a in argv]
        if self.hostname is None and self.boot_id_file is None:
            return [IP, "netns", "exec", self.netns, *argv]
        steps = []
        if self.hostname is not None:
            steps.append('printf %s "$0" > /proc/sys/kernel/hostname')  # sethostname(), in the new UTS ns
        if self.boot_id_file is not None:
            steps.append(f"{MOUNT} --bind {self.boot_id_file} {BOOT_ID}")
        script = " && ".join([*steps, 'exec "$@"'])
        uts = [UNSHARE, "--uts", "--"] if self.hostname is not None else []
        return [IP, "netns", "exec", self.netns, *uts, "/bin/sh", "-c", script, self.hostname or "-", *argv]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: dict | None = None,
        replace_env: bool = False,
        cwd=None,
        stdin=subprocess.DEVNULL,
        stdout=None,
        stderr=None,
        **kwargs,
    ) -> subprocess.Popen:
        """Start ``argv`` on this host and return its Popen (in a session of its own; killed at teardown).

        ``env`` is merged into ``os.environ`` (or used alone with ``replace_env=True``); ``ip netns exec`` passes
        the environment through unchanged. ``stdout``/``stderr`` take anything Popen takes (files, PIPE).
        The Popen's pid is the command itself (``ip netns exec``, ``unshare`` and ``sh`` all exec).
        """
        full_env = dict(env or {}) if replace_env else {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            self.command(argv),
            env=full_env,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            **kwargs,
        )
        self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        timeout: float,
        *,
        env: dict | None = None,
        replace_env: bool = False,
        cwd=None,
        input: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host and wait; stdout/stderr captured as text.

        After ``timeout`` seconds the command's process group is killed and the test fails (``pytest.fail``) with
        its output. ``check=True`` also fails the test on a non-zero exit status.
        """
        proc = self.popen(
            argv,
            env=env,
            replace_env=replace_env,
            cwd=cwd,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc)
            out, err = proc.communicate()
            pytest.fail(
                f"timed out after {timeout} s on {self.netns}: {list(argv)}\n--- stdout\n{out}\n--- stderr\n{err}"
            )
        if check and proc.returncode != 0:
            pytest.fail(f"exit {proc.returncode} on {self.netns}: {list(argv)}\n--- stdout\n{out}\n--- stderr\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def pids(self) -> list[int]:
        """Pids of all processes now in this host's namespace."""
        return _ns_pids(self.netns)

    def kill_all(self) -> None:
        """SIGKILL every process started through this helper and every process still in the namespace."""
        for proc in self._procs:
            _killpg(proc)
        _kill_ns_processes(self.netns)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
        self._procs.clear()


def _killpg(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


class Network:
    """K simulated hosts on one bridge. ``up()`` builds it, ``down()`` removes it (idempotent); also a context manager.

    Attributes once up: ``hosts`` (list of :class:`Host`), ``subnet`` (IPv4Network), ``gateway`` (the root
    namespace's address on this network, ``10.X.Y.254``, on interface ``root_if``), ``bridge`` (the bridge's
    interface name), ``name`` (``m4d-<pid>-<tok>``, the prefix of the namespace names).
    """

    def __init__(self, k: int = 2, *, hostnames: bool = True, machine_ids: bool = True):
        if NETNS_SKIP_REASON is not None:
            pytest.skip(NETNS_SKIP_REASON)
        if not 1 <= k <= 253:
            raise ValueError("k must be in 1..253")
        if hostnames and UNSHARE is None:
            raise RuntimeError("hostnames=True needs util-linux 'unshare'; pass hostnames=False")
        if machine_ids and MOUNT is None:
            raise RuntimeError("machine_ids=True needs the 'mount' command; pass machine_ids=False")
        self.k = k
        self.use_hostnames = hostnames
        self.use_machine_ids = machine_ids
        self.token = secrets.token_hex(3)
        self.name = f"{PREFIX}-{os.getpid()}-{self.token}"
        self.bridge = f"m4b{self.token}"
        self.root_if = f"m4r{self.token}"  # the root namespace's interface on this network (holds the gateway)
        self.root_if_peer = f"m4q{self.token}"
        self.hosts: list[Host] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway: str | None = None
        self._up = False

    def __enter__(self) -> Network:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def __repr__(self) -> str:
        return f"Network({self.name}, subnet={self.subnet}, hosts={self.hosts})"

    def up(self) -> Network:
        if self._up:
            return self
        sweep_stale()
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._up = True  # from here on down() must run, even if set-up fails half way
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        self.subnet = _pick_subnet()
        base = self.subnet.network_address
        self.gateway = str(base + 254)
        alias = self.name
        self.hosts = [
            Host(
                self,
                i,
                f"{self.name}-{i}",
                str(base + i + 1),
                f"{PREFIX}-h{i}" if self.use_hostnames else None,
                f"m4v{self.token}{i}",
                RUN_DIR / f"{self.name}-{i}" / "boot_id" if self.use_machine_ids else None,
            )
            for i in range(self.k)
        ]
        root = [
            f"link add {self.bridge} type bridge",
            f"link set {self.bridge} alias {alias} up",
            # the root's address sits on a veth plugged into the bridge, not on the bridge itself: UCX's tcp
            # transport ignores bridge devices (unless UCX_TCP_BRIDGE_ENABLE=y), so MPI in the root would not work
            f"link add {self.root_if} type veth peer name {self.root_if_peer}",
            f"link set {self.root_if_peer} alias {alias} master {self.bridge} up",
            f"link set {self.root_if} alias {alias} up",
            f"addr add {self.gateway}/24 dev {self.root_if}",
        ]
        for h in self.hosts:
            root += [
                f"netns add {h.netns}",
                f"link add {h.veth} type veth peer name eth0 netns {h.netns}",
                f"link set {h.veth} alias {alias} master {self.bridge} up",
            ]
        _ip("-batch", "-", input="\n".join(root) + "\n")
        if self.use_hostnames:
            lines = "".join(f"{h.addr}\t{h.hostname}\n" for h in self.hosts)
            for h in self.hosts:
                d = ETC_NETNS / h.netns
                d.mkdir(parents=True, exist_ok=True)
                (d / "hosts").write_text(f"127.0.0.1\tlocalhost\n{lines}")
        if self.use_machine_ids:
            for h in self.hosts:
                h.boot_id_file.parent.mkdir(parents=True, exist_ok=True)
                h.boot_id_file.write_text(f"{uuid.uuid4()}\n")
                if Path("/etc/machine-id").exists():
                    d = ETC_NETNS / h.netns
                    d.mkdir(parents=True, exist_ok=True)
                    (d / "machine-id").write_text(f"{uuid.uuid4().hex}\n")
        for h in self.hosts:
            _ip(
                "-n",
                h.netns,
                "-batch",
                "-",
                input=(
                    "link set lo up\n"
                    f"addr add {h.addr}/24 dev eth0\n"
                    "link set eth0 up\n"
                    f"route add default via {self.gateway}\n"
                ),
            )

    def down(self) -> None:
        """Kill processes on every host, delete namespaces, veths, bridge and /etc/netns dirs. Safe to repeat."""
        if not self._up:
            return
        errors = []
        for h in self.hosts:
            try:
                h.kill_all()
            except Exception as e:  # keep tearing down the rest
                errors.append(e)
        for i in range(self.k):
            ns = f"{self.name}-{i}"
            try:
                _delete_ns(ns)
            except Exception as e:
                errors.append(e)
        for link in _links():  # veths whose namespace is not gone yet, and the bridge
            if link.get("ifalias") == self.name:
                _ip("link", "del", link["ifname"], check=False)
        for top in (ETC_NETNS, RUN_DIR):
            try:
                top.rmdir()  # only when empty (ip netns itself never creates /etc/netns)
            except OSError:
                pass
        self._up = False
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if errors:
            raise errors[0]

    def leftovers(self) -> list[str]:
        """Names of this network's namespaces, links and /etc/netns dirs that still exist (empty after down())."""
        left = [ns for ns in _netns_names() if ns.startswith(self.name + "-")]
        left += [
            link["ifname"] for link in _links() if link.get("ifalias") == self.name or link["ifname"] == self.bridge
        ]
        for top in (ETC_NETNS, RUN_DIR):
            left += [str(d) for d in top.glob(f"{self.name}-*")] if top.is_dir() else []
        return left


@atexit.register
def _down_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for net in live:
        try:
            net.down()
        except Exception:
            pass


@pytest.fixture(name="netns_network")
def netns_network_fixture():
    """Factory fixture: ``netns_network(k=2, hostnames=True, machine_ids=True) -> Network`` (up), torn down after."""
    made: list[Network] = []

    def make(k: int = 2, *, hostnames: bool = True, machine_ids: bool = True) -> Network:
        net = Network(k, hostnames=hostnames, machine_ids=machine_ids)
        made.append(net)
        return net.up()

    yield make
    errors = []
    for net in reversed(made):
        try:
            net.down()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]
