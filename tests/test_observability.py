"""Observability: mpi4dask's Prometheus metrics on distributed's ``/metrics`` endpoints, and the dashboard's
MPI page (``/mpi``), read from a real running cluster.

A fresh script (in a process of its own: the pytest process never touches MPI) starts
``LocalCluster(protocol="mpi", n_workers=2, processes=True)`` with dashboards, moves an 8 MiB array from
one worker to the other, runs ``mpi4dask.run_mpi`` once, connects a client from another process that is
not of the cluster (whose connection falls back to the socket), then writes the addresses and waits.
The test scrapes the scheduler's and both workers' ``/metrics`` over HTTP, parses them with
``prometheus_client``'s parser and checks them against what moved; the browser test renders ``/mpi`` in
headless Chromium and checks the DOM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import weakref
from pathlib import Path

import pytest

from conftest import Background, echo, kill_tree, run, served_worlds, slow_served_transport

NBYTES = 8 << 20



@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The running cluster's addresses (``ready.json`` of the script), after its workload (one cluster for
    the tests of this module: what they read changes no counter they check)."""
    tmp_path = tmp_path_factory.mktemp("cluster")
    script = Path(__file__).parent / "jobs" / "observed_cluster.py"
    with Background([sys.executable, str(script), str(tmp_path), str(NBYTES)], cwd=tmp_path) as job:
        job.wait_for_file(tmp_path / "ready.json", 150)
        yield json.loads((tmp_path / "ready.json").read_text()), job
        (tmp_path / "done").touch()
        job.wait(60)


def get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.status == 200, (url, r.status)
        return r.read().decode()


