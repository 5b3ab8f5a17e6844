"""``sdkiln serve`` end to end: the server runs as its own process (``python -m sdkiln serve``) on a free
loopback port with a quantized + cached package of the embedded model, and is called with the official
``openai`` client and with raw HTTP.

Tolerance, stated once: a batched image (its request shared a pipeline call with others) is within
``BATCHED_MIN_PSNR_DB`` of its unbatched twin. Batching changes only the floating-point order of the
batched float products (a float package's batched images stay above 130 dB of its unbatched ones); the
int8 activation quantization turns a few of those last-bit differences into a step of the int8 grid,
which the denoising steps carry on. Measured: 45.8 to 49.6 dB on this 8-step package, worst 35.7 dB
over 16 clients on the default package (28 steps, the slow twin). An unbatched image equals
``sdkiln run``'s bit for bit.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import sdkiln
from sdkiln.configs import CacheAutoConfig, Deployment, RecipeConfig, W8A8DynamicConfig

httpx = pytest.importorskip("httpx", reason="the test extra (pip install -e '.[test]') brings httpx")
openai = pytest.importorskip("openai", reason="the test extra brings the openai client")
pytest.importorskip("fastapi", reason="the serve extra brings fastapi")

BATCHED_MIN_PSNR_DB = 30.0
STEPS = 8
LORA = Path(__file__).resolve().parents[1] / "fixtures" / "fmnist_frame_lora.safetensors"
START_TIMEOUT_S = 180.0


def decode(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def psnr_u8(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * np.log10(255.0**2 / mse)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, procs: list, log: Path) -> None:
    """Until ``url``'s /health answers 200; an AssertionError with the log if a process exits first or
    ``START_TIMEOUT_S`` passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), f"a server process exited: {log.read_text()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the server did not become ready: {log.read_text()[-2000:]}")


class Server:
    """``python -m sdkiln serve PACKAGE --port P ...`` as a child process, its log in a file."""

    def __init__(self, package: Path, log: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sdkiln", "serve", str(package), "--port", str(self.port), "--device", "cpu", *args],
            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env,
        )  # fmt: skip
        wait_ready(self.url, [self.proc], log)

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """The embedded model, W8A8 dynamic + a searched cache schedule at 8 steps (the default recipe's
    kinds of state, made in seconds; the default package itself is the slow twin below)."""
    out = tmp_path_factory.mktemp("serve") / "pkg"
    cache = CacheAutoConfig(
        psnr_floor_db=20.0, psnr_p5_floor_db=15.0, calib_samples=1, eval_samples=1, budgets=2, refine=0
    )
    recipe = RecipeConfig("serve", [W8A8DynamicConfig(), cache], Deployment(num_inference_steps=STEPS))
    sdkiln.optimize("fmnist-flux", recipe, out, eval_samples=0)
    return out


@pytest.fixture(scope="module")
def server(package, tmp_path_factory):
    s = Server(
        package, tmp_path_factory.mktemp("log") / "serve.log", "--lora", f"frame={LORA}", "--max-batch", "4"
    )
    yield s
    assert s.stop() == 0, s.log.read_text()[-2000:]


def _run_image(package: Path, tmp_path: Path, prompt: str, seed: int, *args: str) -> np.ndarray:
    from PIL import Image

    from sdkiln.cli import main

    out = tmp_path / f"run-{seed}.png"
    assert (
        main(
            [
                "run",
                str(package),
                "--prompt",
                prompt,
                "--seed",
                str(seed),
                "--out",
                str(out),
                "--device",
                "cpu",
                *args,
            ]
        )
        == 0
    )
    return np.asarray(Image.open(out))


