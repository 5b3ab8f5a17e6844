"""The model side of ``sdkiln serve``: one worker thread owns the loaded pipeline and runs the queued
requests, batching those that can share a pipeline call.

* **Queue.** ``submit`` puts a request in a bounded queue (``max_queue`` requests waiting; a full
  queue is ``ApiError(429)`` with ``Retry-After``) and returns its ``Job``, whose future the HTTP
  handler awaits.
* **Batching.** The worker takes the oldest request, then, for up to ``window_s``, the queued requests
  with the same ``ImageRequest.batch_key`` (size, steps, guidance, negative prompt, LoRA set), in
  order, while their images fit ``max_batch``. One pipeline call runs them: the prompts as a list and
  one CPU generator per image (request seed + i), so each image starts from the latents it would
  start from alone; a lone image is called exactly as ``sdkiln run`` calls it (bit for bit). Batched
  images differ from their unbatched twins only by the floating-point order of the batched products
  (``docs/serving.md`` states the tolerance). The cache schedule and the step tracker hold per-call
  state, which one call per batch keeps right; under a parallel layout every rank runs the same call
  (``follow``).
* **Timeouts and disconnects.** A job whose client gave up (``Job.abandon``: past the request timeout,
  or the connection closed) is dropped if it has not started; a batch whose jobs all gave up is stopped
  at its next denoising step where the pipeline takes a step callback (not under a parallel layout,
  where every rank must run every step). A call that stopped or failed resets the components' per-call
  state (``_reset_stateful_cache``, as the pipeline's own end would), so the next call starts clean.
* **Drain.** ``close`` stops taking requests, lets the worker finish what is queued within a grace
  period (what is left is answered 503), then stops it; the worker's last act under a parallel layout is
  to tell the other ranks to stop (``follow(None)``), so no collective of rank 0 overlaps another.
"""

from __future__ import annotations

import base64
import concurrent.futures
import inspect
import io
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sdkiln.serve.metrics import Metrics
from sdkiln.serve.requests import ApiError, ImageRequest

log = logging.getLogger("sdkiln.serve")


class Abandoned(Exception):
    """Raised from the step callback when every request of the running batch has been given up."""


@dataclass(eq=False)
class Job:
    id: str
    request: ImageRequest
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.monotonic)
    abandoned: bool = False
    batch: int = 0
    """Images in the pipeline call that ran it (set by the worker)."""

    def abandon(self) -> None:
        self.abandoned = True


@dataclass
class Call:
    """Everything one pipeline call needs, as plain data (what rank 0 sends the other ranks)."""

    prompts: list[str]
    seeds: list[int]
    kwargs: dict[str, Any]
    lora: tuple[tuple[str, float], ...]


