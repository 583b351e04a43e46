"""`kcompact demo`: the whole mission on one machine, in a few minutes."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from reput import Store

from .workload import Workload


def _step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def run_demo(args) -> int:
    from .cli import cmd_inspect

    workdir = args.workdir or tempfile.mkdtemp(prefix="kcompact-demo-")
    os.makedirs(workdir, exist_ok=True)
    store_path = os.path.join(workdir, "store")
    wl = Workload(records=args.records, keys=max(args.records // 10, 10), partitions=4)
    topic = "demo-users"

    _step(f"writing {wl.records} generated records ({wl.keys} keys, tombstones and keyless "
          f"records, {wl.partitions} partitions) into {store_path}")
    t0 = time.perf_counter()
    with Store.open(store_path, writer="demo", create=True) as st:
        for batch in wl.batches(topic):
            st.append(batch)
        st.flush()
    print(f"    done in {time.perf_counter() - t0:.2f}s")

    _step(f"kcompact inspect --store {store_path}")
    sys.stdout.flush()

    cmd_inspect(argparse.Namespace(store=store_path, topic=None, json=False, plot=None))
    print(f"\nDemo store left in {workdir}")
    return 0
