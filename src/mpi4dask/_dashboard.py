"""The "MPI" page of the scheduler's dashboard (private): ``/mpi`` and its data, ``/mpi/data.json`` (under the
scheduler's ``http_prefix``, when it has one).

Added to the scheduler's HTTP server (``scheduler.http_application``, the dashboard's) when mpi4dask's
MPI service starts there (:func:`mpi4dask.pm.install`: any scheduler listening on ``mpi://``, or one
that ``run_mpi`` used).  Nothing runs while nobody looks: each request asks every worker for its view
(:func:`mpi4dask._metrics.report`, through the handler ``mpi4dask_report`` that the cluster's worker
plugin installs), each worker with a timeout of its own, so a dead or stuck worker is shown as such
and never holds the page.  The page renders the data embedded in it, then polls the JSON every few
seconds while it is open.

What it shows: the worker-to-worker matrix (a cell per ordered pair: bytes that moved from the row's
worker to the column's, coloured by transport and route), the communicators that ``run_mpi`` formed
(job, function, ranks and their workers, start, duration, outcome) and the recent joins into MPI and
fallbacks to the socket, with time and reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

from . import _metrics

logger = logging.getLogger(__name__)

PATH = "/mpi"
WORKER_TIMEOUT = 2.0  # seconds each worker gets to answer a page's request
EVENTS_SHOWN = 50
JOBS_SHOWN = 30
REFRESH_MS = 3000


def worker_report(worker=None) -> dict:
    """The handler ``mpi4dask_report`` of a worker (installed by the cluster's worker plugin)."""
    return _metrics.report()


async def _ask(scheduler, addr: str):
    try:
        return await asyncio.wait_for(scheduler.rpc(addr).mpi4dask_report(), WORKER_TIMEOUT)
    except (asyncio.TimeoutError, TimeoutError):
        return {"error": f"no answer in {WORKER_TIMEOUT:.0f} s"}
    except Exception as exc:  # noqa: BLE001 - a worker that died, or has no mpi4dask handler: shown as such
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


async def collect(scheduler) -> dict:
    """The page's data: every worker's view, gathered now (see the module docstring)."""
    workers = sorted(scheduler.workers)
    answers = await asyncio.gather(*(_ask(scheduler, a) for a in workers))
    views = dict(zip(workers, answers))
    known = set(workers)
    cells: dict = {}
    for w, view in views.items():
        for p in view.get("peers", []):
            peer = p["peer"]
            if peer not in known or peer == w:
                continue
            for src, dst, mpi_b, sock_b in ((w, peer, p["mpi_bytes_sent"], p["socket_bytes_sent"]),
                                            (peer, w, p["mpi_bytes_received"], p["socket_bytes_received"])):
                c = cells.setdefault((src, dst, p["transport"], p["route"]),
                                     {"src": src, "dst": dst, "transport": p["transport"], "route": p["route"],
                                      "mpi_bytes": 0, "socket_bytes": 0, "open": 0})
                c["mpi_bytes"] += mpi_b
                c["socket_bytes"] += sock_b
                c["open"] += p["open"]
    jobs: dict = {}
    for w, view in views.items():
        for r in view.get("jobs", []):
            j = jobs.setdefault(r["job"], {"job": r["job"], "fn": r["fn"], "mode": r["mode"], "size": r["size"],
                                           "workers": r["workers"], "ranks": {}, "start": r["start"], "seconds": 0.0,
                                           "outcome": "ok", "errors": [], "retry": r["retry"]})
            j["ranks"][str(r["rank"])] = w
            j["start"] = min(j["start"], r["start"])
            j["seconds"] = max(j["seconds"], r["seconds"])
            if r["outcome"] != "ok":
                j["outcome"] = "failed"
                j["errors"].append(f"rank {r['rank']}: {r['error']}")
    own = _metrics.report()
    events = [{**e, "process": "scheduler"} for e in own["events"]]
    for w, view in views.items():
        events.extend({**e, "process": w} for e in view.get("events", []))
    events.sort(key=lambda e: e["time"], reverse=True)
    return {
        "time": time.time(),
        "scheduler": scheduler.address,
        "workers": [{"address": a, "name": str(scheduler.workers[a].name)} for a in workers if a in scheduler.workers],
        "unreachable": {a: v["error"] for a, v in views.items() if "error" in v},
        "cells": [cells[k] for k in sorted(cells)],
        "communicators": sorted(jobs.values(), key=lambda j: j["start"], reverse=True)[:JOBS_SHOWN],
        "events": events[:EVENTS_SHOWN],
    }


def _page() -> str:
    from importlib.resources import files

    return files(__package__).joinpath("_dashboard.html").read_text(encoding="utf-8")


def _handlers():
    from tornado import web

    class DataHandler(web.RequestHandler):
        def initialize(self, scheduler):
            self.scheduler = scheduler

        async def get(self):
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            self.write(json.dumps(await collect(self.scheduler)))

    class PageHandler(DataHandler):
        async def get(self):
            data = json.dumps(await collect(self.scheduler)).replace("</", "<\\/")
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.write(_page().replace("__DATA__", data).replace("__REFRESH__", str(REFRESH_MS)))

    return PageHandler, DataHandler


def _prefix(app) -> str:
    """The scheduler's ``http_prefix`` (``dask scheduler --dashboard-prefix``), which distributed does not keep:
    read off the route it gives its ``/health`` page; "" without one."""
    for rule in getattr(getattr(app, "wildcard_router", None), "rules", ()):
        pattern = getattr(getattr(rule.matcher, "regex", None), "pattern", "")
        if pattern.endswith("/health$"):
            return pattern[: -len("/health$")]
    return ""


def install(scheduler) -> bool:
    """Add the page to ``scheduler``'s HTTP server (once), under its ``http_prefix``; False where it has none."""
    app = getattr(scheduler, "http_application", None)
    if app is None or getattr(scheduler, "_mpi4dask_dashboard", False):
        return False
    page, data = _handlers()
    path = _prefix(app) + PATH
    app.add_handlers(r".*", [(path, page, {"scheduler": scheduler}), (path + "/data.json", data,
                                                                       {"scheduler": scheduler})])
    scheduler._mpi4dask_dashboard = True
    _list_in_menu(scheduler)
    return True


MENU_ENTRY = {"url": PATH.lstrip("/"), "name": "MPI"}


def _list_in_menu(scheduler) -> None:
    """Put the page in the "More..." menu of distributed's Bokeh dashboard, where this scheduler runs one.

    distributed builds that menu from ``distributed.dashboard.scheduler.template_variables(scheduler)``
    (memoized per scheduler; every page of its dashboard renders the same ``plots`` list) when the scheduler
    starts its dashboard, which needs bokeh, and adds the Bokeh application to the scheduler's HTTP server
    (``http_application.applications``).  Without bokeh, or with this scheduler's dashboard off, there is
    no menu: nothing to do.  Its links are relative, so ``mpi`` reaches the page under
    the scheduler's ``http_prefix`` too."""
    board = sys.modules.get("distributed.dashboard.scheduler")
    if board is None or not hasattr(board, "template_variables"):
        return
    if not getattr(scheduler.http_application, "applications", None):
        return  # this scheduler has no Bokeh application (its dashboard is off): asking would keep it memoized
    try:
        plots = board.template_variables(scheduler)["plots"]
    except Exception as exc:  # noqa: BLE001 - another distributed's menu: the page is still served, only unlisted
        logger.debug("the dashboard's menu does not list the MPI page: %s", exc)
        return
    if MENU_ENTRY not in plots:
        plots.append(dict(MENU_ENTRY))
        plots.sort(key=lambda d: d["name"])  # in place: the dashboard's pages hold this list
