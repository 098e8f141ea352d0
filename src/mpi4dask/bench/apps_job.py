"""The MPI side of ``mpi4dask bench transpose-sum``, ``merge`` and ``set-index`` (private).

``mpiexec -n W+2 python -m mpi4dask.bench.apps_job --config FILE --result FILE`` runs
``mpi4dask.initialize(protocol=P, nthreads=1)``: rank 0 scheduler, ranks 2.. W workers, and rank 1
(the client) does the following, then ends the job by returning:

``transpose-sum``
    ``x = da.random.default_rng(seed).random((n, n), chunks=c).persist(); wait(x)``, then times
    ``(x + x.T).sum()`` (``client.compute(...).result()``) ``--warmup`` + ``--runs`` times.  The
    reference is NumPy's ``(xn + xn.T).sum()`` of the same array, generated on the client (the
    seeded generator makes the same blocks there); every run's result must match it (relative
    tolerance 1e-9: only the order of the additions differs).
``merge``
    Two frames of ``--rows`` rows in ``--partitions`` partitions each (``dd.from_map`` of a seeded
    pandas generator: int64 ``key`` uniform in 0..rows-1, a row id, a float), persisted; then per
    shuffle method times ``a.merge(b, on="key", shuffle_method=S)`` reduced to one summary row per
    partition (row count, sums of key and row ids, a checksum of which ids were paired), computed
    with ``.compute()``.  The reference is ``pandas.merge`` of the same frames on the client; the
    summary must match exactly (integers).
``set-index``
    One frame of ``--rows`` rows in ``--partitions`` partitions (the same generator as merge's left
    frame: int64 ``key`` uniform in 0..rows-1, an int64 row ``id``, a float ``v``), persisted.  Its
    divisions are the key's exact quantiles (P+1 order statistics of the same frame generated on the
    client: equal partitions, the same in every job; dask's own estimate, from sampled quantiles, is
    uneven and differs between jobs), passed to every run so that the runs time the shuffle and not
    a quantile pass.  Then per shuffle method times
    ``df.set_index("key", divisions=..., shuffle_method=S)`` (a sort by a random key: a row's new
    partition is random, so with W workers about (W-1)/W of the rows change worker) reduced on the
    workers to one summary row per partition (rows, sums of key and row ids, a checksum of every
    row's (id, key, v), min and max key, whether the index is sorted), computed with
    ``.compute()``.  The client checks that every partition is sorted, that the partitions' key
    ranges are in order without overlap and inside their divisions, and that every partition's
    summary equals the one pandas gives for the rows of the same frame (generated on the client)
    whose keys fall in that partition's division range: exact integers.

The persisted blocks / partitions are placed on the workers by a seeded, balanced assignment (the
same in every job with the same number of workers, so mpi:// and tcp:// move the same bytes), and
before every run the cluster is brought back to exactly that state: the scheduler has forgotten the
previous run's results and P2P shuffles, and the replicas the previous run made are dropped (the
Active Memory Manager is off in these jobs so that it does not move data during a run).  The workers'
``transfer_incoming_log``/``transfer_outgoing_log`` are cleared before and read after each run: the
bytes (``total``) and ``duration`` of every worker-to-worker transfer (P2P shuffles move their data
outside these logs).  Right before and right after each run the client reads the CPU time every
process of the job has used (the workers' split into their task threads, their event-loop thread and
the rest, from /proc): where the run's CPU went.

Rank 1 writes the JSON result (with ``"error"`` when a result is wrong, and then fails the job).
"""

from __future__ import annotations

import math
import sys
import time

from .jobutil import (
    BenchmarkError,
    Doing,
    cluster_label,
    connect_client,
    cpu_used,
    job_config,
    job_cpu,
    log,
    start_cluster,
    write_cluster_result,
)

SETTLE_TIMEOUT = 60.0

doing = Doing()


# ----------------------------------------------------------------------------------------------
# Functions that run on the scheduler and the workers (importable by name)
# ----------------------------------------------------------------------------------------------


