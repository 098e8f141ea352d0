"""``LocalCluster(protocol="mpi")`` with worker threads or processes computes right (tests/test_comm_mpi.py,
test_localcluster_protocol_mpi).

Usage: localcluster_mpi.py PROCESSES      (True or False)

Prints ``RESULT OK <sum>`` and ``WORKER COMMS <the comm types and MPI use of each worker's connections>``.
"""
import sys

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster


def uses(dask_worker):
    return sorted({type(c).__name__ + ':' + str(getattr(c, 'uses_mpi', None))
                   for comms in dask_worker.rpc.available.values() for c in comms})


if __name__ == '__main__':
    with LocalCluster(protocol='mpi', n_workers=2, threads_per_worker=1, processes=sys.argv[1] == 'True',
                      dashboard_address=None) as cluster, Client(cluster) as client:
        assert cluster.scheduler_address.startswith('mpi://'), cluster.scheduler_address
        x = da.random.default_rng(0).random((2000, 2000), chunks=(500, 500))
        got = (x + x.T).sum().compute()
        ref = np.asarray(x)
        ref = (ref + ref.T).sum()
        assert abs(got - ref) < 1e-6 * abs(ref), (got, ref)
        print('RESULT OK', got)
        print('WORKER COMMS', client.run(uses))
