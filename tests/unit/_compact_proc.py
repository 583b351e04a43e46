"""Helper for test_compaction_crash.py: runs forced compactions that the test SIGKILLs.

    python _compact_proc.py run STORE NOW_MS MAP_BYTES MAX_LOAD
        open STORE (read-only, as `kcompact compact` does), print "ready", run a forced
        compaction of every partition, print "done".

    python _compact_proc.py serve
        a fork server, so that a trial does not pay interpreter and kernel start-up: reads
        commands on stdin, one a line, and answers on stdout:
          go STORE NOW_MS MAP_BYTES MAX_LOAD  -> forks a child that prints "ready PID",
                                                 compacts, prints "done PID" and exits
          reap PID                            -> waits for that child: "exit PID STATUS"
          warm STORE NOW_MS MAP_BYTES MAX_LOAD -> compacts in the server itself (loads the
                                                 compiled kernels once, for every child)
          quit
        A child is reaped only when asked, so its pid stays reserved (a zombie at worst)
        until the test has sent its SIGKILL.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kcompact.compaction import CompactionOptions, Compactor  # noqa: E402
from kcompact.reput.config import ManualClock  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402

TOPIC = "t"


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def options(map_bytes: int, max_load: float) -> CompactionOptions:
    """Small map, small I/O steps: many rounds, many swaps, many points to crash at."""
    return CompactionOptions(offset_map_memory=map_bytes, max_load=max_load,
                             io_chunk_bytes=1 << 16, index_chunk_entries=256)


def compact(store_dir: str, now_ms: int, map_bytes: int, max_load: float) -> None:
    """A forced compaction of every partition, as `kcompact compact --force` runs it."""
    clock = ManualClock(now_ms)
    store = Store.open(store_dir, clock=clock)
    c = Compactor(store, options(map_bytes, max_load), clock)
    for p in store.partitions(TOPIC):
        r = c.compact_partition(TOPIC, p, force=True)
        assert r.skipped is None, r.skipped
        store.release_partition(TOPIC, p)


def serve() -> None:
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            return
        if cmd[0] == "reap":
            pid = int(cmd[1])
            _, status = os.waitpid(pid, 0)
            say(f"exit {pid} {status}")
            continue
        if cmd[0] == "warm":
            compact(cmd[1], int(cmd[2]), int(cmd[3]), float(cmd[4]))
            say("warm")
            continue
        if cmd[0] == "go":
            store_dir, now_ms, map_bytes, max_load = cmd[1], int(cmd[2]), int(cmd[3]), \
                float(cmd[4])
            pid = os.fork()
            if pid == 0:
                try:
                    me = os.getpid()
                    say(f"ready {me}")
                    compact(store_dir, now_ms, map_bytes, max_load)
                    say(f"done {me}")
                    os._exit(0)
                except BaseException as e:  # noqa: BLE001 (report, then die)
                    say(f"error {os.getpid()} {type(e).__name__}: {e}".replace("\n", " "))
                    os._exit(3)
            continue
        say(f"unknown {line.strip()}")


def main() -> int:
    if sys.argv[1] == "serve":
        say("serving")
        serve()
        return 0
    if sys.argv[1] == "run":
        say("ready")
        compact(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        say("done")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