def settle(future: concurrent.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it already is (its waiter may have given up and cancelled it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def png_b64(image) -> str:
    """The image ``sdkiln run`` would save (``cli_run.image_of``), as base64 PNG."""
    from sdkiln.cli_run import image_of

    buffer = io.BytesIO()
    image_of(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class Engine:
    def __init__(
        self,
        pipe,
        *,
        max_batch: int,
        max_queue: int,
        window_s: float,
        takes_size: bool,
        metrics: Metrics | None = None,
        follow=None,
    ):
        self.pipe = pipe
        self.max_batch, self.max_queue, self.window_s = max_batch, max_queue, window_s
        self.takes_size = takes_size
        self.metrics = metrics or Metrics()
        self.follow = follow
        """With a parallel layout: called with each ``Call`` before rank 0 runs it (the other ranks run it too)."""
        call = pipe.sdkiln_manifest["call"]
        self.defaults = dict(call["defaults"])
        self.guidance_arg = call["guidance_arg"]
        self.can_interrupt = "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
        self.queue: list[Job] = []
        self.cond = threading.Condition()
        self.accepting = True
        self.stopping = False
        self.running: list[Job] = []
        self.seconds_per_image = None
        self.thread: threading.Thread | None = None
        self.ids = itertools.count(1)

    # ---- the pipeline call ------------------------------------------------------------------
    def call_for(self, jobs: list[Job]) -> Call:
        first = jobs[0].request
        kwargs = dict(self.defaults)
        kwargs["output_type"] = "np"
        kwargs["num_inference_steps"] = first.steps
        if first.guidance_scale is not None:
            kwargs[self.guidance_arg] = first.guidance_scale
        if first.negative_prompt is not None:
            kwargs["negative_prompt"] = first.negative_prompt
        if self.takes_size:
            kwargs["height"], kwargs["width"] = first.height, first.width
            from sdkiln.model_zoo.spec import with_area

            with_area(kwargs)
        prompts = [j.request.prompt for j in jobs for _ in range(j.request.n)]
        seeds = [j.request.seed + i for j in jobs for i in range(j.request.n)]
        return Call(prompts, seeds, kwargs, first.lora)

    def run_call(self, call: Call, stop=None):
        """The images of ``call`` ([N, H, W, C] in [0, 1]); ``stop()`` True at a step ends it (``Abandoned``)."""
        import torch

        self.set_lora(call.lora)
        generators = [torch.Generator("cpu").manual_seed(s) for s in call.seeds]
        kwargs = dict(call.kwargs)
        if stop is not None and self.can_interrupt:

            def check(pipe, step, timestep, tensors):
                if stop():
                    raise Abandoned
                return tensors

            kwargs["callback_on_step_end"] = check
        single = len(call.prompts) == 1  # exactly as ``sdkiln run`` calls it
        try:
            out = self.pipe(
                prompt=call.prompts[0] if single else call.prompts,
                generator=generators[0] if single else generators,
                **kwargs,
            )
        except BaseException:
            self.reset_state()
            raise
        return out.frames if hasattr(out, "frames") else out.images

    def reset_state(self) -> None:
        """What a pipeline call's end resets (diffusers' ``maybe_free_model_hooks``): the per-call state of
        every component's stateful hooks (sdkiln's cache runner among them), after a call that stopped."""
        for component in getattr(self.pipe, "components", {}).values():
            if hasattr(component, "_reset_stateful_cache"):
                component._reset_stateful_cache()

    def set_lora(self, lora: tuple[tuple[str, float], ...]) -> None:
        adapters = getattr(self.pipe, "sdkiln_lora", None)
        if adapters is None or not adapters.adapters:
            return
        if lora:
            self.pipe.enable_lora()
            self.pipe.set_adapters([n for n, _ in lora], [s for _, s in lora])
        else:
            self.pipe.disable_lora()

    # ---- the queue --------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._work, name="sdkiln-serve-worker", daemon=True)
        self.thread.start()

    def submit(self, request: ImageRequest) -> Job:
        with self.cond:
            if not self.accepting:
                raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")
            if len(self.queue) >= self.max_queue:
                self.metrics.error("queue_full")
                raise ApiError(
                    429,
                    f"the queue is full ({self.max_queue} requests waiting); retry later",
                    kind="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(self.retry_after())},
                )
            job = Job(f"req-{next(self.ids)}", request)
            self.queue.append(job)
            self.metrics.queue_depth = len(self.queue)
            self.cond.notify_all()
        return job

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved: the queued images at the measured rate (at least 1)."""
        rate = self.seconds_per_image or 1.0
        waiting = sum(j.request.n for j in self.queue) + sum(j.request.n for j in self.running)
        return max(1, round(rate * waiting))

    def drop(self, job: Job) -> None:
        """The client gave up: drop the job if it is still queued; a running batch stops at its next
        step once every job in it has been given up."""
        with self.cond:
            job.abandon()
            if job in self.queue:
                self.queue.remove(job)
                self.metrics.queue_depth = len(self.queue)

    def _take(self) -> list[Job] | None:
        """The next batch (module docstring), or None once stopping with nothing queued."""
        with self.cond:
            while not self.queue:
                if self.stopping:
                    return None
                self.cond.wait()
            first = self.queue[0]
            deadline = time.monotonic() + self.window_s
            while True:
                batch, images = [], 0
                for job in self.queue:
                    if job.request.batch_key() == first.request.batch_key() and images + job.request.n <= max(
                        self.max_batch, first.request.n
                    ):
                        batch.append(job)
                        images += job.request.n
                left = deadline - time.monotonic()
                if images >= self.max_batch or left <= 0 or self.stopping:
                    break
                self.cond.wait(left)
                if first not in self.queue:  # given up meanwhile: start again from the oldest
                    return []
            for job in batch:
                self.queue.remove(job)
            self.metrics.queue_depth = len(self.queue)
            self.running = batch
            return batch

    def _work(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                break
            if not batch:
                continue
            try:
                self._run(batch)
            except (
                BaseException
            ) as exc:  # whatever broke, the batch's clients hear of it and the worker goes on
                log.exception("the worker failed on a batch")
                error = ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error")
                for job in batch:
                    settle(job.future, error=error)
            finally:
                with self.cond:
                    self.running = []
                    self.cond.notify_all()
        if self.follow is not None:  # the other ranks stop after rank 0's last collective, never during one
            self.follow(None)

    def _run(self, batch: list[Job]) -> None:
        jobs = [j for j in batch if not j.abandoned]
        if not jobs:
            return
        call = self.call_for(jobs)
        started = time.perf_counter()
        try:
            if self.follow is not None:
                self.follow(call)
            # under a parallel layout every rank must run every step: a batch is not stopped there
            stop = None if self.follow is not None else (lambda: all(j.abandoned for j in jobs))
            images = self.run_call(call, stop=stop)
        except Abandoned:
            log.info("batch of %d image(s) stopped: every request in it was given up", len(call.prompts))
            return
        except Exception as exc:  # a failed generation fails its requests; the server keeps serving
            log.exception("generation failed")
            error = ApiError(
                500,
                f"generation failed: {type(exc).__name__}: {exc}"[:500],
                kind="server_error",
                code="generation_failed",
            )
            for job in jobs:
                self.metrics.error("generation")
                settle(job.future, error=error)
            return
        seconds = time.perf_counter() - started
        self.seconds_per_image = seconds / len(call.prompts)
        self.metrics.batch(len(call.prompts))
        start = 0
        for job in jobs:
            mine = images[start : start + job.request.n]
            start += job.request.n
            job.batch = len(call.prompts)
            if not job.future.done():
                settle(job.future, [png_b64(image) for image in mine])

    def close(self, grace_s: float) -> bool:
        """Stop taking requests; wait up to ``grace_s`` for the queued and running ones; whether they finished."""
        deadline = time.monotonic() + grace_s
        with self.cond:
            self.accepting = False
            while (self.queue or self.running) and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            finished = not self.queue and not self.running
            error = ApiError(
                503,
                "the server shut down before this request was answered",
                kind="server_error",
                code="shutting_down",
            )
            for job in (
                self.queue + self.running
            ):  # past the grace period: their clients told, the work dropped
                job.abandon()
                settle(job.future, error=error)
            self.queue.clear()
            self.metrics.queue_depth = 0
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        return finished