def _scheduler_state(dask_scheduler, keys) -> dict:
    tasks = dask_scheduler.tasks
    replicas = sum(len(tasks[k].who_has or ()) if k in tasks else 0 for k in keys)
    shuffle = dask_scheduler.plugins.get("shuffle")
    return {
        "tasks": len(tasks),
        "replicas": replicas,
        "active_shuffles": len(getattr(shuffle, "active_shuffles", ()) or ()),
    }


def _holders(dask_scheduler, keys) -> dict:
    tasks = dask_scheduler.tasks
    return {k: sorted(ws.address for ws in (tasks[k].who_has or ())) for k in keys if k in tasks}


def _place(dask_scheduler, target: dict) -> int:
    """Ask the workers to hold each key exactly where ``target`` says; return the moves pending."""
    from collections import defaultdict

    acquire: dict = defaultdict(list)
    remove: dict = defaultdict(list)
    pending = 0
    for key, addr in target.items():
        ts = dask_scheduler.tasks.get(key)
        if ts is None or not ts.who_has:
            raise RuntimeError(f"persisted key {key!r} has no replica on any worker")
        holders = {ws.address for ws in ts.who_has}
        if addr not in holders:
            acquire[addr].append(key)
            pending += 1
        else:
            for other in holders - {addr}:
                remove[other].append(key)
                pending += 1
    stimulus = f"mpi4dask-bench-place-{time.time()}"
    for addr, keys in acquire.items():
        dask_scheduler.request_acquire_replicas(addr, keys, stimulus_id=stimulus)
    for addr, keys in remove.items():
        dask_scheduler.request_remove_replicas(addr, keys, stimulus_id=stimulus)
    return pending


def _clear_transfer_logs(dask_worker) -> None:
    dask_worker.transfer_incoming_log.clear()
    dask_worker.transfer_outgoing_log.clear()


def _transfer_logs(dask_worker) -> dict:
    inc = list(dask_worker.transfer_incoming_log)
    out = list(dask_worker.transfer_outgoing_log)
    return {
        "incoming_count": len(inc),
        "incoming_bytes": sum(int(e.get("total", 0)) for e in inc),
        "incoming_seconds": sum(float(e.get("duration", 0.0)) for e in inc),
        "outgoing_count": len(out),
        "outgoing_bytes": sum(int(e.get("total", 0)) for e in out),
        "outgoing_seconds": sum(float(e.get("duration", 0.0)) for e in out),
    }


