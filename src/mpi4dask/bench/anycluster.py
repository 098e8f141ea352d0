"""``mpi4dask bench pair`` and ``mpi4dask bench form``: MPI in Dask clusters that ``mpiexec`` did not start.

Both run their clusters in ``python -m mpi4dask.bench.anycluster_job`` (see that module): a plain
process, not an MPI job, that starts a ``LocalCluster(processes=True, threads_per_worker=1)``, so
every worker is a process of its own that Dask spawned and that initialises MPI, where it needs it,
as a served world of one through the scheduler's MPI service (:mod:`mpi4dask.pm`).

``pair``
    The ping-pong of ``mpi4dask bench comm`` (same sizes, payload checks, adaptive rounds, one-way
    time and GB/s) between the two workers of a ``LocalCluster(protocol="mpi")``, whose connection
    joins their worlds (an MPI *pair*, checked), side by side with the same ping-pong between the
    two ranks of one ``mpiexec`` job (``bench comm``'s job, over ``mpi://``) and, per other protocol
    of ``--protocols`` (default: ``tcp``), between the two workers of a ``LocalCluster`` of that
    protocol; and from a plain process outside the cluster (over ``mpi://`` every frame on the
    socket, as for any client that shares no MPI world with the workers) to a worker, per protocol.
    Then, in each LocalCluster, fresh payloads (``--move-sizes``, ``--moves`` of each) moved between
    its 2 workers as Dask moves a task's dependency, timed by the receiver's transfer log: what the
    ping-pong, on one warm connection, does not show (a receive that outlasts its first moments).
``form``
    :func:`mpi4dask.run_mpi` on a ``LocalCluster`` of N workers (``--workers``): MPI initialisation
    in the workers, the first call (forming the participants' communicator), warm calls (reusing
    it), and the first call after ``cluster.scale(N + 1)`` (a new participant set); every answer
    checked against NumPy.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from . import common as c
from .comm import CommOptions, _check_complete, add_comm_arguments, collect_comm

JOB = "mpi4dask.bench.anycluster_job"
PAIR_TARGET = 1.10  # the target: the pair within 10 % of one job's ranks at every size
FORM_TIMEOUT = 300.0
DEFAULT_MOVE_SIZES = "8M,128M"
DEFAULT_MOVES = 4
DEFAULT_FORM_WORKERS = [2, 4, 8, 16]
DEFAULT_FORM_REPEAT = 5


# ----------------------------------------------------------------------------------------------
# pair
# ----------------------------------------------------------------------------------------------


@dataclass
class PairOptions(CommOptions):
    """``bench comm``'s options (the ping-pongs) and the fresh moves'."""
    move_sizes: list[int] = c.option(c.parse_sizes(DEFAULT_MOVE_SIZES), "sizes of the fresh payloads moved between "
                                     "the 2 workers as Dask moves a task's dependency, after the ping-pongs",
                                     c.sizes_arg, "LIST", all="move_sizes", shown=DEFAULT_MOVE_SIZES)
    moves: int = c.option(DEFAULT_MOVES, "payloads moved per size, alternately A to B and B to A", c.positive_int,
                          "N", all="moves")


def add_pair_arguments(p: argparse.ArgumentParser) -> None:
    """``bench comm``'s arguments (the same sizes, rounds and defaults), with pair's meanings, and the moves'."""
    add_comm_arguments(p)
    c.add_options(p, PairOptions)  # the moves' (comm's are there)
    helps = {
        "protocols": "protocols to measure between the two workers of a LocalCluster of that protocol (default: "
                     "mpi,tcp); mpi (required) also runs bench comm's job: mpi:// between the 2 ranks of one "
                     "mpiexec job",
        "output": "write pair.json and pair.md here",
        "host": "host the one-job reference's rank 0 listens on (default: 127.0.0.1; the workers' echo listener "
                "always uses 127.0.0.1)",
        "timeout": f"give up on each job after this many seconds (default: {p.get_default('timeout'):g})",
    }
    for action in p._actions:
        if action.dest in helps:
            action.help = helps[action.dest]


