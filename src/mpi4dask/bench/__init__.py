"""``mpi4dask bench``: benchmarks of the ``mpi://`` transport against ``tcp://`` and raw MPI.

:data:`BENCHMARKS` is the one registry: one entry per sub-command of ``mpi4dask bench``, in the
order ``mpi4dask bench all`` runs them:

* ``tasks`` (:mod:`.tasks`): real Dask work (task throughput, a reduction, a 512 MiB gather) on
  ``mpi4dask.initialize()`` clusters, mpi:// and tcp:// side by side; every result checked.
* ``comm`` (:mod:`.comm`): ping-pong of one numpy array between 2 MPI ranks at the Dask comm level
  over mpi:// and tcp://, plus raw mpi4py ``Send``/``Recv`` as the limit; peak RSS of both ranks.
* ``transpose-sum``, ``merge`` and ``set-index`` (:mod:`.apps`): Dask applications per protocol and
  worker count (an array reduction; a merge and a ``set_index`` sort, each with the tasks and p2p
  shuffles), checked against NumPy / pandas.
* ``idle`` (:mod:`.idle`): the CPU time an idle cluster burns.
* ``pair`` and ``form`` (:mod:`.anycluster`): MPI in clusters that ``mpiexec`` did not start
  (``LocalCluster``): the comm ping-pong between two workers joined as an MPI pair, against two
  ranks of one ``mpiexec`` job and tcp://, then fresh payloads moved between them as Dask moves a
  task's dependency; ``run_mpi``'s formation and warm-call cost for N workers.
* ``all`` (:mod:`.report`): all of the above, one combined report (the ``tasks`` table first).

:data:`STRESS` holds the sub-commands of ``mpi4dask stress``, which measure correctness and
survival, not speed (``mpi4dask bench soak`` and ``chaos`` remain as deprecated aliases):

* ``soak`` (:mod:`.soak`): many connections, both directions at once, every message checksummed;
  any corrupted, lost, duplicated or out-of-order message fails the command.
* ``chaos`` (:mod:`.chaos`): workers SIGKILLed, added and retired at random while computations and
  ``run_mpi`` calls go on (LocalCluster, no mpiexec); every answer checked, hung and wrong calls
  counted.

Each benchmark module holds its driver (its options, declared once as a dataclass; running its
MPI jobs; the report) and its MPI job beside it (``python -m mpi4dask.bench.NAME_job --config
FILE --result FILE`` under ``mpiexec``: the driver hands it its options as JSON); :mod:`.common`
holds what the drivers share (options, sizes, launching jobs with a timeout and collecting their
JSON, ``--load``, progress, markdown tables, output files) and :mod:`.jobutil` what the jobs share.
Every benchmark prints a markdown report on stdout and progress on stderr (a bar on a terminal),
and with ``--output DIR`` writes JSON, markdown and PNG plots.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from . import anycluster, apps, chaos, comm, common, idle, report, soak, tasks


@dataclass(frozen=True)
class Benchmark:
    """One sub-command of ``mpi4dask bench`` or ``mpi4dask stress``.

    ``collect(args)`` runs it and returns its result (writing the ``--output`` files), raising
    :class:`~.common.BenchFailed` when it cannot; ``render(result)`` is its markdown report;
    ``failure(result)``, when given, names what makes a result a failure (exit status 1).  For
    ``bench all``: ``options`` (its options dataclass) says which options ``all`` takes for it,
    ``for_all(all_args)`` sets more of its arguments, ``summary_rows(result)`` are its rows of the
    summary, and ``lead`` puts its report before the summary.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    collect: Callable[[argparse.Namespace], dict]
    render: Callable[[dict], str]
    failure: Callable[[dict], str | None] | None = None
    options: type | None = None
    for_all: Callable[[argparse.Namespace], dict] = lambda args: {}
    summary_rows: Callable[[dict], list[list[str]]] = lambda result: []
    lead: bool = False

    def run(self, args: argparse.Namespace) -> int:
        return common.run_benchmark(self.name, self.collect, self.render, self.failure, args)