def test_the_openai_client_gets_sdkiln_runs_images_bit_for_bit(server, package, tmp_path):
    client = server.client()
    assert {m.id for m in client.models.list().data} == {"pkg", sdkiln.runtime.open_package(package).digest}
    response = client.images.generate(
        model="pkg", prompt="a sneaker", size="32x32", response_format="b64_json", extra_body={"seed": 7}
    )
    image = decode(response.data[0].b64_json)
    assert image.shape[:2] == (32, 32)
    assert np.array_equal(image, _run_image(package, tmp_path, "a sneaker", 7))
    # a LoRA the server loaded, at a strength: sdkiln run --lora's image, and not the plain one
    lora = client.images.generate(
        model="pkg", prompt="a sneaker", extra_body={"seed": 7, "lora": {"frame": 0.7}}
    ).data[0].b64_json  # fmt: skip
    assert np.array_equal(
        decode(lora), _run_image(package, tmp_path, "a sneaker", 7, "--lora", f"{LORA}:0.7")
    )
    assert not np.array_equal(decode(lora), image)
    # n images: seeds 7, 8 in one call, each within the batching tolerance of its unbatched twin
    two = client.images.generate(model="pkg", prompt="a sneaker", n=2, extra_body={"seed": 7}).data
    assert [d.model_extra["seed"] for d in two] == [7, 8]
    assert (
        psnr_u8(decode(two[1].b64_json), _run_image(package, tmp_path, "a sneaker", 8)) >= BATCHED_MIN_PSNR_DB
    )


def test_sixteen_clients_at_once_are_batched_within_the_tolerance(server):
    client = server.client()
    before = server.metrics()

    def generate(seed: int) -> np.ndarray:
        r = client.images.generate(model="pkg", prompt=f"a shirt {seed % 3}", extra_body={"seed": seed})
        return decode(r.data[0].b64_json)

    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(generate, range(100, 116)))
    after = server.metrics()
    batches = after["sdkiln_batch_images_count"] - before["sdkiln_batch_images_count"]
    single = after['sdkiln_batch_images_bucket{le="1"}'] - before['sdkiln_batch_images_bucket{le="1"}']
    assert batches - single >= 1, "no batch of more than one image formed"
    assert after["sdkiln_images_total"] - before["sdkiln_images_total"] == 16
    alone = [generate(seed) for seed in range(100, 116)]  # one at a time: unbatched
    worst = min(psnr_u8(a, b) for a, b in zip(together, alone, strict=True))
    print(f"{batches:.0f} pipeline calls for 16 requests; worst batched vs unbatched PSNR {worst:.1f} dB")
    assert worst >= BATCHED_MIN_PSNR_DB


BAD = [  # (name, body (bytes or JSON), extra headers, status, param, message fragment)
    ("malformed JSON", b'{"prompt": "a cat"', {}, 400, None, "not valid JSON"),
    ("not an object", [1, 2], {}, 400, None, "JSON object"),
    ("no prompt", {"n": 1}, {}, 400, "prompt", "required"),
    ("prompt not a string", {"prompt": 5}, {}, 400, "prompt", "is a string"),
    ("empty prompt", {"prompt": "  "}, {}, 400, "prompt", "empty"),
    ("prompt too long", {"prompt": "x" * 4001}, {}, 400, "prompt", "at most 4000"),
    ("n zero", {"prompt": "a", "n": 0}, {}, 400, "n", "within"),
    ("n over the batch", {"prompt": "a", "n": 5}, {}, 400, "n", "within [1, 4]"),
    ("n a string", {"prompt": "a", "n": "2"}, {}, 400, "n", "integer"),
    ("n a boolean", {"prompt": "a", "n": True}, {}, 400, "n", "integer"),
    ("size unknown", {"prompt": "a", "size": "1024x1024"}, {}, 400, "size", "not served"),
    ("size malformed", {"prompt": "a", "size": "big"}, {}, 400, "size", "WIDTHxHEIGHT"),
    ("size a number", {"prompt": "a", "size": 32}, {}, 400, "size", "string"),
    ("url format", {"prompt": "a", "response_format": "url"}, {}, 400, "response_format", "b64_json"),
    (
        "steps over the schedule's",
        {"prompt": "a", "num_inference_steps": 9},
        {},
        400,
        "num_inference_steps",
        "[1, 8]",
    ),
    ("steps zero", {"prompt": "a", "num_inference_steps": 0}, {}, 400, "num_inference_steps", "[1, 8]"),
    ("steps a float", {"prompt": "a", "num_inference_steps": 4.5}, {}, 400, "num_inference_steps", "integer"),
    ("guidance NaN-like", {"prompt": "a", "guidance_scale": "high"}, {}, 400, "guidance_scale", "number"),
    ("guidance too high", {"prompt": "a", "guidance_scale": 1e9}, {}, 400, "guidance_scale", "within"),
    ("seed negative", {"prompt": "a", "seed": -1}, {}, 400, "seed", "within"),
    ("unknown LoRA", {"prompt": "a", "lora": {"anime": 1.0}}, {}, 400, "lora", "not loaded"),
    ("LoRA strength a string", {"prompt": "a", "lora": {"frame": "1"}}, {}, 400, "lora", "number"),
    ("LoRA not a map", {"prompt": "a", "lora": ["frame"]}, {}, 400, "lora", "maps"),
    ("a file path field", {"prompt": "a", "lora_path": "/etc/passwd"}, {}, 400, "lora_path", "unknown field"),
    ("unknown model", {"prompt": "a", "model": "dall-e-3"}, {}, 404, "model", "not served"),
    ("oversized body", {"prompt": "a", "negative_prompt": "x" * 70_000}, {}, 413, None, "at most 65536"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_its_status_and_an_error_naming_the_problem(server, case):
    _, body, headers, status, param, fragment = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/v1/images/generations",
        content=content,
        headers={"content-type": "application/json", **headers},
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_after_bad_input_and_unknown_routes_the_server_still_serves(server):
    assert httpx.get(f"{server.url}/v1/nothing").json()["error"]["message"].startswith("GET /v1/nothing")
    assert httpx.get(f"{server.url}/v1/images/generations").status_code == 405
    r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "a bag", "seed": 1}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    assert "req-" in server.log.read_text()  # one line per request


def test_a_client_that_leaves_has_its_queued_work_dropped(server):
    before = server.metrics()

    def post(body: dict, timeout: float):
        return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=timeout)

    with cf.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(post, {"prompt": "a hat", "n": 4, "seed": i}, 120) for i in range(3)]
        time.sleep(0.05)
        with pytest.raises(httpx.TimeoutException):  # queued behind three full batches, it gives up
            post({"prompt": "a scarf", "seed": 9}, 0.1)
        assert all(f.result().status_code == 200 for f in busy)
    deadline = time.monotonic() + 10
    while server.metrics().get('sdkiln_errors_total{kind="disconnected"}', 0) <= before.get(
        'sdkiln_errors_total{kind="disconnected"}', 0
    ):
        assert time.monotonic() < deadline, "the server never saw the client leave"
        time.sleep(0.05)
    after = server.metrics()
    assert after["sdkiln_images_total"] - before["sdkiln_images_total"] == 12  # the scarf was never made


