"""The computation every launcher job checks its cluster with (tests/test_launcher.py, tests/test_slurm.py).

``check(client, n_workers)`` computes on the cluster, checks the results against NumPy in the same process
and prints one line: ``CHECK exact=.. close=.. gathered=.. workers=.. protocols=..`` (read by
test_launcher.assert_check).
"""

import hashlib

import dask.array as da
import numpy as np


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def check(client, n_workers):
    client.wait_for_workers(n_workers, timeout=30)
    info = client.scheduler_info()
    rng = np.random.default_rng(20240607)
    a = rng.standard_normal((1200, 900))
    x = da.from_array(a, chunks=(300, 300))
    # elementwise + transpose + rechunk: exact, and chunks move between workers
    y = (2 * x + 1).T.rechunk((450, 400)).compute()
    exact = sha(y) == sha((2 * a + 1).T)
    # a reduction needing all-to-all traffic
    s = (x @ x.T).sum().compute()
    close = bool(np.isclose(s, (a @ a.T).sum(), rtol=1e-10))
    # data generated on the workers, gathered back whole
    z = da.arange(2_000_000, chunks=250_000).reshape(1000, 2000) * 3
    zsha = sha(z.compute()) == sha(np.arange(2_000_000).reshape(1000, 2000) * 3)
    names = sorted(str(w["name"]) for w in info["workers"].values())
    addrs = [client.scheduler.address] + list(info["workers"])
    print(f"CHECK exact={exact} close={close} gathered={zsha} workers={','.join(names)} "
          f"protocols={','.join(sorted({a.split('://')[0] for a in addrs}))}", flush=True)