def _rows_per_partition(rows: int, parts: int) -> list[int]:
    """How ``rows`` rows are split over ``parts`` partitions (as evenly as ``numpy.array_split``)."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def _merge_part(i: int, rows: list, seed: int, side: int):
    """Partition ``i`` of frame ``side`` (0 = left, 1 = right): the same on every process."""
    import numpy as np
    import pandas as pd

    n = rows[i]
    start = sum(rows[:i])
    rng = np.random.default_rng([seed, side, i])
    total = sum(rows)
    name = "ab"[side]
    return pd.DataFrame(
        {
            "key": rng.integers(0, max(total, 1), size=n, dtype=np.int64),
            f"i{name}": np.arange(start, start + n, dtype=np.int64),
            f"v{name}": rng.random(n),
        }
    )


def _merge_summary(df):
    """One row per partition: exact integer checksums of a merged partition."""
    import numpy as np
    import pandas as pd

    ia = df["ia"].to_numpy(dtype=np.int64)
    ib = df["ib"].to_numpy(dtype=np.int64)
    pair = (ia * 1_000_003 + ib) % 2_147_483_647  # which ids were paired (each term < 2**31)
    return pd.DataFrame(
        {
            "rows": [len(df)],
            "sum_key": [int(df["key"].to_numpy(dtype=np.int64).sum())],
            "sum_ia": [int(ia.sum())],
            "sum_ib": [int(ib.sum())],
            "pair_checksum": [int(pair.sum())],
        }
    )


_P31 = 2_147_483_647  # a prime below 2**31: the row checksums' modulus


def _set_index_part(i: int, rows: list, seed: int):
    """Partition ``i`` of set-index's frame (merge's left frame, its columns named key, id, v)."""
    return _merge_part(i, rows, seed, 0).rename(columns={"ia": "id", "va": "v"})


def _row_checksum(key, ids, v):
    """One integer per row, below 2**31, from its key, id and the bits of its float (so a row whose
    columns were separated or changed shows); every product stays below 2**63."""
    import numpy as np

    h = (ids.astype(np.int64) * 1_000_003 + key.astype(np.int64)) % _P31
    return (h * 1_000_033 + np.ascontiguousarray(v, dtype=np.float64).view(np.int64) % _P31) % _P31


#: set-index's per-partition summary: ``min_key``/``max_key`` are -1 for an empty partition (keys are >= 0).
SET_INDEX_COLUMNS = ("rows", "sum_key", "sum_id", "checksum", "min_key", "max_key", "sorted")


def _set_index_summary(df):
    """One row per partition of ``df.set_index("key")``: exact integer checksums and order facts."""
    import numpy as np
    import pandas as pd

    key = df.index.to_numpy(dtype=np.int64)
    ids = df["id"].to_numpy(dtype=np.int64)
    empty = len(df) == 0
    return pd.DataFrame(
        {
            "rows": [len(df)],
            "sum_key": [int(key.sum())],
            "sum_id": [int(ids.sum())],
            "checksum": [int(_row_checksum(key, ids, df["v"].to_numpy()).sum())],
            "min_key": [-1 if empty else int(key.min())],
            "max_key": [-1 if empty else int(key.max())],
            "sorted": [int(df.index.is_monotonic_increasing)],
        },
        columns=list(SET_INDEX_COLUMNS),
    )


def _set_index_divisions(keys, nparts: int) -> list[int]:
    """``nparts + 1`` exact quantiles of ``keys`` (order statistics): from the smallest key to the
    largest, unique but for the last (what dask accepts as divisions; a repeated one would make fewer
    partitions)."""
    import numpy as np

    ordered = np.sort(np.asarray(keys, dtype=np.int64))
    picks = [int(ordered[(j * (len(ordered) - 1)) // nparts]) for j in range(nparts + 1)]
    return sorted(set(picks[:-1])) + picks[-1:]


def _set_index_reference(pdf, divisions: list) -> list[dict]:
    """The summary every partition of ``set_index("key", divisions=divisions)`` must have, from the
    whole frame in pandas: a row goes to partition ``searchsorted(divisions, key, "right") - 1``, a key
    at or past the last division to the last partition (dask's rule); each partition sorted by key."""
    import numpy as np

    nparts = len(divisions) - 1
    part = np.searchsorted(np.asarray(divisions, dtype=np.int64), pdf["key"].to_numpy(), side="right") - 1
    part[(part < 0) | (part >= nparts)] = nparts - 1
    out = []
    for i in range(nparts):
        rows = pdf[part == i].set_index("key").sort_index()
        out.append({k: int(v) for k, v in _set_index_summary(rows).iloc[0].items()})
    return out


def _set_index_order(parts: list[dict], divisions: list) -> str:
    """What is wrong with the order of a set_index result's partitions ('' when nothing): every
    partition sorted, its keys inside its division range, the ranges increasing without overlap."""
    problems = []
    last = None  # (partition, max key) of the last non-empty partition
    for i, p in enumerate(parts):
        if not p["sorted"]:
            problems.append(f"partition {i} is not sorted by key")
        if not p["rows"]:
            continue
        lo, hi = divisions[i], divisions[i + 1]
        final = i == len(parts) - 1
        if p["min_key"] < lo or (p["max_key"] > hi if final else p["max_key"] >= hi):
            problems.append(f"partition {i} holds keys {p['min_key']}..{p['max_key']}, outside its division "
                            f"range {lo}..{hi}")
        if last is not None and p["min_key"] <= last[1]:
            problems.append(f"partition {i} starts at key {p['min_key']}, not after partition {last[0]}'s "
                            f"last key {last[1]}")
        last = (i, p["max_key"])
    return "; ".join(problems)


# ----------------------------------------------------------------------------------------------
# The client side
# ----------------------------------------------------------------------------------------------


def _flat_keys(collection) -> list:
    """The keys of the futures a persisted collection holds, in a reproducible order."""
    from distributed import futures_of

    return sorted({f.key for f in futures_of(collection)}, key=repr)


def _placement(client, keys, seed: int) -> dict:
    """A fixed, balanced, seeded assignment of the persisted keys to the workers (sorted by rank),
    the same in every job with the same worker count whatever the protocol."""
    import numpy as np

    info = client.scheduler_info(n_workers=-1)["workers"]
    workers = sorted(info, key=lambda a: (str(info[a].get("name")), a))
    order = np.random.default_rng([seed, 99]).permutation(len(keys))
    return {key: workers[int(order[i]) % len(workers)] for i, key in enumerate(keys)}


def _settle(client, target: dict, baseline: int) -> None:
    """Wait until the scheduler has forgotten everything from earlier runs (results, P2P shuffles)
    and the persisted data sits exactly where ``target`` puts it, one replica per key."""
    keys = list(target)
    deadline = time.monotonic() + SETTLE_TIMEOUT
    delay = 0.005
    while True:
        st = client.run_on_scheduler(_scheduler_state, keys=keys)
        if st["tasks"] <= baseline and not st["active_shuffles"]:
            pending = client.run_on_scheduler(_place, target=target)
            if not pending:
                return
        if time.monotonic() > deadline:
            raise BenchmarkError(
                f"the cluster did not return to its state before the run within {SETTLE_TIMEOUT:g} s: "
                f"{st['tasks']} tasks (want {baseline}), {st['replicas']} replicas of {len(keys)} persisted "
                f"keys, {st['active_shuffles']} active P2P shuffles"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _count_placement(client, target: dict) -> list[int]:
    """Persisted keys per worker (sorted by rank), checked against ``target``."""
    holders = client.run_on_scheduler(_holders, keys=list(target))
    wrong = {k: h for k, h in holders.items() if h != [target[k]]}
    if wrong or len(holders) != len(target):
        raise BenchmarkError(f"the persisted data is not where it was placed: {str(wrong)[:300]}")
    per: dict = {}
    for addr in target.values():
        per[addr] = per.get(addr, 0) + 1
    info = client.scheduler_info(n_workers=-1)["workers"]
    return [per.get(a, 0) for a in sorted(info, key=lambda a: (str(info[a].get("name")), a))]


def _sum_logs(logs: dict) -> dict:
    out: dict = {}
    for per in logs.values():
        for k, v in per.items():
            out[k] = out.get(k, 0) + v
    return out


def _place_seeded(client, keys, seed: int) -> tuple[dict, int, float, list[int]]:
    """Place the persisted ``keys`` by the seeded assignment: (target, baseline task count, seconds,
    keys per worker)."""
    baseline = client.run_on_scheduler(_scheduler_state, keys=keys)["tasks"]
    target = _placement(client, keys, seed)
    t0 = time.perf_counter()
    _settle(client, target, baseline)
    return target, baseline, time.perf_counter() - t0, _count_placement(client, target)


def _timed_runs(app, label, client, target, baseline, compute, check, warmup, runs) -> list[dict]:
    records = []
    for i in range(warmup + runs):
        timed = i >= warmup
        name = f"run {i - warmup + 1}/{runs}" if timed else f"warm-up {i + 1}/{warmup}"
        doing(f"{label}: settling before {name}")
        _settle(client, target, baseline)
        client.run(_clear_transfer_logs)
        doing(f"{label}: {name}")
        cpu = job_cpu(client)
        t0 = time.perf_counter()
        value = compute()
        seconds = time.perf_counter() - t0
        cpu = cpu_used(cpu, job_cpu(client))
        transfers = _sum_logs(client.run(_transfer_logs))
        ok, detail = check(value)
        rec = {"timed": timed, "seconds": seconds, "value": value, "ok": ok, "transfers": transfers, "cpu": cpu}
        if not ok:
            rec["error"] = detail
        records.append(rec)
        moved = transfers.get("incoming_bytes", 0)
        log(app, f"{label}: {name}: {seconds:.3f} s, {moved / 1e6:.0f} MB moved between workers "
                  f"({transfers.get('incoming_count', 0)} transfers), result {'ok' if ok else 'WRONG: ' + detail}")
    return records


def transpose_sum(client, args) -> dict:
    import dask.array as da
    import numpy as np
    from distributed import wait

    n, c = args.n, args.chunk
    label = cluster_label(args)
    doing(f"{label}: creating x")
    t0 = time.perf_counter()
    x = da.random.default_rng(args.seed).random((n, n), chunks=c).persist()
    wait(x)
    create_s = time.perf_counter() - t0
    keys = _flat_keys(x)
    target, baseline, place_s, placement = _place_seeded(client, keys, args.seed)
    log("transpose-sum", f"{label}: x = {n}x{n} float64 in {c}x{c} chunks ({len(keys)} blocks, "
                          f"{n * n * 8 / 1e6:.0f} MB) persisted in {create_s:.1f} s, placed (seeded) in "
                          f"{place_s:.1f} s; blocks per worker {placement}")
    expr = (x + x.T).sum()

    def compute():
        fut = client.compute(expr)
        try:
            return float(fut.result())
        finally:
            fut.release()

    results: dict = {}

    def check_later(value):  # the reference comes after the timed runs (it would compete for the CPUs)
        results.setdefault("values", []).append(value)
        return True, ""

    runs = _timed_runs("transpose-sum", label, client, target, baseline, compute, check_later, args.warmup, args.runs)
    doing(f"{label}: NumPy reference")
    t0 = time.perf_counter()
    xn = da.random.default_rng(args.seed).random((n, n), chunks=c).compute(scheduler="sync")
    reference = float(np.add(xn, xn.T).sum())
    del xn
    ref_s = time.perf_counter() - t0
    for rec in runs:
        ok = math.isclose(rec["value"], reference, rel_tol=1e-9, abs_tol=1e-9)
        rec["ok"] = ok
        if not ok:
            rec["error"] = f"(x + x.T).sum() = {rec['value']!r}, NumPy reference {reference!r}"
    bad = [r for r in runs if not r["ok"]]
    log("transpose-sum", f"{label}: NumPy reference {reference!r} ({ref_s:.1f} s): "
                          + ("every run matches" if not bad else f"{len(bad)} run(s) WRONG"))
    return {
        "variants": [{"variant": "transpose-sum", "runs": runs}],
        "check": {
            "reference": reference,
            "method": "NumPy (xn + xn.T).sum() of the same seeded array generated on the client; "
                      "relative tolerance 1e-9",
            "ok": not bad,
        },
        "setup": {"create_s": create_s, "place_s": place_s, "reference_s": ref_s, "blocks": len(keys),
                  "blocks_per_worker": placement},
        "array_bytes": n * n * 8,
    }


def merge(client, args) -> dict:
    import dask.dataframe as dd
    import pandas as pd
    from distributed import wait

    label = cluster_label(args)
    parts = args.partitions
    rows = _rows_per_partition(args.rows, parts)
    doing(f"{label}: creating the frames")
    t0 = time.perf_counter()
    frames = []
    for side in (0, 1):
        meta = _merge_part(0, [0] * parts, args.seed, side)
        frames.append(dd.from_map(_merge_part, range(parts), rows=rows, seed=args.seed, side=side, meta=meta,
                                  enforce_metadata=False).persist())
    wait(frames)
    create_s = time.perf_counter() - t0
    keys = _flat_keys(frames[0]) + _flat_keys(frames[1])
    target, baseline, place_s, placement = _place_seeded(client, keys, args.seed)
    log("merge", f"{label}: 2 frames of {args.rows} rows x {parts} partitions persisted in {create_s:.1f} s, "
                  f"placed (seeded) in {place_s:.1f} s; partitions per worker {placement}")

    doing(f"{label}: pandas reference")
    t0 = time.perf_counter()
    pa = pd.concat([_merge_part(i, rows, args.seed, 0) for i in range(parts)], ignore_index=True)
    pb = pd.concat([_merge_part(i, rows, args.seed, 1) for i in range(parts)], ignore_index=True)
    ref_row = _merge_summary(pa.merge(pb, on="key")).iloc[0]
    reference = {k: int(v) for k, v in ref_row.items()}
    del pa, pb
    ref_s = time.perf_counter() - t0
    log("merge", f"{label}: pandas reference: {reference['rows']} merged rows ({ref_s:.1f} s)")

    def check(value):
        if value == reference:
            return True, ""
        diff = {k: (value.get(k), reference[k]) for k in reference if value.get(k) != reference[k]}
        return False, f"merge summary differs from pandas (got, want): {diff}"

    meta = _merge_summary(pd.DataFrame({"key": [0], "ia": [0], "ib": [0]})).iloc[:0]
    variants = []
    for method in args.shuffle:
        merged = frames[0].merge(frames[1], on="key", shuffle_method=method)
        expr = merged.map_partitions(_merge_summary, meta=meta)

        def compute(expr=expr):
            out = expr.compute()
            return {k: int(v) for k, v in out.sum().items()}

        runs = _timed_runs("merge", f"{label}, shuffle {method}", client, target, baseline, compute, check,
                           args.warmup, args.runs)
        variants.append({"variant": method, "runs": runs})
    bad = [r for v in variants for r in v["runs"] if not r["ok"]]
    return {
        "variants": variants,
        "check": {
            "reference": reference,
            "method": "pandas merge of the same frames on the client: row count, sums of key and row ids, "
                      "pairing checksum, compared exactly",
            "ok": not bad,
        },
        "setup": {"create_s": create_s, "place_s": place_s, "reference_s": ref_s, "rows_per_partition": rows,
                  "partitions_per_worker": placement},
    }


def set_index(client, args) -> dict:
    import dask.dataframe as dd
    import pandas as pd
    from distributed import wait

    label = cluster_label(args)
    parts = args.partitions
    rows = _rows_per_partition(args.rows, parts)
    doing(f"{label}: creating the frame")
    t0 = time.perf_counter()
    meta = _set_index_part(0, [0] * parts, args.seed)
    df = dd.from_map(_set_index_part, range(parts), rows=rows, seed=args.seed, meta=meta,
                     enforce_metadata=False).persist()
    wait(df)
    create_s = time.perf_counter() - t0
    keys = _flat_keys(df)
    target, baseline, place_s, placement = _place_seeded(client, keys, args.seed)
    log("set-index", f"{label}: a frame of {args.rows} rows x {parts} partitions persisted in {create_s:.1f} s, "
                      f"placed (seeded) in {place_s:.1f} s; partitions per worker {placement}")

    doing(f"{label}: pandas reference")
    t0 = time.perf_counter()
    pdf = pd.concat([_set_index_part(i, rows, args.seed) for i in range(parts)], ignore_index=True)
    divisions = _set_index_divisions(pdf["key"].to_numpy(), parts)
    reference = _set_index_reference(pdf, divisions)
    totals = {k: sum(p[k] for p in reference) for k in ("rows", "sum_key", "sum_id", "checksum")}
    whole = {"rows": len(pdf), "sum_key": int(pdf["key"].sum()), "sum_id": int(pdf["id"].sum()),
             "checksum": int(_row_checksum(pdf["key"].to_numpy(), pdf["id"].to_numpy(), pdf["v"].to_numpy()).sum())}
    del pdf
    ref_s = time.perf_counter() - t0
    disorder = _set_index_order(reference, divisions)
    if totals != whole or disorder:  # the reference itself must be whole and in order
        raise BenchmarkError(f"the pandas reference is inconsistent: its partitions sum to {totals}, the frame has "
                             f"{whole}; {disorder or 'in order'}")
    log("set-index", f"{label}: pandas reference: {whole['rows']} rows in {len(reference)} partitions (divisions "
                      f"{divisions[0]}..{divisions[-1]}), {min(p['rows'] for p in reference)}.."
                      f"{max(p['rows'] for p in reference)} rows each ({ref_s:.1f} s)")

    def check(value):
        problems = []
        got = value["partitions"]
        if value["totals"] != whole:
            diff = {k: (value["totals"].get(k), whole[k]) for k in whole if value["totals"].get(k) != whole[k]}
            problems.append(f"totals differ from pandas (got, want): {diff}")
        if len(got) != len(reference):
            problems.append(f"{len(got)} partitions, want {len(reference)}")
        else:
            order = _set_index_order(got, divisions)
            if order:
                problems.append(order)
            diff = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
            if diff:
                i = diff[0]
                problems.append(f"{len(diff)} partition(s) differ from pandas, first {i}: got {got[i]}, want "
                                f"{reference[i]}")
        return not problems, "; ".join(problems)

    summary_meta = _set_index_summary(meta.set_index("key")).iloc[:0]
    variants = []
    for method in args.shuffle:
        indexed = df.set_index("key", divisions=divisions, shuffle_method=method)
        expr = indexed.map_partitions(_set_index_summary, meta=summary_meta)

        def compute(expr=expr):
            out = expr.compute()
            partitions = [{k: int(v) for k, v in row.items()} for row in out.to_dict(orient="records")]
            totals = {k: sum(p[k] for p in partitions) for k in ("rows", "sum_key", "sum_id", "checksum")}
            return {"totals": totals, "partitions": partitions}

        runs = _timed_runs("set-index", f"{label}, shuffle {method}", client, target, baseline, compute, check,
                           args.warmup, args.runs)
        variants.append({"variant": method, "runs": runs})
    bad = [r for v in variants for r in v["runs"] if not r["ok"]]
    return {
        "variants": variants,
        "check": {
            "reference": {"totals": whole, "partitions": reference},
            "divisions": divisions,  # the key's exact quantiles, from the frame generated on the client
            "method": "per partition: rows, sums of key and row ids, a checksum of every row's (id, key, v), min and "
                      "max key and sortedness, computed on the workers, equal to pandas' for the rows of the same "
                      "frame whose keys fall in the partition's division range; partitions sorted, their key ranges "
                      "in order without overlap",
            "ok": not bad,
        },
        "setup": {"create_s": create_s, "place_s": place_s, "reference_s": ref_s,
                  "rows_per_partition": rows, "partitions_per_worker": placement},
    }


APPS = {"transpose-sum": transpose_sum, "merge": merge, "set-index": set_index}


def client_main(args) -> int:
    with connect_client(doing, args.workers) as client:
        t0 = time.perf_counter()
        body = APPS[args.app](client, args)
        bad = [r["error"] for v in body["variants"] for r in v["runs"] if not r["ok"]]
        write_cluster_result(args.app, args, body, bad, time.perf_counter() - t0)
    return 0


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = job_config("mpi4dask.bench.apps_job", argv)
    import dask

    # The benchmark places the persisted data itself and restores that placement before every run;
    # the Active Memory Manager (on by default, every 2 s) would drop replicas behind its back.
    dask.config.set({"distributed.scheduler.active-memory-manager.start": False})
    args.workers = start_cluster(args.app, args, doing)  # only rank 1 returns
    return client_main(args)


if __name__ == "__main__":
    from mpi4dask.bench.apps_job import main as _main  # functions pickle by their importable name

    sys.exit(_main())
