"""The comm handler of the job scripts' listeners (hostile_job.py, connections_pending_at_exit.py): it writes
back every message until the connection closes; the tests import it too (``conftest.echo``)."""

from distributed.comm import CommClosedError


def answering(reply):
    """A comm handler that writes ``await reply(msg)`` back for every message until the connection closes."""

    async def handler(comm):
        try:
            while True:
                await comm.write(await reply(await comm.read()))
        except CommClosedError:
            pass

    return handler


async def echo(comm):
    """A comm handler that writes back every message until the connection closes."""
    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass
