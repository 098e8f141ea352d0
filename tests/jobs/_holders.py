"""The attempts of the jobs that kill a worker while another copies from it (holder_killed_mid_copy.py,
write_to_peer_dead_mid_copy.py), on a LocalCluster of 2 workers: worker R (the reader) stays the same
process throughout; each attempt gets the other worker H, a fresh one after each kill (its Nanny's
restart).  Runs in the job's client process only."""

import os


def reader(client) -> tuple[str, int]:
    """R's address and pid, once both workers are up."""
    client.wait_for_workers(2)
    R = sorted(client.scheduler_info()["workers"])[0]
    return R, client.run(os.getpid, workers=[R])[R]


def holders(client, R: str, delays):
    """Per delay: the delay, the current other worker H and its pid (waiting for the Nanny's new one)."""
    for delay in delays:
        client.wait_for_workers(2, timeout=60)
        (H,) = [w for w in client.scheduler_info()["workers"] if w != R]
        yield delay, H, client.run(os.getpid, workers=[H])[H]
