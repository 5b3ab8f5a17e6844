"""Cache schedules at run time: the schedule format and the hooks that follow it."""

from sdkiln.runtime.cache.hooks import attach_cache, cache_runner, detach_cache, reset_cache
from sdkiln.runtime.cache.schedule import BATCHED, FULL, SCHEDULE_FILE, Action, BlockLayout, CacheSchedule

__all__ = [
    "BATCHED",
    "FULL",
    "SCHEDULE_FILE",
    "Action",
    "BlockLayout",
    "CacheSchedule",
    "attach_cache",
    "cache_runner",
    "detach_cache",
    "reset_cache",
]