def pair_for_all(args: argparse.Namespace) -> dict:
    """In ``bench all``: mpi always (the pair is what pair measures)."""
    return {"protocols": ["mpi", *(p for p in args.protocols if p != "mpi")]}


def collect_pair(args: argparse.Namespace) -> dict:
    session = c.Session("pair", args)
    if "mpi" not in session.protocols:
        raise c.BenchFailed("bench pair measures mpi:// between LocalCluster workers: --protocols must include mpi")
    others = [p for p in session.protocols if p != "mpi"]
    cores = c.machine_info()["cpu_count"]
    steps = c.Steps("pair", 2 + len(others))
    config = {**c.option_values(PairOptions, args), "what": "pair", "seed": c.SEED}

    steps.start(f"mpi:// between the 2 ranks of one mpiexec job (bench comm's job; 2 ranks on {cores} cores)")
    one_job = collect_comm(c.part_args(add_comm_arguments, None, args, **c.option_values(CommOptions, args),
                                       protocols=["mpi"], output=None))  # checked complete by collect_comm

    jobs = {}
    with session:
        for p in ["mpi", *others]:
            steps.start(f"{c.label(p)} between the 2 workers of a LocalCluster(protocol={p!r}) (this job's process: "
                        f"scheduler, client, nannies; + 2 worker processes = 3 processes on {cores} cores)")
            jobs[p] = job = session.run(None, JOB, {**config, "protocol": p})
            _check_complete(job, args.sizes, [p])
            _check_complete(job["outsider"], args.sizes, [p])
    records = [{**r, "setup": "one-job"} for r in one_job["records"]]
    records += [{**r, "setup": "pair"} for job in jobs.values() for r in job["records"]]
    records += [{**r, "setup": "outsider"} for job in jobs.values() for r in job["outsider"]["records"]]
    machine = {k: v for k, v in one_job["machine"].items() if k.startswith("mpi")}
    result = session.result(machine, records=records, target_ratio=PAIR_TARGET, one_job=one_job,
                            jobs={p: {k: v for k, v in j.items() if k != "records"}
                                  | {"outsider": {k: v for k, v in j["outsider"].items() if k != "records"}}
                                  for p, j in jobs.items()})
    result["target_met"] = all(r <= PAIR_TARGET for r in _pair_ratios(result).values())
    session.write(result, render_pair, None)
    return result


def _by(result: dict) -> dict:
    return {(r["setup"], r["transport"], r["size"]): r for r in result["records"]}


def _pair_ratios(result: dict) -> dict[int, float]:
    """size -> median one-way time of the mpi:// pair / that of one job's ranks."""
    by = _by(result)
    return {s: by[("pair", "mpi", s)]["one_way_median_us"] / by[("one-job", "mpi", s)]["one_way_median_us"]
            for (setup, t, s) in by if setup == "pair" and t == "mpi" and ("one-job", "mpi", s) in by}


