"""What a package holds, in numbers: ``sdkiln inspect`` prints it, and a model card can quote it.

Read from the verified package's files (the manifest, the recipe record of the offline job, the
tensors' headers), never recomputed from memory. It lives with the writers because it reads what
the offline job recorded; the runtime needs none of it.
"""

from __future__ import annotations

from typing import Any

from sdkiln.errors import PackageError
from sdkiln.runtime.attention.quantized import NAME as ATTENTION_QUANT
from sdkiln.runtime.attention.quantized import AttentionQuantPlan
from sdkiln.runtime.cache.restore import schedule_file
from sdkiln.runtime.cache.schedule import CacheSchedule
from sdkiln.runtime.components import stored_infos
from sdkiln.runtime.experts import expert_views
from sdkiln.runtime.memory.table import memory_table
from sdkiln.runtime.package import Package
from sdkiln.runtime.restore import section_file, sections_of
from sdkiln.runtime.safetensors_data import DTYPES

# A quantized weight stored as uint8 holds two int4 values a byte (W4A16, ``sdkiln.kernels.int4``).
_WEIGHT_VALUES_PER_ELEMENT = {"U8": 2}


def summarize(pkg: Package) -> dict[str, Any]:
    """Layers quantized and kept in float, and the quantized layers' bytes against fp32.

        ``quantized_bytes`` counts every tensor a quantized layer stores except its float bias: the
        int8, float8 or packed int4 weight, its scales and offsets, and a static layer's activation
        parameters, ``deq_scale`` and ``quant_bias`` (and a SmoothQuant ``mul_scale``);
        ``quantized_float_bytes`` is what the same weights weigh in float32. The float bias is the same
        in both and is not counted. ``lora_layers`` counts the layers a runtime LoRA can target
        (``sdkiln.runtime.lora``): the quantized ones (as branches) and the float linears (2-D weights);
        ``fused_loras`` lists LoRAs ``optimize --lora`` fused into the weights; ``quality_target`` is the
        package ``optimize --match-quality`` matched the cache to (or None). ``text_encoders`` has, per
        text encoder the text-encoder step took, its quantized layers by scheme, the SQNR its gate read
        and its decision. ``memory`` is the package's
    memory table (``runtime.memory.table``).
    """
    m = pkg.manifest
    float_layers = sorted(
        {n for step in m["recipe"]["steps"] for n in step["result"].get("float", [])} - set(m["modules"])
    )
    return {
        "fused_loras": m["model"].get("fused_loras", []),
        "quality_target": m["recipe"].get("quality_target"),
        "sections": [s.name for s in sections_of(m)],
        "recipe": m["recipe"]["name"],
        "steps": [s["config"]["kind"] for s in m["recipe"]["steps"]],
        **_transformer(pkg, m),
        "text_encoders": _text_encoders(m),
        "layers_float": len(float_layers),
        "float_layer_names": float_layers,
        "package_bytes": sum(f["size"] for f in m["files"].values()),
        "memory": memory_table(pkg),
        "gptq": {
            s["config"]["kind"]: s["result"]["gptq_error_ratio_median"]
            for s in m["recipe"]["steps"]
            if s["result"].get("weight_rounding") == "gptq"
        },
        "experts": {attr: _transformer(pkg, view) for attr, view in expert_views(m).items()}
        if "experts" in m
        else {},
    }


def _transformer(pkg: Package, m: dict[str, Any]) -> dict[str, Any]:
    """One transformer's part, from the manifest ``m`` (the package's, or an expert's view of it)."""
    attr = m["model"]["transformer_attr"]
    modules = m["modules"]
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
        window = schedule.search.get("steps", [0, schedule.num_steps - 1])  # the steps it runs
        if not (
            isinstance(window, list)
            and [type(v) for v in window] == [int, int]
            and 0 <= window[0] <= window[1] < schedule.num_steps
        ):
            raise PackageError(
                f"{where}: search.steps must be [first, last] steps of the run, got {window!r}"
            )
        first, last = window
        actions = next(iter(schedule.actions.values()))[first : last + 1]
        n = schedule.num_blocks
        cache = {
            "num_steps": schedule.num_steps,
            "steps": [first, last],
            "block_evaluations_ratio": sum(a.block_evaluations(n) for a in actions) / (n * len(actions)),
            "actions": [str(a) for a in actions],
            "expected": schedule.expected,
            "guard": None
            if not schedule.guards
            else {k: schedule.guards.get(k) for k in ("indicator", "quantile", "margin")}
            | {"forced_on_held_out": schedule.expected.get("guard")},
        }
    quantized_prefixes = tuple(f"{layer}." for layer in modules)
    float_linears = [
        key.removesuffix(".weight")
        for key, info in infos.items()
        if key.endswith(".weight") and len(info.shape) == 2 and not key.startswith(quantized_prefixes)
    ]
    return {
        "layers_quantized": len(modules),
        "lora_layers": {"quantized": len(modules), "float": len(float_linears)},
        "schemes": schemes,
        "quantized_bytes": qbytes,
        "quantized_float_bytes": fbytes,
        "quantized_ratio": (qbytes / fbytes) if fbytes else None,
        "transformer_bytes": total,
        "cache": cache,
        "attention_quant": _attention_quant(pkg, m),
    }


def _attention_quant(pkg: Package, m: dict[str, Any]) -> dict[str, Any] | None:
    """The attention-quantization plan's formats, its layers, and the fraction of (layer, denoising step)
    pairs over every attention layer that run quantized (the step's record)."""
    where = section_file(m, ATTENTION_QUANT)
    if where is None:
        return None
    plan = AttentionQuantPlan.from_dict(pkg.read_json(where), where)
    return {
        "file": where,
        "qk": plan.qk,
        "pv": plan.pv,
        "layout": plan.layout,
        "layers": len(plan.layers),
        "rotated_layers": sum(e["rotate"] for e in plan.layers.values()),
        "quantized_fraction": plan.record.get("quantized_fraction", 0.0),
    }


def _text_encoders(m: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per text encoder the text-encoder step took: its quantized layers by scheme (from the
    ``text_encoders`` section), the gate's SQNR and its decision (from the step's record)."""
    out: dict[str, dict[str, Any]] = {}
    for step in m["recipe"]["steps"]:
        encoders = (
            step.get("result", {}).get("encoders")
            if step.get("config", {}).get("kind") == "text_encoder_quant"
            else None
        )
        for name, entry in (encoders or {}).items():
            modules = m.get("text_encoders", {}).get(name, {}).get("modules", {})
            schemes: dict[str, int] = {}
            for info in modules.values():
                schemes[info["scheme"]] = schemes.get(info["scheme"], 0) + 1
            out[name] = {
                "schemes": schemes,
                "sqnr_db": entry.get("sqnr_db"),
                "decision": entry.get("decision"),
            }
    return out


def matched_text(target: dict[str, Any], path: bool = True) -> str:
    """``recipe.quality_target`` in words: ``inspect`` names the package as given and its digest, the
    model card (``path`` False) the digest alone (the path was the maker's)."""
    held = target["held_out"]
    name = f"{target['package']} ({target['digest'][:19]}...)" if path else f"the package {target['digest']}"
    return (
        f"{name}: its held-out {held['psnr_mean_db']:.2f} dB (5th pct "
        f"{held['psnr_p5_db']:.2f}, {held['samples']} samples, {held['block_evaluations_ratio']:.3f}x block "
        f"evaluations) less {target['slack_db']:g} dB was this search's floor"
    )


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