def scrape(base: str) -> dict:
    """``/metrics`` of one server, parsed: {(sample name, frozenset(labels)): value} of mpi4dask's samples."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(get(base + "/metrics")):
        for s in family.samples:
            if s.name.startswith("mpi4dask_"):
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert found, f"no {name}{labels} in {sorted(n for n, _ in samples)}"
    return sum(found)


@served_worlds
@slow_served_transport
@pytest.mark.timeout(240)
def test_metrics_of_a_running_cluster(cluster):
    ready, job = cluster
    assert ready["run_mpi"] == [3, 3]
    sched = scrape(ready["scheduler_http"])
    sender = scrape(ready["workers"][ready["sender"]])
    receiver = scrape(ready["workers"][ready["receiver"]])

    # the 8 MiB array left the sender over MPI (a pair of joined worlds: LocalCluster's workers) and arrived
    assert value(sender, "mpi4dask_sent_bytes_total", transport="mpi", route="pair") >= NBYTES
    assert value(receiver, "mpi4dask_received_bytes_total", transport="mpi", route="pair") >= NBYTES
    assert value(sender, "mpi4dask_sent_messages_total", transport="mpi") >= 1
    # the control traffic with the scheduler moved too, and its connections are open
    for samples in (sched, sender, receiver):
        assert value(samples, "mpi4dask_open_connections") > 0
        assert value(samples, "mpi4dask_connections_total") >= value(samples, "mpi4dask_open_connections")
        assert value(samples, "mpi4dask_sent_bytes_total", transport="socket") > 0
    # both workers joined MPI through the scheduler's service; the pair was joined by accept/connect
    assert value(sched, "mpi4dask_joins_total", kind="service") >= 2
    assert value(sender, "mpi4dask_joins_total", kind="pair") + value(receiver, "mpi4dask_joins_total",
                                                                        kind="pair") >= 2
    # each of those joins observed its time in MPI, on both ends
    for samples in (sender, receiver):
        assert value(samples, "mpi4dask_pair_join_seconds_count") == value(samples, "mpi4dask_joins_total", kind="pair")
        assert value(samples, "mpi4dask_pair_join_seconds_bucket", le="+Inf") == value(samples,
                                                                                     "mpi4dask_pair_join_seconds_count")
        joins = value(samples, "mpi4dask_pair_join_seconds_count")
        assert 0 < value(samples, "mpi4dask_pair_join_seconds_sum") < 10 * joins
    # run_mpi: one call (counted where rank 0 ran), two rank tasks, both ok, their durations observed
    assert value(sender, "mpi4dask_run_mpi_calls_total") + value(receiver, "mpi4dask_run_mpi_calls_total") == 1
    assert value(sender, "mpi4dask_run_mpi_retries_total") + value(receiver, "mpi4dask_run_mpi_retries_total") == 0
    for samples in (sender, receiver):
        assert value(samples, "mpi4dask_run_mpi_rank_tasks_total", outcome="ok") == 1
        assert value(samples, "mpi4dask_run_mpi_rank_tasks_total", outcome="failed") == 0
        assert value(samples, "mpi4dask_run_mpi_duration_seconds_count") == 1
        assert value(samples, "mpi4dask_run_mpi_duration_seconds_bucket", le="+Inf") == 1
        assert value(samples, "mpi4dask_run_mpi_duration_seconds_sum") > 0


@served_worlds
@slow_served_transport
@pytest.mark.timeout(240)
def test_socket_fallback_is_counted_with_its_reason(cluster):
    ready, job = cluster
    sched = scrape(ready["scheduler_http"])
    # the stranger's client is of no cluster's MPI service: the scheduler's side counts why
    assert value(sched, "mpi4dask_socket_fallbacks_total", reason="other_cluster") >= 1
    assert value(sched, "mpi4dask_connections_total", transport="socket", route="none") >= 1
    # a worker's first connection, to register with its scheduler, is made before the scheduler let it join
    # MPI: that one falls back (mpi_not_up), no other (its connections to the other worker use MPI)
    for w in ready["workers"].values():
        samples = scrape(w)
        reasons = {dict(ls)["reason"]: v for (n, ls), v in samples.items() if n == "mpi4dask_socket_fallbacks_total"}
        assert set(reasons) == {"mpi_not_up"}, reasons
        assert reasons["mpi_not_up"] == value(samples, "mpi4dask_connections_total", transport="socket")
    page = json.loads(get(ready["scheduler_http"] + "/mpi/data.json"))
    fallbacks = [e for e in page["events"] if e["event"] == "fallback"]
    assert fallbacks and fallbacks[0]["process"] == "scheduler" and fallbacks[0]["reason"] == "other_cluster"


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@served_worlds
@slow_served_transport
@pytest.mark.timeout(240)
def test_dashboard_mpi_page_in_a_browser(request, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("MPI4DASK_REQUIRE_BROWSER") == "1":
            pytest.fail("MPI4DASK_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install chromium)")
        pytest.skip("no headless browser: apt-get install chromium (Debian's package)")
    ready, job = request.getfixturevalue("cluster")
    profile = tmp_path / "chromium-profile"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--dump-dom", ready["scheduler_http"] + "/mpi"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        dom, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        pytest.fail(f"chromium did not render {ready['scheduler_http']}/mpi in 120 s")
    assert proc.returncode == 0, err
    from html.parser import HTMLParser

    class Cells(HTMLParser):
        """The rendered tables: (table id, row of cell texts, attributes of each cell)."""

        def __init__(self):
            super().__init__()
            self.table, self.rows, self.attrs, self.text = None, [], None, None

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.table = dict(attrs).get("id")
            elif tag == "tr":
                self.rows.append((self.table, [], []))
            elif tag in ("td", "th"):
                self.attrs, self.text = dict(attrs), []

        def handle_data(self, data):
            if self.text is not None:
                self.text.append(data)

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.text is not None:
                self.rows[-1][1].append(" ".join(self.text))
                self.rows[-1][2].append(self.attrs)
                self.text = None

    parser = Cells()
    parser.feed(dom)
    matrix = [r for r in parser.rows if r[0] == "matrix"]
    a, b = ready["sender"], ready["receiver"]
    # rendered by the page's script: a header and one row per worker, each naming both workers
    assert len(matrix) == 3, dom
    assert all(a in " ".join(r[1]) or b in " ".join(r[1]) for r in matrix), matrix
    row_a = next(r for r in matrix[1:] if a in r[1][0])
    cell = row_a[2][matrix[0][1].index(next(h for h in matrix[0][1] if b in h))]
    assert cell.get("data-transport") == "mpi" and "mpi-pair" in cell.get("class", ""), cell
    assert int(cell["data-bytes"]) >= NBYTES, cell
    jobs = [r for r in parser.rows if r[0] == "communicators"][1:]
    assert len(jobs) == 1 and jobs[0][1][1] == "allreduce" and "ok" in jobs[0][1][-1], jobs
    assert a in jobs[0][1][3] and b in jobs[0][1][3], jobs
    events = [r[1] for r in parser.rows if r[0] == "events"][1:]
    assert any(e[2] == "join" and "service" in e[3] for e in events), events
    assert any(e[2] == "fallback" and "other_cluster" in e[3] for e in events), events
    status = re.search(r'<p id="status">([^<]*)</p>', dom).group(1)
    assert f"scheduler {ready['scheduler']}, 2 workers" in status and "no answer" not in status, status


@served_worlds
@slow_served_transport
@pytest.mark.timeout(120)
def test_mpi_page_answers_while_a_worker_is_stuck(cluster):
    """A worker that does not answer (stopped with SIGSTOP) is named on the page, which still comes within the
    per-worker timeout, with the other worker's data.  (Last of the cluster's tests: it stops a worker.)"""
    import signal
    import time

    from mpi4dask._dashboard import WORKER_TIMEOUT

    ready, job = cluster
    stuck, other = ready["sender"], ready["receiver"]  # the receiver opened the connection: its view has the bytes
    os.kill(ready["pids"][stuck], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        page = json.loads(get(ready["scheduler_http"] + "/mpi/data.json"))
        took = time.monotonic() - t0
    finally:
        os.kill(ready["pids"][stuck], signal.SIGCONT)
    assert took < WORKER_TIMEOUT + 5, took
    assert list(page["unreachable"]) == [stuck] and "no answer" in page["unreachable"][stuck], page["unreachable"]
    # what moved on the connection the answering worker opened to the stuck one is still shown
    assert any(c["src"] == stuck and c["dst"] == other and c["mpi_bytes"] >= NBYTES for c in page["cells"]), page


def menu_links(html: str) -> dict:
    """The links of the "More..." menu of a page of distributed's Bokeh dashboard: {text: href}."""
    menu = html.split('class="dropdown-content"', 1)
    assert len(menu) == 2, html[:500]
    items = menu[1].split("</ul>", 1)[0]
    return {text.strip(): href for href, text in re.findall(r'<a href="([^"]*)">([^<]*)</a>', items)}


