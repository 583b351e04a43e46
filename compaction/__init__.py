"""Compaction: the bounded-memory offset map, multi-round compactor, planner and scheduler."""

from .assessment import Assessment, assess_partition
from .compactor import (CompactionOptions, CompactionResult, Compactor, DEFAULT_MAP_MEMORY,
                        partition_status)
from .damage import (REPAIR_HINT, Damage, Uncleanable, damage_in, find_damage, refusal,
                     unique)
from .errors import CompactionError
from .offset_map import OffsetMap
from .planner import (Candidate, Scheduler, assess, compact_store, damaged_result,
                      one_object_per_run, plan, roll_unheld)
from .throttle import CompactionStopped, IOBudget

__all__ = ["Assessment", "assess_partition", "CompactionOptions", "CompactionResult",
           "Compactor", "DEFAULT_MAP_MEMORY", "partition_status", "CompactionError", "OffsetMap",
           "REPAIR_HINT", "Damage", "Uncleanable", "damage_in", "damaged_result", "find_damage",
           "refusal",
           "unique",
           "Candidate", "CompactionStopped", "IOBudget", "Scheduler", "assess", "compact_store",
           "one_object_per_run", "plan", "roll_unheld"]
