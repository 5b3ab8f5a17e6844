"""What a package holds, in numbers: ``sdkiln inspect`` prints it, and a model card can quote it.

Read from the verified package's files (the manifest, the recipe record of the offline job, the
tensors' headers), never recomputed from memory. It lives with the writers because it reads what
the offline job recorded; the runtime needs none of it.
"""

from __future__ import annotations

from typing import Any

from sdkiln.runtime.cache.restore import schedule_file
from sdkiln.runtime.cache.schedule import CacheSchedule
from sdkiln.runtime.components import stored_infos
from sdkiln.runtime.package import Package
from sdkiln.runtime.restore import sections_of
from sdkiln.runtime.safetensors_data import DTYPES

# A quantized weight stored as uint8 holds two int4 values a byte (W4A16, ``sdkiln.kernels.int4``).
_WEIGHT_VALUES_PER_ELEMENT = {"U8": 2}


def summarize(pkg: Package) -> dict[str, Any]:
    """Layers quantized and kept in float, and the quantized layers' bytes against fp32.

    ``quantized_bytes`` counts every tensor a quantized layer stores except its float bias: the
    int8, float8 or packed int4 weight, its scales and offsets, and a static layer's activation
    parameters, ``deq_scale`` and ``quant_bias`` (and a SmoothQuant ``mul_scale``);
    ``quantized_float_bytes`` is what the same weights weigh in float32. The float bias is the same
    in both and is not counted.
    """
    m = pkg.manifest
    attr = m["model"]["transformer_attr"]
    modules = m["modules"]
    float_layers = sorted(
        {n for step in m["recipe"]["steps"] for n in step["result"].get("float", [])} - set(modules)
    )
    qbytes = fbytes = 0
    infos = stored_infos(pkg, attr)
    for layer in modules:
        for key in sorted(k for k in infos if k.startswith(f"{layer}.") and not k.endswith(".bias")):
            info = infos[key]
            qbytes += info.numel * DTYPES[info.dtype].itemsize
            if key in (f"{layer}.weight", f"{layer}.linear.weight"):
                fbytes += info.numel * _WEIGHT_VALUES_PER_ELEMENT.get(info.dtype, 1) * 4
    total = sum(info.numel * DTYPES[info.dtype].itemsize for info in infos.values())
    schemes: dict[str, int] = {}
    for info in modules.values():
        schemes[info["scheme"]] = schemes.get(info["scheme"], 0) + 1
    cache = None
    where = schedule_file(m)
    if where is not None:
        schedule = CacheSchedule.from_dict(pkg.read_json(where), where)
        cache = {
            "num_steps": schedule.num_steps,
            "block_evaluations_ratio": schedule.block_evaluations_ratio(),
            "actions": [str(a) for a in next(iter(schedule.actions.values()))],
            "expected": schedule.expected,
            "guard": None
            if not schedule.guards
            else {k: schedule.guards.get(k) for k in ("indicator", "quantile", "margin")}
            | {"forced_on_held_out": schedule.expected.get("guard")},
        }
    return {
        "sections": [s.name for s in sections_of(m)],
        "recipe": m["recipe"]["name"],
        "steps": [s["config"]["kind"] for s in m["recipe"]["steps"]],
        "layers_quantized": len(modules),
        "layers_float": len(float_layers),
        "float_layer_names": float_layers,
        "schemes": schemes,
        "quantized_bytes": qbytes,
        "quantized_float_bytes": fbytes,
        "quantized_ratio": (qbytes / fbytes) if fbytes else None,
        "transformer_bytes": total,
        "package_bytes": sum(f["size"] for f in m["files"].values()),
        "cache": cache,
        "gptq": {
            s["config"]["kind"]: s["result"]["gptq_error_ratio_median"]
            for s in m["recipe"]["steps"]
            if s["result"].get("weight_rounding") == "gptq"
        },
    }


def quality_lines(q: dict[str, Any], source: str) -> list[str]:
    """The quality report as text under a header that says where it comes from (``source``) and on
    how many samples; a family's own metrics (``ModelSpec.metrics``, reported as ``name`` and
    ``base_name``) print under their own names."""
    if not q or "psnr" not in q:
        return [f"quality, {source}: not measured"]
    lines = [
        f"quality vs original, {source} ({q['num_samples']} samples, {q['steps']} steps, "
        f"guidance {q['guidance']}):",
        f"  PSNR {q['psnr']:.2f} dB (5th pct {q['psnr_p5']:.2f}, min {q['psnr_min']:.2f})  SSIM {q['ssim']:.4f}  "
        f"cosine {q['cosine']:.5f}  latent rel-L2 {q['latent_rel_l2']:.4f}",
    ]
    for name in q:
        if f"base_{name}" in q:
            lines.append(f"  {name}: original {q[f'base_{name}']:#.4g}  optimized {q[name]:#.4g}")
    if "block_evaluations_ratio" in q:
        lines.append(
            f"  cache schedule: {q['block_evaluations_ratio']:.3f}x the block evaluations of the uncached run"
        )
    return lines