@served_worlds
@slow_served_transport
@pytest.mark.timeout(240)
def test_mpi_page_is_in_the_dashboards_menu(cluster):
    """With bokeh installed (as with ``dask[diagnostics]``), the scheduler's dashboard lists the page in its
    "More..." menu on every page, beside distributed's own; the link is relative and reaches the page."""
    import bokeh  # noqa: F401 - a test dependency: without it distributed serves no dashboard to list the page in

    ready, job = cluster
    base = ready["scheduler_http"]
    for page in ("/status", "/workers", "/tasks"):
        links = menu_links(get(base + page))
        assert links.get("MPI") == "mpi", (page, links)
        assert {"Hardware", "Shuffle"} <= set(links), (page, links)  # distributed's own entries are all still there
    assert "render(" in get(urllib.parse.urljoin(base + "/status", links["MPI"]))


@pytest.mark.timeout(30)
def test_page_script_is_packaged():
    """The page ships with the package (package-data), not only in a source checkout."""
    import mpi4dask._dashboard as d

    assert "render(" in d._page() and Path(d.__file__).with_name("_dashboard.html").exists()


@pytest.mark.timeout(120)
def test_bytes_of_closed_connections_stay_counted():
    """In one process (a world of one, MPI self-messages, as tests/test_comm.py): a connection's bytes stay in
    the process's totals after it is closed and collected, and the collector's output parses."""
    import gc

    from distributed.comm import connect, listen
    from distributed.protocol import to_serialize
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from mpi4dask import _metrics
    from mpi4dask import comm as mpicomm

    def mpi_world():
        return _metrics.connection_totals().get(("mpi", "world"), dict.fromkeys((*_metrics.STAT_KEYS, "open"), 0))

    before = dict(mpi_world())
    earlier = list(mpicomm._open_comms)  # other tests' comms in this process, held so that their ids stay theirs
    refs = []

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        await comm.write({"x": to_serialize(bytes(4 << 20))})
        assert len((await comm.read())["x"]) == 4 << 20
        assert mpi_world()["open"] == before["open"] + 2
        refs.extend(weakref.ref(c) for c in mpicomm._open_comms if not any(c is e for e in earlier))
        assert len(refs) == 2, refs  # this test's two ends
        await comm.close()
        listener.stop()

    run(main())
    gc.collect()
    assert refs and not [r for r in refs if r() is not None], "the closed comms were not collected"
    after = mpi_world()
    # 4 MiB each way, counted by both ends of the connection (both in this process), plus a few bytes of framing
    for k in ("mpi_bytes_sent", "mpi_bytes_received"):
        assert 2 * (4 << 20) <= after[k] - before[k] < 2 * (4 << 20) + 1024, (k, before, after)
    assert after["open"] == before["open"]
    registry = CollectorRegistry()
    registry.register(_metrics._Collector())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples[("mpi4dask_sent_bytes_total", (("route", "world"), ("transport", "mpi")))] == after["mpi_bytes_sent"]
    assert samples[("mpi4dask_open_connections", (("route", "world"), ("transport", "mpi")))] == after["open"]


@pytest.mark.timeout(60)
def test_mpi_page_lives_under_the_dashboard_prefix():
    """``dask scheduler --dashboard-prefix /dask`` (``http_prefix``): the page is at /dask/mpi, beside the rest."""
    from distributed import Scheduler
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError

    async def main():
        async with Scheduler(protocol="mpi", host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0",
                             http_prefix="/dask") as s:
            base = f"http://127.0.0.1:{s.http_server.port}"
            http = AsyncHTTPClient()
            page = (await http.fetch(base + "/dask/mpi")).body.decode()
            data = json.loads((await http.fetch(base + "/dask/mpi/data.json")).body)
            with pytest.raises(HTTPClientError) as unprefixed:
                await http.fetch(base + "/mpi")
            status = (await http.fetch(base + "/dask/status")).body.decode()
            return page, data, unprefixed.value.code, status

    page, data, code, status = run(main())
    assert "render(" in page and isinstance(data, dict), (page[:300], data)
    assert code == 404
    # the dashboard's menu links to it relatively: from /dask/status, "mpi" is /dask/mpi
    assert urllib.parse.urljoin("/dask/status", menu_links(status)["MPI"]) == "/dask/mpi"
