"""A key-value map builder to be SIGKILLed by test_kv.py (run as a script; not a test module).

    python _kv_proc.py STORE TOPIC DB build|follow BATCH_BYTES

Runs ``MapBuilder`` with small write batches (many commits to land a kill between), prints
``ready`` once started and one line per progress message. ``build`` returns once the map has
caught up with the store; ``follow`` runs until killed.
"""

from __future__ import annotations

import sys

from kcompact.connectors.apps.kv import MapBuilder


def main() -> None:
    store, topic, db, mode, batch = sys.argv[1:6]
    b = MapBuilder(db, store, topic, batch_bytes=int(batch), memory=int(batch) * 8,
                   follow_batch_records=max(1, int(batch) // 200),
                   follow_batch_bytes=int(batch), poll_interval=0.01,
                   progress=lambda m: print(m, flush=True))
    print("ready", flush=True)
    b.run(follow=mode == "follow")
    print("done", flush=True)


if __name__ == "__main__":
    main()
