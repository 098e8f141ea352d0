"""The ``mpi4dask`` command line: ``mpi4dask serve``, ``mpi4dask bench`` and ``mpi4dask stress``."""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpi4dask",
        description="Dask over MPI: launch clusters inside MPI jobs and benchmark the mpi:// transport.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import launcher

    launcher.add_serve_arguments(
        sub.add_parser(
            "serve",
            help="run a Dask cluster inside an MPI job (rank 0 scheduler, other ranks workers)",
            description="Run under `mpiexec -n N` (N >= 2): rank 0 runs the scheduler, ranks >= 1 run "
            "workers. Clients outside the job join with Client(scheduler_file=F).",
        )
    )

    from . import bench

    bench.add_bench_arguments(
        sub.add_parser(
            "bench",
            help="benchmark mpi:// against tcp:// (and raw MPI) side by side",
        )
    )
    bench.add_stress_arguments(
        sub.add_parser(
            "stress",
            help="stress mpi:// and run_mpi (many checksummed messages; workers killed at random); fails on any "
            "wrong, lost or hung answer",
        )
    )
    return parser


def _own_parsers(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command remembers its own parser, which reports the arguments it does not know with its
    own usage (argparse has the top-level parser report them, with the top-level usage)."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _own_parsers(child)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    _own_parsers(parser)
    args, extras = parser.parse_known_args(argv)
    own = vars(args).pop("_parser")  # (the commands record their arguments: no parser among them)
    if extras:
        own.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command == "serve":  # the launcher handles its own signals
        return int(args.func(args) or 0)
    from ._jobs import terminated_as_interrupted

    with terminated_as_interrupted():  # a job of the benchmark is not left running on SIGTERM
        return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