def test_a_full_queue_is_429_and_sigterm_finishes_what_was_accepted(package, tmp_path):
    s = Server(
        package, tmp_path / "serve.log", "--max-queue", "4", "--max-batch", "1", "--batch-window-ms", "0"
    )
    try:
        body = {"prompt": "a coat"}

        def post(seed: int):
            return httpx.post(f"{s.url}/v1/images/generations", json=body | {"seed": seed}, timeout=120)

        with cf.ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(post, range(20)))  # returns: nothing hangs
        codes = [r.status_code for r in answers]
        assert set(codes) <= {200, 429} and codes.count(429) >= 10 and codes.count(200) >= 1, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "queue_full"
        assert s.metrics()['sdkiln_errors_total{kind="queue_full"}'] == codes.count(429)
        # SIGTERM while three requests are accepted: they finish, new ones get 503, the process exits 0
        with cf.ThreadPoolExecutor(3) as pool:
            pending = [pool.submit(post, 100 + i) for i in range(3)]
            _wait_for_queue(s, 2)
            s.proc.send_signal(signal.SIGTERM)
            _wait_for_log(s, "draining")
            health = httpx.get(f"{s.url}/health")
            late = post(200)
            drained = [f.result().status_code for f in pending]
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert drained == [200, 200, 200]
        assert s.proc.wait(timeout=60) == 0
        assert "drained and stopped" in s.log.read_text()
    finally:
        s.stop()


