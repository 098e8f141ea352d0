"""The driver side of ``mpi4dask bench`` (private modules).

:mod:`mpi4dask.benchmarks` holds the command-line structure (one sub-command per entry of
``BENCHMARKS``) and ``comm``; this package holds what the benchmarks share (:mod:`.common`: sizes,
launching MPI jobs with timeouts, machine load, output files) and the other benchmarks:
:mod:`.apps` (``transpose-sum``, ``merge``), :mod:`.soak`, :mod:`.idle` and :mod:`.report`
(``all``).  Each launches its own MPI jobs, running the ``mpi4dask._bench_*_job`` modules.
"""
