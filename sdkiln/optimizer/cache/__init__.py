"""Cache-schedule search: ``search`` (the cache_auto transform), ``plan`` (its error model and the
schedules it proposes), ``layout`` (what a schedule needs to know about a model). The schedule
format and the hooks that follow it are the runtime's (``sdkiln.runtime.cache``)."""
