"""A package's memory table, read from its manifest and safetensors headers alone (nothing loaded):
per component the bytes on disk and in memory, the deployment's activation estimates, each residency
plan's estimated peak and the smallest budget it fits, and what ``optimize`` measured where it ran
(its peak host and device bytes; on a GPU, the device peak of the quality report's generation, the
phase that runs the package as deployed).
``sdkiln inspect`` prints it; the model card carries it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sdkiln.runtime.components import stored_infos
from sdkiln.runtime.memory.plan import HEADROOM, Sizes, candidates, peak
from sdkiln.runtime.memory.sizes import sizes_at
from sdkiln.runtime.package import Package
from sdkiln.runtime.safetensors_data import DTYPES

REPORT = "report/optimize.json"


def package_sizes(pkg: Package, spec: Any, call: dict[str, Any]) -> tuple[Sizes, dict[str, int]]:
    """The planner's ``Sizes`` of a package at ``call``'s size, and each component's bytes on disk."""
    m = pkg.manifest
    attrs = (m["model"]["transformer_attr"], *m.get("experts", {}))  # Wan2.2-A14B's transformer_2 too
    index = pkg.read_json("model_index.json")
    names = [n for n, v in index.items() if not n.startswith("_") and isinstance(v, list) and v[0]]
    memory, disk, infos = {}, {}, {}
    for name in names:
        files = [rel for rel in m["files"] if rel.startswith(f"{name}/")]
        if not any(rel.endswith(".safetensors") for rel in files):
            continue  # a scheduler, a tokenizer, a processor
        infos[name] = stored_infos(pkg, name)
        memory[name] = sum(i.end - i.start for i in infos[name].values())
        disk[name] = sum(m["files"][rel]["size"] for rel in files)
    blocks: dict[str, list[int]] = {}
    widths: Counter[int] = Counter()
    dtypes: Counter[int] = Counter()
    for attr in attrs:
        per_block: dict[str, int] = {}
        for key, info in infos.get(attr, {}).items():
            parts = key.split(".")
            if len(parts) > 2 and parts[1].isdigit():
                block = f"{parts[0]}.{parts[1]}"
                per_block[block] = per_block.get(block, 0) + info.end - info.start
            if key.endswith(".weight") and len(info.shape) == 2:
                widths[info.shape[1]] += 1
            torch_dtype = DTYPES.get(info.dtype)
            if torch_dtype is not None and torch_dtype.is_floating_point:
                dtypes[torch_dtype.itemsize] += info.numel
        lists = Counter(k.split(".")[0] for k in per_block)
        ordered = sorted(
            (k for k in per_block if lists[k.split(".")[0]] >= 2),
            key=lambda k: (k.split(".")[0], int(k.split(".")[1])),
        )
        blocks[attr] = [per_block[k] for k in ordered]
    dtype_size = dtypes.most_common(1)[0][0] if dtypes else 2
    sizes = sizes_at(memory, spec, call, attrs, blocks, widths, dtype_size, lambda n: _vae_class(index[n]))
    return sizes, disk


def _vae_class(entry: Any) -> type | None:
    """The VAE's diffusers class named in ``model_index.json``, for whether it can decode in tiles."""
    import diffusers

    cls = (
        getattr(diffusers, entry[1], None) if entry[0] == "diffusers" and isinstance(entry[1], str) else None
    )
    return cls if isinstance(cls, type) else None


def deployment_call(pkg: Package) -> tuple[Any, dict[str, Any]]:
    """The family spec and the call the package was made for (its deployment's size and steps)."""
    from sdkiln.model_zoo import get_spec

    m = pkg.manifest
    spec = get_spec(m["model"]["family"], m["model"].get("variant"))
    deployment = m.get("recipe", {}).get("deployment", {})
    size = {k: deployment.get(k) for k in ("height", "width", "num_frames", "max_sequence_length")}
    return spec, spec.call_kwargs(**{**m.get("call", {}).get("defaults", {}), **size})


def deployment_sizes(pkg: Package) -> tuple[Sizes, dict[str, int]]:
    """``package_sizes`` at the package's deployment."""
    spec, call = deployment_call(pkg)
    return package_sizes(pkg, spec, call)


def memory_table(pkg: Package) -> dict[str, Any]:
    """The table (module docstring) for the package's deployment."""
    spec, call = deployment_call(pkg)
    sizes, disk = package_sizes(pkg, spec, call)
    plans = {}
    for name, visiting, group, tiled in candidates(sizes):
        need = peak(sizes, visiting, group, tiled=tiled)
        plans[name] = {"peak_bytes": need, "budget_bytes": int(need / (1 - HEADROOM)) + 1}
    measured = {}
    if REPORT in pkg.manifest["files"]:
        report = pkg.read_json(REPORT)
        measured = {
            k: report.get(k)
            for k in ("device", "peak_host_bytes", "peak_device_bytes")
            if isinstance(report, dict)
        }
        phases = report.get("phases") if isinstance(report, dict) else None
        generation = [
            p for p in phases or [] if isinstance(p, dict) and p.get("name") == "report: optimized model"
        ]
        if generation and isinstance(generation[0].get("peak_device_bytes"), int):
            measured["report_generation_peak_device_bytes"] = generation[0]["peak_device_bytes"]
    return {
        "deployment": {k: call.get(k) for k in ("height", "width", "num_frames", "max_sequence_length")},
        "components": {
            name: {"disk_bytes": disk[name], "memory_bytes": sizes.components[name]}
            for name in sizes.components
        },
        "estimates": {
            "transformer_call_activation_bytes": sizes.activations,
            "encode_activation_bytes": sizes.encode_activations,
            "decode_activation_bytes": sizes.decode_activations,
            "decode_tiled_activation_bytes": sizes.decode_tiled_activations,
            "transformer_blocks": len(sizes.blocks[sizes.transformers[0]]),
        },
        "plans": plans,
        "optimize_measured": measured,
    }


def table_lines(table: dict[str, Any]) -> list[str]:
    """The table in a few lines (``sdkiln inspect``)."""
    from sdkiln.runtime.memory.plan import gib

    d = table["deployment"]
    at = "x".join(str(d[k]) for k in ("height", "width") if d.get(k)) + (
        f", {d['num_frames']} frames" if d.get("num_frames") else ""
    )
    parts = ", ".join(f"{n} {gib(c['memory_bytes'])}" for n, c in table["components"].items())
    est = table["estimates"]
    lines = [
        f"memory: {parts} in memory; a transformer call's activations about "
        f"{gib(est['transformer_call_activation_bytes'])}{f' at {at}' if at else ''} (estimate)",
        "memory budgets: "
        + ", ".join(f"{name} from {gib(p['budget_bytes'])}" for name, p in table["plans"].items())
        + " (sdkiln run --memory-budget; docs/memory.md)",
    ]
    measured = table.get("optimize_measured") or {}
    if measured.get("peak_host_bytes") or measured.get("peak_device_bytes"):
        device = measured.get("peak_device_bytes")
        generation = measured.get("report_generation_peak_device_bytes")
        lines.append(
            f"optimize measured on {measured.get('device')}: peak host {gib(measured['peak_host_bytes'] or 0)}"
            + (f", peak device {gib(device)}" if device else "")
            + (f" (the quality report's generation: {gib(generation)})" if generation else "")
        )
    return lines
