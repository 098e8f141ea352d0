"""The comm handler of the job scripts' listeners (hostile_job.py, connections_pending_at_exit.py): it writes
back every message until the connection closes, as ``conftest.echo`` does in the test process."""

from distributed.comm import CommClosedError


async def echo(comm):
    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass
