"""Compaction: the bounded-memory offset map, multi-round compactor, planner and scheduler."""

from .compactor import (CompactionOptions, CompactionResult, Compactor, DEFAULT_MAP_MEMORY,
                        partition_status)
from .errors import CompactionError
from .offset_map import OffsetMap
from .planner import (Candidate, CompactionStopped, IOBudget, Scheduler, assess,
                      compact_store, plan)

__all__ = ["CompactionOptions", "CompactionResult", "Compactor", "DEFAULT_MAP_MEMORY",
           "partition_status", "CompactionError", "OffsetMap", "Candidate", "CompactionStopped",
           "IOBudget", "Scheduler", "assess", "compact_store", "plan"]
