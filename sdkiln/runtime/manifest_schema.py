"""The manifest's schema, the quality report's and the call defaults' bounds: checked before anything
is built from them, so a field of the wrong type or an absurd size is one ``PackageError`` naming the
field, never a traceback, a hang or a memory blow-up later.

Sections (``modules``, ``cache_schedule``, ...) are checked by their own restore handlers; this
module checks the core fields every package has (``runtime.restore.CORE_FIELDS``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from sdkiln.errors import PackageError
from sdkiln.runtime.package import FORMAT_NAME, SCHEMA_VERSION
from sdkiln.runtime.restore import CORE_FIELDS

DTYPES = ("float32", "float16", "bfloat16")
HEX64 = re.compile(r"[0-9a-f]{64}")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
CLASS_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,200}:[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_TEXT = 10_000

# The pipeline call arguments a package may set as defaults, each with its bounds. The sizes are
# the largest any supported family is used at; a package asking for more is refused.
CALL_BOUNDS: dict[str, tuple[type, float, float]] = {
    "num_inference_steps": (int, 1, 1000),
    "height": (int, 8, 4096),
    "width": (int, 8, 4096),
    "num_frames": (int, 1, 1024),
    "max_sequence_length": (int, 1, 4096),
    "num_images_per_prompt": (int, 1, 16),
    "max_area": (int, 64, 4096 * 4096),  # FLUX.1-Kontext scales its output to this many pixels
}
GUIDANCE_BOUNDS = (0.0, 100.0)
GUIDANCE_ARG = re.compile(r"[a-z_]*(guidance|cfg)[a-z_0-9]*")  # guidance_scale, flux-tiny's true_cfg_scale
MAX_CALL_PIXELS = 1 << 28  # 4096 x 4096 x 16 images; Wan 720p's 81 frames are 75M
# The manifest's model fields: the pattern each string must match, and its longest length.
MODEL_FIELDS: dict[str, tuple[re.Pattern | None, int]] = {
    "family": (None, 200),
    "base_id": (None, 4096),
    "config_hash": (HEX64, 64),
    "weights_hash": (HEX64, 64),
    "pipeline_class": (CLASS_PATH, 400),
    "transformer_attr": (IDENTIFIER, 128),
    "transformer_class": (IDENTIFIER, 128),
    "dtype": (None, 16),
}
# The model fields a package may leave out: "variant" (FLUX.1-dev) is absent from packages made before
# variants, whose family is the zoo build's name ("flux-tiny").
OPTIONAL_MODEL_FIELDS: dict[str, tuple[re.Pattern | None, int]] = {"variant": (None, 200)}
OUTPUT_TYPES = ("np", "pil", "pt", "latent")


def fail(where: str, message: str) -> PackageError:
    return PackageError(f"{where}: {message}")


def expect_dict(value: Any, where: str, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(where, f"must be an object, got {type(value).__name__}")
    if keys is not None:
        missing = [k for k in keys if k not in value]
        if missing:
            raise fail(where, f"missing {missing[0]!r}")
    return value


def expect_str(value: Any, where: str, pattern: re.Pattern | None = None, max_len: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > max_len:
        raise fail(where, f"must be a string of at most {max_len} characters, got {short(value)}")
    if pattern is not None and not pattern.fullmatch(value):
        raise fail(where, f"{value!r} is not of the form {pattern.pattern}")
    return value


def expect_int(value: Any, where: str, lo: float, hi: float) -> int:
    if type(value) is not int or not lo <= value <= hi:  # bool is an int subclass: refused
        raise fail(where, f"must be an integer in [{lo:g}, {hi:g}], got {short(value)}")
    return value


def expect_number(value: Any, where: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise fail(where, f"must be a finite number in [{lo:g}, {hi:g}], got {short(value)}")
    return float(value)


def expect_list(value: Any, where: str, max_len: int = 100_000) -> list[Any]:
    if not isinstance(value, list) or len(value) > max_len:
        raise fail(where, f"must be a list of at most {max_len} items, got {short(value)}")
    return value


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_call_defaults(defaults: Any, guidance_arg: str | None, where: str) -> dict[str, Any]:
    """Known pipeline arguments within bounds, each alone and together: the pixels of one call
    (height x width x frames x images) are bounded too."""
    expect_dict(defaults, where)
    for key, value in defaults.items():
        at = f"{where}.{key}"
        if key in CALL_BOUNDS:
            kind, lo, hi = CALL_BOUNDS[key]
            expect_int(value, at, lo, hi)
        elif key == guidance_arg or GUIDANCE_ARG.fullmatch(key):  # Wan2.2-A14B's guidance_scale_2 too
            expect_number(value, at, *GUIDANCE_BOUNDS)
        elif key == "output_type":
            if value not in OUTPUT_TYPES:
                raise fail(at, f"must be one of {OUTPUT_TYPES}, got {short(value)}")
        elif key == "negative_prompt":
            expect_str(value, at)
        else:
            raise fail(
                at,
                f"is not a pipeline argument a package may set (allowed: {sorted(CALL_BOUNDS)}, "
                f"{guidance_arg or 'guidance'}, output_type, negative_prompt)",
            )
    pixels = 1
    for key in ("height", "width", "num_frames", "num_images_per_prompt"):
        pixels *= defaults.get(key, 1)
    if pixels > MAX_CALL_PIXELS:
        raise fail(
            where,
            f"height x width x num_frames x num_images_per_prompt = {pixels:,} (at most {MAX_CALL_PIXELS:,})",
        )
    return defaults


def _check_deployment(d: Any, where: str) -> None:
    expect_dict(d, where)
    for key, value in d.items():
        at = f"{where}.{key}"
        if value is None:
            continue
        if key == "version":
            expect_int(value, at, 1, 1000)
        elif key == "guidance":
            expect_number(value, at, *GUIDANCE_BOUNDS)
        elif key in CALL_BOUNDS:
            expect_int(value, at, *CALL_BOUNDS[key][1:])
        else:
            raise fail(at, "is not a deployment setting")


SHA256_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _check_quality_target(value: Any, at: str) -> None:
    """``optimize --match-quality``'s record: the package matched, its held-out cache quality, the slack."""
    target = expect_dict(value, at, ("package", "digest", "held_out", "slack_db", "front_given"))
    expect_str(target["package"], f"{at}.package", max_len=1000)
    expect_str(target["digest"], f"{at}.digest", SHA256_DIGEST, 71)
    keys = ("psnr_mean_db", "psnr_p5_db", "samples", "block_evaluations_ratio")
    held = expect_dict(target["held_out"], f"{at}.held_out", keys)
    for key in ("psnr_mean_db", "psnr_p5_db"):
        expect_number(held[key], f"{at}.held_out.{key}", -1000, 1000)
    expect_int(held["samples"], f"{at}.held_out.samples", 0, 1_000_000)
    expect_number(held["block_evaluations_ratio"], f"{at}.held_out.block_evaluations_ratio", 0, 1)
    expect_number(target["slack_db"], f"{at}.slack_db", 0, 50)
    expect_int(target["front_given"], f"{at}.front_given", 0, 1_000_000)