def render_pair(result: dict) -> str:
    by = _by(result)
    others = [p for p in c.DASK_PROTOCOLS if p != "mpi" and p in result["config"]["protocols"]]
    columns = [("pair", "mpi", "mpi:// pair (LocalCluster workers)"),
               ("one-job", "mpi", "mpi:// ranks of one mpiexec job"),
               *(("pair", p, f"{c.label(p)} (LocalCluster workers)") for p in others),
               ("outsider", "mpi", "mpi:// outsider to worker (socket)"),
               *(("outsider", p, f"{c.label(p)} outsider to worker") for p in others)]
    header = ["size"]
    for _, _, name in columns:
        header += [f"{name} us (min)", f"{name} GB/s"]
    short = {("pair", "mpi"): "pair", ("one-job", "mpi"): "job", ("outsider", "mpi"): "outsider"}
    header += ["pair / one-job time", *(f"pair / {p} speedup" for p in others),
               *(f"outsider / {p} outsider speedup" for p in others),
               "rounds " + "/".join(short.get((s, t)) or (t if s == "pair" else f"{t} outsider")
                                    for s, t, _ in columns)]
    ratios = _pair_ratios(result)
    rows = []
    for size in sorted({r["size"] for r in result["records"] if r["setup"] == "pair"}):
        row = [c.format_size(size)]
        for setup, t, _ in columns:
            r = by.get((setup, t, size))
            row += [f"{c.fmt_us(r['one_way_median_us'])} ({c.fmt_us(r['one_way_min_us'])})",
                    c.fmt_gbps(r["throughput_GBps"])] if r else ["-", "-"]
        row.append(f"{ratios[size]:.2f}x" if size in ratios else "-")
        for setup in ("pair", "outsider"):
            mine = by.get((setup, "mpi", size))
            for p in others:
                o = by.get((setup, p, size))
                row.append(c.ratio(o["one_way_median_us"], mine["one_way_median_us"]) if o and mine else "-")
        row.append("/".join(str(by[(s, t, size)]["iterations"]) if (s, t, size) in by else "-" for s, t, _ in columns))
        rows.append(row)

    missed = {s: r for s, r in ratios.items() if r > result["target_ratio"]}
    target = (f"**Target** (the pair within {100 * (result['target_ratio'] - 1):.0f}% of one job's ranks, median "
              f"one-way time, at every size): " + (
                  "met at every size." if not missed else
                  f"**missed** at {len(missed)} of {len(ratios)} sizes: "
                  + ", ".join(f"{c.format_size(s)} ({r:.2f}x)" for s, r in sorted(missed.items())) + "."))
    conn = result["jobs"]["mpi"]["connection"]
    outsider = result["jobs"]["mpi"].get("outsider", {}).get("connection") or {}
    worlds = result["jobs"]["mpi"].get("worlds") or {}
    cores = result["machine"].get("cpu_count")
    notes = [
        "Ping-pong of `mpi4dask bench comm` (message {'x': to_serialize(numpy uint8 array)} via Comm.write/Comm.read; "
        "one-way time = round trip / 2, median over the timed rounds, minimum in parentheses; GB/s = 10^9 bytes / "
        "median one-way time). Every point's payload was verified (full comparison before and after the timed "
        "rounds, a per-round stamp on each).",
        "**pair**: between the 2 workers of `LocalCluster(protocol=P, n_workers=2, threads_per_worker=1, "
        "processes=True)`, started by Dask, not by mpiexec: worker B echoes on a `distributed.comm.listen` listener, "
        "worker A drives from a coroutine run by `client.run`, on its event loop (which also serves the worker's "
        f"heartbeats); 3 processes shared the {cores} cores (scheduler + client + nannies in one, 2 workers). "
        f"Checked over mpi://: the workers are {len(worlds)} separate MPI worlds of 1, and worker A's connection "
        f"is transport `{conn.get('transport')}`, mpi_route `{conn.get('mpi_route')}` "
        f"({conn.get('mpi_bytes_sent', 0) / 2**20:.0f} MiB sent over MPI). Over mpi:// frames under "
        f"{c.format_size(result['jobs']['mpi'].get('mpi_min_frame') or 65536)} travel on the connection's TCP socket "
        "in both setups, so at those sizes the pair and one job differ only in where the ping-pong runs (a worker's "
        "event loop, shared with its Dask duties, and a third process on the cores, against a bare event loop in a "
        "rank). **one job**: `bench comm`'s job, "
        f"`mpiexec -n 2`, mpi:// between its 2 ranks (2 processes on the {cores} cores, plus the idle launcher). "
        "**outsider to worker**: the same ping-pong from a plain process the job starts, not a member of the "
        "cluster, to worker B, as a client that shares no MPI world with the workers takes it (a client outside "
        f"an mpiexec job, workers under Open MPI): over mpi:// its connection is transport "
        f"`{outsider.get('transport')}`, every frame on the socket (4 processes on the cores while it runs).",
        "`pair / one-job time` = median one-way time of the pair / that of one job (above 1: the pair is slower); "
        "`pair / P speedup` = P's time / the pair's (above 1: the pair is faster); `outsider / P outsider speedup` "
        "likewise for the outsider's connections.",
    ]
    lines = [c.header_line("pair", result), "", *c.md_table(header, rows), "", target, "",
             *_render_moves(result), "",
             " ".join([*notes, c.start_note(result),
                       c.job_loadavg_note([("one job", result["one_job"])]
                                     + [(f"{c.label(p)} pair", j) for p, j in result["jobs"].items()]),
                       *c.run_notes(result)])]
    return "\n".join(lines)