def test_under_two_ranks_rank_0_serves_and_rank_1_follows_its_batches(package, tmp_path, server):
    """CFG parallel on gloo, each rank its own process as torchrun starts them: the images equal one
    device's server's bit for bit (CFG parallel is exact), a batch of two included; SIGTERM to both ranks
    (as torchrun forwards it) drains rank 0, which stops rank 1; both exit 0."""
    port, master = free_port(), free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
        )  # fmt: skip
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sdkiln", "serve", str(package), "--port", str(port), "--device", "cpu",
             "--cfg-parallel"],
            stdout=subprocess.DEVNULL, stderr=log, env=env,
        ))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs, tmp_path / "rank0.log")

        def post(base: str, n: int) -> list[np.ndarray]:
            body = {"prompt": "a dress", "seed": 5, "n": n}
            r = httpx.post(f"{base}/v1/images/generations", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return [decode(d["b64_json"]) for d in r.json()["data"]]

        for n in (1, 2):  # one image alone, and a batch of two in one call
            assert all(np.array_equal(a, b) for a, b in zip(post(url, n), post(server.url, n), strict=True))
        for p in procs:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=60) for p in procs] == [0, 0], (tmp_path / "rank1.log").read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_the_default_package_serves_sdkiln_runs_images_and_batches_within_the_tolerance(tmp_path):
    """The slow twin, on the embedded model's default package (text encoder step, quant-auto, searched
    cache, 28 steps; about 3 minutes to optimize): one image equals ``sdkiln run``'s bit for bit, and 16
    clients at once are batched, each within the tolerance of its unbatched twin."""
    package = tmp_path / "default"
    sdkiln.optimize("fmnist-flux", "default", package, eval_samples=0)
    s = Server(package, tmp_path / "serve.log", "--max-batch", "8")
    try:
        client = s.client()
        image = decode(
            client.images.generate(model="default", prompt="a bag", extra_body={"seed": 3}).data[0].b64_json
        )
        assert np.array_equal(image, _run_image(package, tmp_path, "a bag", 3))

        def generate(seed: int) -> np.ndarray:
            return decode(client.images.generate(prompt="a bag", extra_body={"seed": seed}).data[0].b64_json)

        before = s.metrics()
        with cf.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(generate, range(16)))
        after = s.metrics()
        assert after["sdkiln_batch_images_count"] - before["sdkiln_batch_images_count"] < 16  # batches formed
        values = [psnr_u8(a, generate(seed)) for seed, a in enumerate(together)]
        print(
            f"default package: batched vs unbatched PSNR worst {min(values):.1f}, median {np.median(values):.1f} dB"
        )
        assert min(values) >= BATCHED_MIN_PSNR_DB
    finally:
        assert s.stop() == 0


def _wait_for_queue(server: Server, depth: int) -> None:
    deadline = time.monotonic() + 30
    while server.metrics()["sdkiln_queue_depth"] < depth:
        assert time.monotonic() < deadline, f"the queue never reached {depth}"
        time.sleep(0.02)


def _wait_for_log(server: Server, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in server.log.read_text():
        assert time.monotonic() < deadline, f"the log never said {text!r}"
        time.sleep(0.02)


def test_past_the_grace_period_the_rest_gets_503_and_the_exit_status_says_so(package, tmp_path):
    s = Server(
        package, tmp_path / "serve.log", "--max-batch", "1", "--batch-window-ms", "0", "--grace", "0.3"
    )
    try:

        def post(seed: int):
            return httpx.post(
                f"{s.url}/v1/images/generations", json={"prompt": "a boot", "seed": seed}, timeout=120
            )

        with cf.ThreadPoolExecutor(16) as pool:  # 12 queued: more than 0.3 s of work on any machine here
            pending = [pool.submit(post, i) for i in range(16)]
            _wait_for_queue(s, 12)
            s.proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in pending]
        codes = [r.status_code for r in answers]
        assert set(codes) == {200, 503}, codes  # some answered within 0.3 s, the rest told
        # accepted and not reached, or arrived after the signal: each told, as OpenAI's error object
        told = [r.json()["error"] for r in answers if r.status_code == 503]
        assert all(e["code"] == "shutting_down" for e in told), told
        assert any(e["message"] == "the server shut down before this request was answered" for e in told), (
            told
        )
        assert s.proc.wait(timeout=60) == 1
        assert "not every accepted request was answered" in s.log.read_text()
    finally:
        s.stop()


def test_the_digest_pins_what_is_served_and_a_taken_port_fails_before_loading(package, server, capsys):
    from sdkiln.cli import main

    wrong = "sha256:" + "0" * 64
    assert (
        main(["serve", str(package), "--digest", wrong, "--port", str(free_port()), "--device", "cpu"]) == 2
    )
    assert "digest" in capsys.readouterr().err
    started = time.monotonic()
    assert main(["serve", str(package), "--port", str(server.port), "--device", "cpu"]) == 2
    assert "is the port taken?" in capsys.readouterr().err and time.monotonic() - started < 5
