"""The body of ``POST /v1/images/generations``, checked field by field: OpenAI's images request (``prompt``,
``n``, ``size``, ``response_format``, ``model``, ``user``) plus sdkiln's fields (``seed``,
``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``lora``). Anything else, a value of the
wrong type or out of bounds, is an ``ApiError`` naming the field: the server answers it with an OpenAI
error object and never touches the model, the disk or the network for it."""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

MAX_PROMPT_CHARS = 4000
MAX_SEED = 2**63 - 1_000_000  # image i of a request uses seed + i (as ``sdkiln run``)
MAX_LORA_STRENGTH = 10.0
MAX_GUIDANCE = 100.0
SIZE_PATTERN = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
OPENAI_FIELDS = ("prompt", "n", "size", "response_format", "model", "user")
SDKILN_FIELDS = ("seed", "negative_prompt", "num_inference_steps", "guidance_scale", "lora")


class ApiError(Exception):
    """An HTTP error with OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What this server takes, fixed at start from the package and the command line."""

    model_ids: tuple[str, ...]
    """The names ``model`` may give: the package's name and its digest."""
    sizes: tuple[tuple[int, int], ...]
    """(width, height) served; the first is the default."""
    default_steps: int
    max_steps: int
    max_n: int
    loras: tuple[str, ...] = ()
    guidance: bool = True
    """Whether the package's pipeline takes a guidance scale."""
    negative_prompt: bool = True
    guidance_above_one: bool = False
    """Under CFG parallel: each rank runs one guidance branch, so a request must keep both."""


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    n: int
    width: int
    height: int
    seed: int
    steps: int
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    lora: tuple[tuple[str, float], ...] = field(default_factory=tuple)
    """(adapter name, strength), sorted by name."""

    def batch_key(self) -> tuple:
        """Requests with the same key share a transformer call."""
        return (self.width, self.height, self.steps, self.guidance_scale, self.negative_prompt, self.lora)


def parse_body(raw: bytes, limits: Limits) -> ImageRequest:
    """The request ``raw`` asks for, or ApiError(400) naming the first field that is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON, too deeply nested, an integer of too many digits
        raise ApiError(400, f"the body is not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body is a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in OPENAI_FIELDS and name not in SDKILN_FIELDS:
            raise ApiError(
                400,
                f"unknown field {name!r}; this server takes {', '.join(OPENAI_FIELDS + SDKILN_FIELDS)}",
                name,
            )
    prompt = _text(body, "prompt", required=True)
    if not prompt.strip():
        raise ApiError(400, "prompt is empty", "prompt")
    n = _integer(body, "n", 1, 1, limits.max_n)
    width, height = _size(body.get("size"), limits)
    response_format = body.get("response_format", "b64_json")
    if response_format != "b64_json":
        raise ApiError(
            400,
            f"response_format {response_format!r} is not served: this server returns b64_json",
            "response_format",
        )
    model = body.get("model")
    if model is not None and model not in limits.model_ids:
        raise ApiError(
            404, f"model {model!r} is not served here; this server serves {' or '.join(map(repr, limits.model_ids))}",
            "model", code="model_not_found",
        )  # fmt: skip
    _text(body, "user", max_chars=256)  # OpenAI's end-user id: accepted, not used
    seed = _integer(body, "seed", None, 0, MAX_SEED)
    steps = _integer(body, "num_inference_steps", limits.default_steps, 1, limits.max_steps)
    guidance = None
    if "guidance_scale" in body:
        if not limits.guidance:
            raise ApiError(
                400, "guidance_scale: this package's pipeline takes no guidance scale", "guidance_scale"
            )
        guidance = _number(body, "guidance_scale", 0.0, MAX_GUIDANCE)
        if limits.guidance_above_one and guidance <= 1.0:
            raise ApiError(
                400, "guidance_scale must be above 1: this server runs the two guidance branches on two ranks "
                "(--cfg-parallel)", "guidance_scale",
            )  # fmt: skip
    negative = _text(body, "negative_prompt")
    if negative is not None and not limits.negative_prompt:
        raise ApiError(
            400, "negative_prompt: this package's pipeline takes no negative prompt", "negative_prompt"
        )
    return ImageRequest(
        prompt=prompt,
        n=n,
        width=width,
        height=height,
        seed=secrets.randbelow(MAX_SEED + 1) if seed is None else seed,
        steps=steps,
        guidance_scale=guidance,
        negative_prompt=negative,
        lora=_lora(body.get("lora"), limits),
    )


def _text(body: dict, name: str, required: bool = False, max_chars: int = MAX_PROMPT_CHARS) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{name} is required", name)
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"{name} is a string, got {type(value).__name__}", name)
    if len(value) > max_chars:
        raise ApiError(400, f"{name} is {len(value)} characters; at most {max_chars}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{name} is not valid UTF-8 (a lone surrogate)", name) from None
    return value


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} is an integer, got {json.dumps(value)[:40]}", name)
    if not lo <= value <= hi:
        raise ApiError(400, f"{name} is {value}; it must be within [{lo}, {hi}]", name)
    return value


def _number(body: dict, name: str, lo: float, hi: float) -> float:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"{name} is a number, got {json.dumps(value)[:40]}", name)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ApiError(400, f"{name} is {value}; it must be within [{lo:g}, {hi:g}]", name)
    return float(value)


def _size(value: Any, limits: Limits) -> tuple[int, int]:
    served = ", ".join(f"{w}x{h}" for w, h in limits.sizes)
    if value is None or value == "auto":
        return limits.sizes[0]
    if not isinstance(value, str):
        raise ApiError(400, f"size is a string WIDTHxHEIGHT, got {json.dumps(value)[:40]}", "size")
    match = SIZE_PATTERN.match(value)
    if match is None:
        raise ApiError(400, f"size {value[:40]!r} is not WIDTHxHEIGHT; this server serves {served}", "size")
    size = (int(match.group(1)), int(match.group(2)))
    if size not in limits.sizes:
        raise ApiError(400, f"size {value!r} is not served; this server serves {served}", "size")
    return size


def _lora(value: Any, limits: Limits) -> tuple[tuple[str, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, 'lora maps loaded adapter names to strengths: {"name": 0.8}', "lora")
    out = []
    for name, strength in value.items():
        if name not in limits.loras:
            loaded = ", ".join(limits.loras) or "none (start the server with --lora NAME=PATH)"
            raise ApiError(400, f"lora {name[:60]!r} is not loaded; loaded: {loaded}", "lora")
        if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength):
            raise ApiError(
                400, f"lora {name!r}: its strength is a number, got {json.dumps(strength)[:40]}", "lora"
            )
        if abs(strength) > MAX_LORA_STRENGTH:
            raise ApiError(
                400, f"lora {name!r}: strength {strength} is outside ±{MAX_LORA_STRENGTH:g}", "lora"
            )
        out.append((name, float(strength)))
    return tuple(sorted(out))
