"""Partitions found while following (new partitions, newly matching topics) are spread over a
connector's tasks round-robin, each read by exactly one task (framework/topic_watch.py,
PartitionClaims), however the tasks' checks interleave."""

from __future__ import annotations

import random
import threading

from kcompact.connectors.framework.api import TopicPartition
from kcompact.connectors.framework.topic_watch import PartitionClaims


def test_round_robin_continues_after_the_assignment_at_start():
    claims = PartitionClaims(3, assigned=4)  # tasks got 0,1,2,0 at start: next is task 1
    found = [TopicPartition("b", p) for p in range(4)] + [TopicPartition("c", 0)]
    mine = {task: claims.mine(task, found) for task in (2, 0, 1)}
    assert mine[1] == [TopicPartition("b", 0), TopicPartition("b", 3)]
    assert mine[2] == [TopicPartition("b", 1), TopicPartition("c", 0)]
    assert mine[0] == [TopicPartition("b", 2)]
    # found again (every task's watcher finds them): the same owners
    assert claims.mine(1, found[:2]) == [TopicPartition("b", 0)]


def test_every_partition_has_one_task_whatever_the_order_of_the_checks():
    rng = random.Random(7)
    for tasks in (1, 2, 3, 5):
        claims = PartitionClaims(tasks, assigned=rng.randrange(10))
        found = [TopicPartition(f"t{t}", p) for t in range(6) for p in range(rng.randrange(1, 5))]
        got: dict[int, list] = {}

        def task(i: int) -> None:
            seen = list(found)
            out = []
            rng_i = random.Random(i)
            for _ in range(3):  # checks that find overlapping parts, in another order
                part = rng_i.sample(seen, k=len(seen) // 2 + 1)
                out += claims.mine(i, part)
            out += claims.mine(i, seen)
            got[i] = out

        threads = [threading.Thread(target=task, args=(i,)) for i in range(tasks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        owners: dict[TopicPartition, set] = {}
        for i, tps in got.items():
            for tp in tps:
                owners.setdefault(tp, set()).add(i)
        assert set(owners) == set(found)
        assert all(len(o) == 1 for o in owners.values())
        counts = sorted(sum(1 for o in owners.values() if i in o) for i in range(tasks))
        assert counts[-1] - counts[0] <= 1  # spread evenly