def check_manifest(m: Any) -> None:
    """The core fields of a manifest: types, ranges and allowed values."""
    where = "manifest.json"
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise fail(where, f"not an sdkiln package manifest (format is not {FORMAT_NAME!r})")
    version = m.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise fail(
            where, f"unsupported schema_version {short(version)}; this sdkiln reads version {SCHEMA_VERSION}"
        )
    for key in ("files", "model", "recipe", "modules", "call"):
        expect_dict(m.get(key), f"{where}: {key!r}")
    expect_str(m.get("sdkiln_version"), f"{where}: sdkiln_version", max_len=64)
    expect_str(m.get("created"), f"{where}: created", max_len=64)

    model = expect_dict(m["model"], f"{where}: model", tuple(MODEL_FIELDS))
    at = f"{where}: model"
    for key, (pattern, max_len) in MODEL_FIELDS.items():
        expect_str(model[key], f"{at}.{key}", pattern, max_len)
    for key, (pattern, max_len) in OPTIONAL_MODEL_FIELDS.items():
        if key in model:
            expect_str(model[key], f"{at}.{key}", pattern, max_len)
    if model["dtype"] not in DTYPES:
        raise fail(f"{at}.dtype", f"must be one of {DTYPES}, got {short(model['dtype'])}")
    buffers = expect_list(model.get("nonpersistent_buffers", []), f"{at}.nonpersistent_buffers")
    for i, name in enumerate(buffers):
        expect_str(name, f"{at}.nonpersistent_buffers[{i}]", max_len=1000)
    for i, entry in enumerate(expect_list(model.get("fused_loras", []), f"{at}.fused_loras")):
        where_lora = f"{at}.fused_loras[{i}]"
        expect_dict(entry, where_lora, ("file", "sha256", "strength", "layers"))
        expect_str(entry["file"], f"{where_lora}.file", max_len=1000)
        expect_str(entry["sha256"], f"{where_lora}.sha256", HEX64, 64)
        if not isinstance(entry["strength"], int | float) or not math.isfinite(entry["strength"]):
            raise fail(f"{where_lora}.strength", "must be a finite number")
        if not isinstance(entry["layers"], int) or entry["layers"] < 1:
            raise fail(f"{where_lora}.layers", "must be a positive integer")
    unknown = sorted(
        set(model) - set(MODEL_FIELDS) - set(OPTIONAL_MODEL_FIELDS) - {"nonpersistent_buffers", "fused_loras"}
    )
    if unknown:
        raise fail(f"{at}.{unknown[0]}", "is not a model field of schema version 1")

    call = expect_dict(m["call"], f"{where}: call", ("guidance_arg", "defaults"))
    guidance_arg = call["guidance_arg"]  # null: the pipeline's guider component holds the guidance
    if guidance_arg is not None:
        expect_str(guidance_arg, f"{where}: call.guidance_arg", GUIDANCE_ARG, 64)
    check_call_defaults(call["defaults"], guidance_arg, f"{where}: call.defaults")

    recipe = expect_dict(m["recipe"], f"{where}: recipe", ("name", "version", "steps"))
    expect_str(recipe["name"], f"{where}: recipe.name", max_len=1000)
    expect_int(recipe["version"], f"{where}: recipe.version", 1, 1000)
    if "deployment" in recipe:
        _check_deployment(recipe["deployment"], f"{where}: recipe.deployment")
    if "quality_target" in recipe:
        _check_quality_target(recipe["quality_target"], f"{where}: recipe.quality_target")
    for i, step in enumerate(expect_list(recipe["steps"], f"{where}: recipe.steps", 100)):
        at = f"{where}: recipe.steps[{i}]"
        expect_dict(step, at, ("config", "result"))
        expect_str(
            expect_dict(step["config"], f"{at}.config", ("kind",))["kind"], f"{at}.config.kind", IDENTIFIER
        )
        result = expect_dict(step["result"], f"{at}.result")
        for j, name in enumerate(expect_list(result.get("float", []), f"{at}.result.float")):
            expect_str(name, f"{at}.result.float[{j}]", max_len=1000)
        if result.get("weight_rounding") == "gptq":
            expect_number(result.get("gptq_error_ratio_median"), f"{at}.result.gptq_error_ratio_median", 0)

    for name, info in m["modules"].items():
        at = f"{where}: modules[{short(name)}]"
        expect_str(name, at, max_len=1000)
        expect_str(expect_dict(info, at, ("scheme",))["scheme"], f"{at}.scheme", max_len=64)
    for key, entry in m.items():
        if key not in CORE_FIELDS and not isinstance(entry, dict):
            raise fail(f"{where}: {key}", f"a package section must be an object, got {short(entry)}")


CORE = (
    "format",
    "schema_version",
    "sdkiln_version",
    "created",
    "model",
    "call",
    "recipe",
    "files",
    "modules",
)
QUALITY_NUMBERS = ("psnr", "psnr_p5", "psnr_min", "ssim", "cosine", "latent_rel_l2")


def check_quality(q: Any, where: str) -> dict[str, Any]:
    """The quality report fields ``sdkiln inspect`` prints."""
    expect_dict(q, where)
    if "psnr" in q:
        expect_int(q.get("num_samples"), f"{where}: num_samples", 1, 1_000_000)
        expect_int(q.get("steps"), f"{where}: steps", 1, 1000)
        expect_number(q.get("guidance"), f"{where}: guidance", *GUIDANCE_BOUNDS)
        for key in QUALITY_NUMBERS:
            expect_number(q.get(key), f"{where}: {key}")
        for key in q:
            if f"base_{key}" in q:
                expect_number(q[key], f"{where}: {key}")
                expect_number(q[f"base_{key}"], f"{where}: base_{key}")
        if "block_evaluations_ratio" in q:
            expect_number(q["block_evaluations_ratio"], f"{where}: block_evaluations_ratio", 0)
    return q
