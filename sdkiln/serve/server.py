"""Load, warm up and serve a package (``sdkiln serve``), and under ``torchrun`` make the other ranks
follow rank 0's batches.

Start-up: the port is checked, the package is loaded (its digest checked when given), the LoRAs named
on the command line are loaded as adapters (off until a request asks for them), and one warm-up
generation runs at the default size and steps (it also fixes the default size of a pipeline that takes
none). Only then does uvicorn listen and ``/health`` answer 200.

SIGTERM (or Ctrl-C) drains: new requests and ``/health`` get 503 ``draining`` while the worker answers
the accepted ones, for up to ``grace_s``; what is left then gets 503. Then uvicorn stops and the process
exits 0, or 1 when not every accepted request was answered. A second signal stops at once.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sdkiln.errors import SdkilnError

log = logging.getLogger("sdkiln.serve")
MAX_BODY = 64 * 1024
"""The largest request body taken (a prompt is at most 4000 characters)."""


@dataclass
class ServeConfig:
    package: str
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    compile: bool = False
    max_batch: int = 4
    max_queue: int = 64
    batch_window_ms: float = 10.0
    request_timeout_s: float = 300.0
    grace_s: float = 30.0
    loras: list[tuple[str, str]] = field(default_factory=list)
    """(adapter name, safetensors path)."""
    sizes: list[tuple[int, int]] = field(default_factory=list)
    """(width, height) served besides the default."""
    max_steps: int | None = None
    digest: str | None = None
    max_body: int = MAX_BODY
    cfg_parallel: bool = False
    ulysses: int = 1
    ring: int = 1


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s sdkiln.serve %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def build(config: ServeConfig, parallel=None):
    """(engine, limits, model name): the package loaded and warmed up, ready to serve."""
    from sdkiln import kernels
    from sdkiln.runtime import load
    from sdkiln.serve.engine import Call, Engine
    from sdkiln.serve.requests import Limits

    device = kernels.resolve_device(config.device)
    compile_config = None
    if config.compile:
        from sdkiln.configs.runtime import CompileConfig

        compile_config = CompileConfig(regional=True)
    started = time.perf_counter()
    pipe = load(
        config.package, device=device, digest=config.digest, compile=compile_config, parallel=parallel
    )
    manifest = pipe.sdkiln_manifest
    from sdkiln.model_zoo import get_spec

    spec = get_spec(manifest["model"]["family"], manifest["model"].get("variant"))
    if spec.frame_step is not None:
        raise SdkilnError(f"sdkiln serve serves image packages; {spec.family} makes video")
    if spec.image_required:
        raise SdkilnError(
            f"sdkiln serve serves text-to-image packages; {spec.family} generates from an image"
        )
    names = []
    for name, path in config.loras:
        pipe.load_lora_weights(path, adapter_name=name)
        names.append(name)
    params = inspect.signature(pipe.__call__).parameters
    takes_size = "height" in params and "width" in params
    if config.sizes and not takes_size:
        raise SdkilnError(f"--size: {spec.family}'s pipeline takes no height and width; it makes one size")
    for w, h in config.sizes:
        if w % spec.size_multiple or h % spec.size_multiple:
            raise SdkilnError(f"--size {w}x{h}: {spec.family} needs multiples of {spec.size_multiple}")
    main = parallel is None or pipe.sdkiln_parallel.mesh.is_main
    follow = _leader() if parallel is not None else None
    engine = Engine(
        pipe,
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        window_s=config.batch_window_ms / 1000,
        takes_size=takes_size,
        follow=follow,
    )
    defaults = engine.defaults
    steps = int(defaults.get("num_inference_steps", 28))
    # a cache schedule maps to fewer steps than it was searched for, never to more (runtime.cache.schedule)
    cached = manifest.get("cache_schedule") is not None or any(
        isinstance(e, dict) and e.get("cache_schedule") for e in (manifest.get("experts") or {}).values()
    )
    max_steps = steps if cached else 2 * steps
    if config.max_steps is not None and cached and config.max_steps > steps:
        raise SdkilnError(
            f"--max-steps {config.max_steps}: the package's cache schedule was searched for {steps} steps and runs "
            "no more"
        )
    # the warm-up: one image at the default size and steps, which also tells a fixed-size pipeline's size
    call = Call([spec.calibration_prompts[0]], [0], dict(defaults, output_type="np"), ())
    if not main:
        return engine, None, None
    if follow is not None:
        follow(call)
    image = engine.run_call(call)[0]
    default_size = (int(image.shape[-2]), int(image.shape[-3]))
    sizes = [default_size] + [s for s in config.sizes if s != default_size]
    digest = pipe.sdkiln_digest
    name = Path(str(config.package).rstrip("/")).name
    limits = Limits(
        model_ids=tuple(x for x in (name, digest) if x),
        sizes=tuple(sizes),
        default_steps=steps,
        max_steps=config.max_steps or max_steps,
        max_n=config.max_batch,
        loras=tuple(names),
        guidance=engine.guidance_arg is not None,
        guidance_above_one=bool(parallel is not None and parallel.cfg == 2),
        negative_prompt="negative_prompt" in params,
    )
    log.info(
        "%s loaded and warmed up in %.1f s: sizes %s, steps 1-%d (default %d), max batch %d, queue %d, LoRAs %s",
        name, time.perf_counter() - started, ", ".join(f"{w}x{h}" for w, h in sizes), limits.max_steps, steps,
        config.max_batch, config.max_queue, ", ".join(names) or "none",
    )  # fmt: skip
    return engine, limits, name


def _leader():
    """Rank 0's ``follow``: each batch's ``Call`` (or None to stop) sent to every rank."""
    import torch.distributed as dist

    def follow(call) -> None:
        dist.broadcast_object_list([call], src=0)

    return follow


def follow_rank(engine) -> None:
    """A rank other than 0: run each batch rank 0 sends, until it sends None."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        call = box[0]
        if call is None:
            return
        call.kwargs["output_type"] = "latent"  # rank 0 decodes and answers
        try:
            engine.run_call(call)
        except Exception:  # rank 0 fails the same batch and goes on serving; so does this rank
            log.exception("rank %s: the batch failed", os.environ.get("RANK", "?"))