def _move_stats(result: dict) -> dict:
    """(protocol, size) -> summaries of the fresh moves' transfer and wall seconds."""
    out = {}
    for p, job in result["jobs"].items():
        for size in sorted({m["size"] for m in job.get("moves", [])}):
            ms = [m for m in job["moves"] if m["size"] == size]
            out[(p, size)] = {"transfer": c.summary(m["transfer_s"] for m in ms),
                              "wall": c.summary(m["wall_s"] for m in ms)}
    return out


def _render_moves(result: dict) -> list[str]:
    stats = _move_stats(result)
    if not stats:
        return []
    protocols = ["mpi", *(p for p in result["jobs"] if p != "mpi")]
    others = protocols[1:]
    header = ["size"]
    for p in protocols:
        header += [f"{c.label(p)} transfer ms (max)", f"{c.label(p)} GB/s", f"{c.label(p)} fetching task ms (max)"]
    header += [f"{p} / mpi transfer time" for p in others]
    rows = []
    for size in sorted({s for _, s in stats}):
        row = [c.format_size(size)]
        for p in protocols:
            st = stats.get((p, size))
            if st is None:
                row += ["-", "-", "-"]
                continue
            t, w = st["transfer"], st["wall"]
            row += [f"{1e3 * t['median']:.1f} ({1e3 * t['max']:.1f})", c.fmt_gbps(size / t["median"] / 1e9),
                    f"{1e3 * w['median']:.1f} ({1e3 * w['max']:.1f})"]
        mine = stats.get(("mpi", size))
        for p in others:
            o = stats.get((p, size))
            row.append(c.ratio(o["transfer"]["median"], mine["transfer"]["median"]) if o and mine else "-")
        rows.append(row)
    n = result["config"].get("moves")
    note = (f"**Fresh moves** between the same 2 workers, after the ping-pongs: per size, {n} payloads of random "
            "bytes, each made by a task on one worker (alternately A and B) and then needed by a task pinned to the "
            "other, which fetches it as Dask fetches any dependency (`gather_dep`, the workers' pooled connection): "
            "`transfer` is the duration in the receiver's `transfer_incoming_log` (median, max in parentheses; GB/s "
            "from the median), `fetching task` the wall time of that task from the client (fetch, digest, result). "
            "One untimed move each way came first (the workers' own connections to each other are new). Each "
            "payload's SHA-256 was compared on both workers; over mpi:// its bytes were checked to arrive over MPI. "
            "Above 1 in the last column(s): mpi:// moved it faster.")
    return [*c.md_table(header, rows), "", note]