_PARTS = (
    Benchmark(
        "tasks",
        "real Dask work (client.map of 1000 tasks, a sum of an 8000 x 8000 random array, a 512 MiB gather) on "
        "mpi4dask.initialize() clusters, mpi:// and tcp:// side by side, every result checked",
        tasks.add_tasks_arguments, tasks.collect_tasks, tasks.render_tasks, options=tasks.TasksOptions,
        summary_rows=tasks.summary_rows, lead=True,
    ),
    Benchmark(
        "comm",
        "ping-pong one numpy array between 2 MPI ranks over mpi://, tcp:// and raw MPI Send/Recv; also the peak "
        "RSS of both ranks",
        comm.add_comm_arguments, comm.collect_comm, comm.render_comm_table, options=comm.CommOptions,
        summary_rows=comm.summary_rows,
    ),
    Benchmark(
        "transpose-sum",
        "time (x + x.T).sum() of a persisted N x N dask array on an mpi4dask.initialize() cluster per protocol and "
        "worker count, checked against NumPy",
        apps.add_transpose_arguments, apps.collect_transpose, apps.render_app, options=apps.TransposeOptions,
        summary_rows=apps.summary_rows,
    ),
    Benchmark(
        "merge",
        "time a dask.dataframe merge (tasks and p2p shuffles) per protocol and worker count, checked against pandas",
        apps.add_merge_arguments, apps.collect_merge, apps.render_app, options=apps.FrameOptions,
        summary_rows=apps.summary_rows,
    ),
    Benchmark(
        "set-index",
        "time a dask.dataframe set_index by a random key (a sort; tasks and p2p shuffles) per protocol and worker "
        "count, every partition checked against pandas and for its order",
        apps.add_set_index_arguments, apps.collect_set_index, apps.render_app, options=apps.FrameOptions,
        summary_rows=apps.summary_rows,
    ),
    Benchmark(
        "idle",
        "CPU time of an idle scheduler + client + 2 workers per protocol, and the peak RSS of the 64 MiB comm "
        "ping-pong",
        idle.add_idle_arguments, idle.collect_idle, idle.render_idle, options=idle.IdleOptions,
        for_all=lambda args: {"memory_size": max(args.sizes)},  # peak RSS at comm's largest size, transports alone
        summary_rows=idle.summary_rows,
    ),
    Benchmark(
        "pair",
        "the comm ping-pong between the 2 workers of a LocalCluster(protocol='mpi') (processes not launched by "
        "mpiexec, joined as an MPI pair), against 2 ranks of one mpiexec job and a tcp:// LocalCluster; then fresh "
        "payloads moved between the workers as Dask moves a task's dependency",
        anycluster.add_pair_arguments, anycluster.collect_pair, anycluster.render_pair, options=anycluster.PairOptions,
        for_all=anycluster.pair_for_all, summary_rows=anycluster.pair_summary_rows,
    ),
    Benchmark(
        "form",
        "run_mpi on a LocalCluster of N workers: MPI init in the workers, the first call (forming the communicator), "
        "warm calls (reusing it) and the first call after a scale-up to N+1, checked against NumPy",
        anycluster.add_form_arguments, anycluster.collect_form, anycluster.render_form,
        options=anycluster.FormOptions, for_all=anycluster.form_for_all,
    ),
)
_ALL = report.All({b.name: b for b in _PARTS})

#: name -> :class:`Benchmark`: the sub-commands of ``mpi4dask bench`` (the speed benchmarks, in the order
#: ``all`` runs them, then ``all``).
BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        *_PARTS,
        Benchmark("all", f"{', '.join(b.name for b in _PARTS)}, with one combined report (the tasks table first)",
                  _ALL.add_arguments, _ALL.collect, _ALL.render, _ALL.failure),
    )
}

#: name -> :class:`Benchmark`: the sub-commands of ``mpi4dask stress`` (correctness and survival, not speed).
STRESS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "soak",
            "many connections between 2 ranks, both directions at once, thousands of checksummed messages; fails "
            "on any corrupted, lost, duplicated or out-of-order message",
            soak.add_soak_arguments, soak.collect_soak, soak.render_soak, soak.soak_failure,
        ),
        Benchmark(
            "chaos",
            "workers killed, added and retired at random while computations and run_mpi(retries=3) calls go on, "
            "on a LocalCluster per protocol; counts calls right, failed with a clear error, wrong and hung (any "
            "wrong or hung call fails the command)",
            chaos.add_chaos_arguments, chaos.collect_chaos, chaos.render_chaos, chaos.chaos_failure,
        ),
    )
}


def _add_commands(parser: argparse.ArgumentParser, group: str, registry: dict, description: str,
                  aliases: dict | None = None) -> None:
    parser.description = description
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for bench in registry.values():
        p = sub.add_parser(bench.name, help=bench.help, description=bench.help)
        bench.add_arguments(p)
        p.set_defaults(func=bench.run)
    for name, bench in (aliases or {}).items():  # not listed in the help
        p = sub.add_parser(name, description=f"Deprecated: use mpi4dask stress {name}. {bench.help}")
        bench.add_arguments(p)
        p.set_defaults(func=partial(_deprecated, bench))
    parser.set_defaults(func=partial(_no_benchmark, parser, group, registry))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Give ``mpi4dask bench`` one sub-command per entry of :data:`BENCHMARKS` (and ``soak`` and ``chaos``,
    deprecated aliases of ``mpi4dask stress soak`` and ``chaos``)."""
    _add_commands(parser, "bench", BENCHMARKS, "Benchmarks of the mpi:// Dask transport against tcp:// and raw MPI.",
                  STRESS)


def add_stress_arguments(parser: argparse.ArgumentParser) -> None:
    """Give ``mpi4dask stress`` one sub-command per entry of :data:`STRESS`."""
    _add_commands(parser, "stress", STRESS, "Stress tests of the mpi:// transport and of run_mpi: they fail on any "
                  "wrong, lost or hung answer.")


def _deprecated(bench: Benchmark, args: argparse.Namespace) -> int:
    print(f"mpi4dask bench {bench.name} is deprecated: use mpi4dask stress {bench.name}", file=sys.stderr, flush=True)
    return bench.run(args)


def _no_benchmark(parser: argparse.ArgumentParser, group: str, registry: dict, args: argparse.Namespace) -> int:
    """Only reached if argparse lets ``mpi4dask bench`` through without a benchmark."""
    parser.print_usage(sys.stderr)
    print(f"mpi4dask {group}: choose a benchmark: {', '.join(registry)}", file=sys.stderr)
    return 2
