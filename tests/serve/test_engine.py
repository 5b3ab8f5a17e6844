"""The serving engine and app in process, on a stub pipeline that takes a set time per step: what
batches together, timeouts (504, the work dropped and a running batch stopped at its next step), a
failed generation (500, the server keeps serving), shutdown, and the request checks' edges."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra brings fastapi")
pytest.importorskip("httpx", reason="the test extra brings httpx")

from fastapi.testclient import TestClient  # noqa: E402

from sdkiln.serve.app import State, create_app  # noqa: E402
from sdkiln.serve.engine import Engine  # noqa: E402
from sdkiln.serve.requests import ApiError, ImageRequest, Limits, parse_body  # noqa: E402

LIMITS = Limits(
    model_ids=("stub",), sizes=((8, 8), (16, 8)), default_steps=4, max_steps=50, max_n=4, loras=("a",)
)


class StubPipe:
    """Takes ``step_s`` per step, calls the step callback, fails on a prompt containing "boom"; each
    image is the prompt's length as a grey level."""

    sdkiln_manifest = {"call": {"defaults": {"num_inference_steps": 4}, "guidance_arg": "guidance_scale"}}

    def __init__(self, step_s: float = 0.0):
        self.step_s, self.calls, self.stopped = step_s, [], 0

    def __call__(self, prompt, generator=None, num_inference_steps=4, output_type="np", height=8, width=8,
                 guidance_scale=None, negative_prompt=None, callback_on_step_end=None):  # fmt: skip
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if any("boom" in p for p in prompts):
            raise RuntimeError("the stub failed")
        try:
            for i in range(num_inference_steps):
                time.sleep(self.step_s)
                if callback_on_step_end is not None:
                    callback_on_step_end(self, i, 0, {})
        except Exception:
            self.stopped += 1
            raise
        self.calls.append((len(prompts), height, width, num_inference_steps))
        return SimpleNamespace(images=np.stack([np.full((height, width, 3), len(p) / 100) for p in prompts]))


def decode(b64: str) -> np.ndarray:
    import base64
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def _client(pipe, timeout_s=30.0, **engine):
    engine = Engine(pipe, max_batch=engine.get("max_batch", 4), max_queue=engine.get("max_queue", 16),
                    window_s=engine.get("window_s", 1.0), takes_size=True)  # fmt: skip
    state = State(engine, LIMITS, timeout_s, 65536, 0)

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        state.ready = True
        yield
        engine.close(5.0)

    return TestClient(create_app(state, lifespan)), engine


def test_requests_that_can_share_a_call_are_batched_and_others_are_not():
    pipe = StubPipe(step_s=0.01)
    client, engine = _client(pipe)
    bodies = [{"prompt": "a" * i, "seed": i} for i in range(1, 4)] + [{"prompt": "wide", "size": "16x8"}]
    with client:
        answers = [None] * len(bodies)

        def post(i):
            answers[i] = client.post("/v1/images/generations", json=bodies[i])

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(a.status_code == 200 for a in answers)
    assert sorted(pipe.calls) == [(1, 8, 16, 4), (3, 8, 8, 4)]  # the three 8x8 together, the 16x8 alone
    for body, answer in zip(bodies, answers, strict=True):  # each request got its own image back
        image = decode(answer.json()["data"][0]["b64_json"])
        assert image.shape[:2] == ((8, 16) if "size" in body else (8, 8))
        assert int(image[0, 0, 0]) == round(len(body["prompt"]) / 100 * 255)


def test_a_request_past_its_timeout_is_504_and_its_batch_stops():
    pipe = StubPipe(step_s=0.05)
    client, engine = _client(pipe, timeout_s=0.3, window_s=0.0)
    with client:
        r = client.post("/v1/images/generations", json={"prompt": "slow", "num_inference_steps": 40})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        deadline = time.monotonic() + 5
        while pipe.stopped == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pipe.stopped == 1 and pipe.calls == []  # stopped at its next step, not run to the end
        assert (
            client.post(
                "/v1/images/generations", json={"prompt": "fast", "num_inference_steps": 1}
            ).status_code
            == 200
        )
        assert 'sdkiln_errors_total{kind="timeout"} 1' in client.get("/metrics").text


def test_a_failed_generation_is_500_and_the_server_keeps_serving():
    client, _ = _client(StubPipe())
    with client:
        r = client.post("/v1/images/generations", json={"prompt": "boom"})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "generation failed: RuntimeError: the stub failed"
        assert client.post("/v1/images/generations", json={"prompt": "fine"}).status_code == 200
        assert client.get("/health").json()["status"] == "ok"


def test_a_closed_engine_takes_nothing_and_an_unready_server_says_so():
    pipe = StubPipe()
    client, engine = _client(pipe)
    with client:
        engine.close(1.0)
        with pytest.raises(ApiError) as refused:
            engine.submit(parse_body(b'{"prompt": "late"}', LIMITS))
        assert refused.value.status == 503
    state = State(engine, LIMITS, 1.0, 100, 0)
    with TestClient(create_app(state)) as raw:
        assert raw.get("/health").status_code == 503  # not ready
        r = raw.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 503
        state.ready = True
        assert raw.post("/v1/images/generations", content=b"x" * 101).status_code == 413


def test_request_parsing_edges():
    request = parse_body(b'{"prompt": "a", "lora": {"a": 0.5}, "size": "16x8", "n": 2}', LIMITS)
    assert (request.width, request.height, request.n, request.lora) == (16, 8, 2, (("a", 0.5),))
    assert isinstance(request.seed, int) and 0 <= request.seed  # drawn when not given
    same = ImageRequest("b", 1, 16, 8, 3, 4, lora=(("a", 0.5),))
    assert same.batch_key() == request.batch_key()
    for raw, param in [(b'{"prompt": "a", "user": 3}', "user"), (b'{"prompt": "\\ud800"}', "prompt")]:
        with pytest.raises(ApiError) as bad:
            parse_body(raw, LIMITS)
        assert bad.value.param == param and bad.value.status == 400