def pair_summary_rows(result: dict) -> list[list[str]]:
    """``bench all``'s summary: the mpi:// pair against the tcp:// pair at the smallest and largest size, and
    a process outside the workers' worlds (socket-only over mpi://) against tcp:// at the largest."""
    by = _by(result)
    sizes = sorted({r["size"] for r in result["records"] if r["setup"] == "pair"})
    points = [("pair", "pair (LocalCluster workers)", s) for s in (sizes[:1] + sizes[-1:] if len(sizes) > 1 else sizes)]
    points += [("outsider", "outsider to worker (socket)", s) for s in sizes[-1:]]
    rows = []
    for setup, name, s in points:
        m, t = by.get((setup, "mpi", s)), by.get((setup, "tcp", s))
        if m and t:
            rows.append([f"{name} {c.format_size(s)}", "one-way us (median)",
                         f"{m['one_way_median_us']:.1f}", f"{t['one_way_median_us']:.1f}",
                         f"{c.ratio(t['one_way_median_us'], m['one_way_median_us'])} speedup"])
    stats = _move_stats(result)
    sizes = sorted({s for _, s in stats})
    if sizes and ("mpi", sizes[-1]) in stats and ("tcp", sizes[-1]) in stats:
        m, t = stats[("mpi", sizes[-1])]["transfer"], stats[("tcp", sizes[-1])]["transfer"]
        rows.append([f"fresh move between LocalCluster workers {c.format_size(sizes[-1])}", "transfer ms (median)",
                     f"{1e3 * m['median']:.1f}", f"{1e3 * t['median']:.1f}",
                     f"{c.ratio(t['median'], m['median'])} speedup"])
    return rows


# ----------------------------------------------------------------------------------------------
# form
# ----------------------------------------------------------------------------------------------


def _form_workers(text: str) -> list[int]:
    values = c.int_list_arg(text)
    if values[0] < 2:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: run_mpi forms a communicator of 2 workers or more")
    return values


@dataclass
class FormOptions:
    workers: list[int] = c.option(DEFAULT_FORM_WORKERS, "worker counts N, each a LocalCluster of N workers with 1 "
                                  "thread, then N + 1", _form_workers, "LIST", all="form_workers")
    repeat: int = c.option(DEFAULT_FORM_REPEAT, "warm calls; the report gives their median", c.positive_int, "N",
                           all="runs")
    chunk: int = c.option(1000, "elements per chunk of the int64 array (N chunks)", c.positive_int, "C")


def add_form_arguments(p: argparse.ArgumentParser) -> None:
    c.add_options(p, FormOptions)
    p.add_argument("--protocols", "--protocol", type=c.protocols_arg, default=["tcp"], metavar="LIST",
                   help="the LocalClusters' protocol(s): tcp (workers start MPI at the first run_mpi call) or mpi "
                   "(workers start MPI when they join the cluster) (default: tcp)")
    c.add_output_argument(p, "form.json and form.md")
    c.add_launch_arguments(p, FORM_TIMEOUT, "each LocalCluster job")


def form_for_all(args: argparse.Namespace) -> dict:
    """In ``bench all``: one protocol, tcp where all measures it."""
    return {"protocols": ["tcp" if "tcp" in args.protocols else args.protocols[0]]}


def collect_form(args: argparse.Namespace) -> dict:
    session = c.Session("form", args)
    cores = c.machine_info()["cpu_count"]
    steps = c.Steps("form", len(args.workers) * len(session.protocols))
    jobs = []
    with session:
        for p in session.protocols:
            for n in args.workers:
                steps.start(f"{c.label(p)} LocalCluster of {n} workers, then {n + 1} ({n + 1} to {n + 2} processes on "
                            f"{cores} cores): MPI init, first run_mpi call, {args.repeat} warm calls, scale-up")
                jobs.append(session.run(None, JOB, {**c.option_values(FormOptions, args), "what": "form",
                                                    "protocol": p, "workers": n}))
    machine = {k: v for k, v in jobs[0]["machine"].items() if k.startswith("mpi")}
    result = session.result(machine, summary=[_form_row(j) for j in jobs], jobs=jobs)
    session.write(result, render_form, None)
    return result


