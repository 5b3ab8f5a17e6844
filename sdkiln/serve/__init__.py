"""``sdkiln serve``: a package behind OpenAI's images API (``docs/serving.md``).

``requests`` checks a request body; ``engine`` owns the pipeline, the bounded queue and the batching
worker; ``app`` is the FastAPI app; ``metrics`` the Prometheus counters; ``server`` loads a package,
warms it up and runs the app under uvicorn until SIGTERM drains it. The HTTP side needs the ``serve``
extra (FastAPI, uvicorn); nothing here is imported by ``sdkiln.load``."""
