"""A stand-in daemon for the SIGKILL test: holds the state directory's lock as
docs/reference/contracts.md says, leases N sandboxes from a pool, prints READY and their ids,
then waits to be killed.

    python fake_daemon.py STATE_DIR INSTANCE_ID N
"""

import fcntl
import json
import os
import sys
import time

import trio

from fleetrl.sandboxes import DEFAULT_IMAGE, Ownership, WarmPolicy, open_sandbox_pool


async def main(state_dir: str, instance_id: str, n: int) -> None:
    lock = os.open(os.path.join(state_dir, "daemon.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the live daemon holds it for its whole life
    with open(os.path.join(state_dir, "instance.json"), "w") as f:
        json.dump({"instance_id": instance_id, "pid": os.getpid(), "started_at": time.time()}, f)
    own = Ownership.for_state_dir(state_dir, owner=instance_id)
    policy = WarmPolicy(min_warm=0, max_warm=0, max_containers=n)
    async with open_sandbox_pool(own, policy=policy) as pool:
        ids: list[str] = []
        ready = trio.Event()

        async def hold() -> None:
            async with pool.lease(DEFAULT_IMAGE) as sb:
                ids.append(sb.id)
                if len(ids) == n:
                    ready.set()
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(hold)
            await ready.wait()
            print("READY " + " ".join(ids), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