def serve(config: ServeConfig) -> int:
    """Run the server until SIGTERM or Ctrl-C drains it; 0 when everything accepted was answered."""
    from sdkiln.extras import require

    require("fastapi", "uvicorn", extra="serve", what="sdkiln serve")
    _setup_logging()
    parallel = None
    if config.cfg_parallel or config.ulysses > 1 or config.ring > 1 or "WORLD_SIZE" in os.environ:
        from sdkiln.configs.runtime import ParallelConfig

        parallel = ParallelConfig(
            cfg=2 if config.cfg_parallel else 1, ulysses=config.ulysses, ring=config.ring
        )
    if parallel is None or int(os.environ.get("RANK", "0")) == 0:
        _check_port(config.host, config.port)  # before minutes of loading, not after
    engine, limits = None, None
    try:
        engine, limits, name = build(config, parallel)
        if limits is None:  # not rank 0: it stops when rank 0 says so (torchrun signals every rank)
            import signal

            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            follow_rank(engine)
            return 0
        return _run_http(config, engine, limits)
    finally:
        leader = limits is not None and engine.follow is not None
        if leader and engine.thread is None:
            engine.follow(None)  # rank 0 stopped before its worker ran: release the other ranks
        if parallel is not None:
            from sdkiln.runtime.parallel import shutdown

            shutdown()


def _check_port(host: str, port: int) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise SdkilnError(f"cannot serve on {host}:{port}: {exc.strerror} (is the port taken?)") from None


def _run_http(config: ServeConfig, engine, limits) -> int:
    """uvicorn until a signal; the drain (module docstring) runs in a thread the first signal starts."""
    import contextlib
    import signal
    import threading

    import uvicorn

    from sdkiln.serve.app import State, create_app

    state = State(engine, limits, config.request_timeout_s, config.max_body, int(time.time()))
    outcome = {"finished": True}

    class Server(uvicorn.Server):
        """The first SIGTERM / SIGINT drains with the listener still open (new requests and /health get
        503 draining), then stops uvicorn; a second one is uvicorn's own (Ctrl-C twice forces)."""

        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                outcome["finished"] = False
                super().handle_exit(sig, frame)
                return
            self.draining = state.draining = True
            log.info("draining: answering the accepted requests, up to %g s", config.grace_s)

            def drain() -> None:
                if not engine.close(config.grace_s):
                    outcome["finished"] = False
                self.should_exit = True

            threading.Thread(target=drain, name="sdkiln-serve-drain", daemon=True).start()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        state.ready = True
        yield
        state.draining = True
        engine.close(0.0)  # after a forced exit: stop the worker (a drain has already closed it)

    server = Server(
        uvicorn.Config(
            create_app(state, lifespan), host=config.host, port=config.port, log_level="warning",
            access_log=False, timeout_graceful_shutdown=5.0, lifespan="on",
        )
    )  # fmt: skip
    log.info("serving on http://%s:%d (POST /v1/images/generations)", config.host, config.port)
    # uvicorn re-raises the signal it handled to the handler it found, once stopped: make that one a
    # no-op, so that a drained server exits with its own status; the originals come back afterwards
    originals = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
    if engine.thread is not None:  # under a parallel layout it sends the other ranks their stop when done
        engine.thread.join(timeout=max(config.grace_s, 30.0))
    if not server.started:
        raise SdkilnError(f"could not serve on {config.host}:{config.port}")
    log.info(
        "drained and stopped%s", "" if outcome["finished"] else " (not every accepted request was answered)"
    )
    return 0 if outcome["finished"] else 1