def _form_row(job: dict) -> dict:
    warm = [w["seconds"] for w in job["warm_calls"]]
    return {
        "protocol": job["protocol"],
        "workers": job["workers"],
        "processes": job["processes"],
        "mpi_init_s": job["mpi_init_s"],
        "first_call_s": job["first_call"]["seconds"],
        "warm_call_s": c.summary(warm),
        "warm_allreduce_s": c.summary(w["allreduce_s"] for w in job["warm_calls"]),
        "scale_up_call_s": job["scale_up"]["first_call"]["seconds"],
        "scale_up_new_worker_mpi_init_s": job["scale_up"]["new_worker_mpi_init_s"],
        "calls_checked": 2 + len(warm),
        "ok": all(x["ok"] for x in [job["first_call"], *job["warm_calls"], job["scale_up"]["first_call"]]),
    }


def render_form(result: dict) -> str:
    cfg = result["config"]
    header = ["N", "protocol", "processes on cores", "MPI init (s)", "first call (s)",
              f"warm call (ms, median of {cfg['repeat']})", "of which allreduce (ms)", "after scale-up to N+1 (s)",
              "new worker's MPI init (s)", "result"]
    cores = result["machine"].get("cpu_count")
    rows = []
    for r in result["summary"]:
        warm = r["warm_call_s"]
        rows.append([str(r["workers"]), c.label(r["protocol"]), f"{r['processes']} → {r['processes'] + 1} on {cores}",
                     c.fmt_s(r["mpi_init_s"]), c.fmt_s(r["first_call_s"]),
                     f"{1e3 * warm['median']:.0f} ({1e3 * warm['min']:.0f})",
                     f"{1e3 * r['warm_allreduce_s']['median']:.1f}", c.fmt_s(r["scale_up_call_s"]),
                     c.fmt_s(r["scale_up_new_worker_mpi_init_s"]),
                     f"ok ({r['calls_checked']} calls checked)" if r["ok"] else "**WRONG**"])
    notes = [
        "`mpi4dask.run_mpi(fn, x, workers=<all>)` on a `LocalCluster(protocol=P, n_workers=N, threads_per_worker=1, "
        f"processes=True)` (scheduler, client and nannies in one process + N workers: N+1 processes on {cores} cores, "
        f"then N+2 after the scale-up); x: a persisted int64 `da.arange` of N chunks of {cfg['chunk']}; fn returns "
        "`comm.allreduce` of the sum of its chunks. Every rank's answer equals the NumPy sum and every rank has the "
        "right rank and size, on every call. Times from the client, wall clock:",
        "**MPI init**: `client.run(handoff._worker_mpi_info)` on all N workers at once, after the scheduler's MPI "
        "service started (`pm.install_on_scheduler`); over mpi:// the workers started MPI when they joined, so this "
        "only waits for what is left. **first call**: the first run_mpi call (MPI already up): the N served worlds "
        "joined by recursive doubling, then fn. **warm call**: later calls on the same workers, which only Dup the "
        "formed communicator (median, min in parentheses; the workers' table of formed communicators was checked to "
        "hold 1 entry each); **of which allreduce**: the longest `comm.allreduce` inside fn over the ranks (waiting "
        "for the last rank included; median over the warm calls): the rest of a warm call is run_mpi's Dask round "
        "trips (locks, planning, start, results). "
        "**after scale-up**: `cluster.scale(N + 1)`, the new worker's MPI init (timed apart), "
        "then the first call over the N+1 workers: a new participant set, formed anew (checked: 2 formed "
        "communicators on the old workers).",
    ]
    lines = [c.header_line("form", result), "", *c.md_table(header, rows, left=2), "",
             " ".join([*notes, c.start_note(result),
                       c.job_loadavg_note([(f"{c.label(j['protocol'])} N={j['workers']}", j) for j in result["jobs"]]),
                       *c.run_notes(result)])]
    return "\n".join(lines)

