"""``sdkiln export-onnx``: a package's transformer as an ONNX model, checked by onnxruntime.

The package is loaded by the runtime on the CPU (verified like any other), the pipeline is run for
one denoising step to capture the transformer's real inputs (two prompts, so the batch axis can be
dynamic: the exporter needs an example batch of at least 2), and the transformer is exported by
torch's dynamo exporter. sdkiln's quantized ops become QuantizeLinear / DequantizeLinear graphs
(``sdkiln.export.onnx_ops``); float layers stay as they are. Then onnxruntime (CPU) runs the model on
the captured inputs, and on their first batch row alone, and both are compared with the runtime's
own transformer: the largest absolute difference over the largest absolute output, stated in
``export.json`` and printed.

What is in the graph is one forward of the transformer. A package's cache schedule is step-level
control flow of the caller: it is copied beside the model (``cache_schedule.json``) and named in
``export.json``, not compiled in. Block-sparse attention and the schemes without an ONNX form here
(W8A8_TIMESTEP, FP8, W8A16, W4A16) are refused with one line before anything is written.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sdkiln.errors import SdkilnError
from sdkiln.export.atomic import atomic_directory, check_export_target
from sdkiln.export.onnx_ops import MIN_OPSET, translations
from sdkiln.extras import require
from sdkiln.model_zoo import get_spec
from sdkiln.model_zoo.spec import with_area
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant import scheme_classes

MODEL_FILE = "transformer.onnx"
REPORT_FILE = "export.json"
SCHEDULE_FILE = "cache_schedule.json"
FLOAT_OPSET = 18
"""The default opset of a float package (torch's default; the widest runtime support). A quantized
one needs ``MIN_OPSET`` (21, per-token blocked scales); 23 emits native Attention and RMSNormalization."""
MAX_OPSET = 23
EXTERNAL_DATA_BYTES = 2 * 1024**3
"""Above this the weights go to ``transformer.onnx.data`` (protobuf's 2 GB limit)."""
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
FLOAT_REL = 1e-5
"""The check's bound for a float package: max |onnxruntime - runtime| / max |runtime| (the same float
ops in another order; measured 3e-7 to 6e-7)."""
QUANT_REL = 1e-2
"""The bound for a quantized one: the runtime's int8 product is exact in int32 while the QDQ graph
multiplies dequantized fp32 values, and QuantizeLinear adds a static zero point after rounding where
sdkiln adds it before, so an activation at a rounding tie moves by one int8 step (measured 1.4e-4 to
6.2e-3)."""
DIR_MODE = 0o755


@dataclass
class OnnxExport:
    """What ``export_onnx`` wrote and measured."""

    out: str
    opset: int
    schemes: dict[str, int]
    inputs: dict[str, list[str | int]]
    """Input name -> its axes in the model: an int is fixed, a name is dynamic."""
    nodes: dict[str, int]
    """ONNX op type -> how many nodes."""
    quantization_nodes: int
    external_data: bool
    max_rel_error: float | None
    """max |onnxruntime - runtime| / max |runtime| over the captured inputs; None when not checked."""
    max_rel_error_batch1: float | None
    """The same on the first batch row alone (the dynamic batch axis at another size)."""
    onnxruntime: str | None
    cache_schedule: str | None
    seconds: float
    notes: list[str] = field(default_factory=list)


def _check_package(manifest: dict[str, Any]) -> dict[str, int]:
    if "sparse_attention" in manifest:
        raise SdkilnError(
            "ONNX export of block-sparse attention is not supported (its block selection is data-dependent "
            "and has no ONNX form here); export a package made without sparse-attn"
        )
    if "attention_quant" in manifest:
        raise SdkilnError(
            "ONNX export of quantized attention is not supported (sdkiln::quantized_attention has no ONNX form "
            "here); export a package made without attn-int8/attn-fp8"
        )
    schemes = Counter(m["scheme"] for m in manifest["modules"].values())
    exportable = sorted(s for s, cls in scheme_classes().items() if cls.onnx_form)
    other = sorted(set(schemes) - set(exportable))
    if other:
        raise SdkilnError(
            f"ONNX export supports {', '.join(exportable)} and float layers; this package has "
            f"{', '.join(f'{schemes[s]} {s}' for s in other)} layers"
        )
    return dict(sorted(schemes.items()))


def _check_opset(opset: int | None, quantized: bool) -> int:
    low = MIN_OPSET if quantized else FLOAT_OPSET
    if opset is None:
        return low
    if not low <= opset <= MAX_OPSET:
        why = (
            "per-token scales need blocked QuantizeLinear, opset 21" if quantized else "the exporter's range"
        )
        raise SdkilnError(f"--opset {opset}: this package needs {low} to {MAX_OPSET} ({why})")
    return opset


def _check_out(target: Path, force: bool) -> None:
    check_export_target(target, force, REPORT_FILE, "an sdkiln ONNX export")


class _Positional(torch.nn.Module):
    """The transformer called with its tensor inputs in a fixed order (the exporter's inputs)."""

    def __init__(self, transformer: torch.nn.Module, names: list[str]):
        super().__init__()
        self.transformer = transformer
        self.names = names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.transformer(**dict(zip(self.names, tensors, strict=True)), return_dict=False)
        return out[0]


def capture_inputs(pipe, height: int | None, width: int | None) -> dict[str, torch.Tensor]:
    """The transformer's tensor inputs at the first denoising step of a 2-prompt, 1-step call."""
    transformer = getattr(pipe, pipe.sdkiln_manifest["model"]["transformer_attr"])
    captured: dict[str, Any] = {}

    def grab(module, args, kwargs):
        if not captured:
            if args:
                raise SdkilnError("ONNX export: the transformer was called with positional inputs")
            captured.update(kwargs)

    info = pipe.sdkiln_manifest["model"]
    kwargs = dict(pipe.sdkiln_manifest["call"]["defaults"])
    kwargs.update(num_inference_steps=1, output_type="latent")
    if height is not None:
        kwargs["height"] = height
    if width is not None:
        kwargs["width"] = width
    with_area(kwargs)
    prompts = ["a photo of a cat", "a red car"]
    handle = transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            pipe(
                prompt=prompts,
                generator=torch.Generator().manual_seed(0),
                **kwargs,
                **get_spec(info["family"], info.get("variant")).condition(kwargs, len(prompts)),
            )
    finally:
        handle.remove()
    return {k: v.clone() for k, v in captured.items() if torch.is_tensor(v)}


def _dynamic_axes(inputs: dict[str, torch.Tensor]) -> tuple[dict[int, Any], ...]:
    """Which axes may be dynamic: the batch and token axes, never a feature or spatial one. A 1-D or
    2-D input's first axis (timesteps, pooled text; token ids), a 3-D one's first two (batch,
    tokens), a latent's batch. ``Dim.AUTO`` lets the exporter keep an axis fixed where the model
    fixes it (a learned positional table)."""
    auto = torch.export.Dim.AUTO
    axes = {1: (0,), 2: (0,), 3: (0, 1)}
    return tuple({i: auto for i in axes.get(t.ndim, (0,))} for t in inputs.values())


def _max_rel(a: np.ndarray, b: torch.Tensor) -> float:
    ref = b.float()
    return float(
        (torch.from_numpy(np.asarray(a, dtype=np.float32)) - ref).abs().max()
        / ref.abs().max().clamp(min=1e-30)
    )


def _batch_rows(inputs: dict[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    """The first batch row of every input whose first axis is the batch (not the token ids)."""
    return {
        k: v[:1] if v.ndim >= 1 and v.shape[0] == batch and not k.endswith("_ids") else v
        for k, v in inputs.items()
    }


def export_onnx(
    package: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    opset: int | None = None,
    height: int | None = None,
    width: int | None = None,
    check: bool = True,
    force: bool = False,
) -> OnnxExport:
    """Write ``package``'s transformer as ONNX into ``out_dir`` (atomically; an existing export is
    replaced only with ``force``) and, with ``check``, compare onnxruntime's outputs with the
    runtime's. ``height``/``width`` set the example inputs' size (default: the package's)."""
    require("onnx", "onnxscript", extra="onnx", what="ONNX export")
    if check:
        require("onnxruntime", extra="onnx", what="checking an ONNX export")
    import onnx

    from sdkiln.runtime.cache.hooks import detach_cache
    from sdkiln.runtime.cache.restore import schedule_file
    from sdkiln.runtime.loader import load

    started = time.perf_counter()
    target = Path(out_dir)
    _check_out(target, force)
    pkg = open_package(package)
    get_spec(pkg.manifest["model"]["family"]).refuse("onnx")  # refusals are the family's
    schemes = _check_package(pkg.manifest)
    opset = _check_opset(opset, bool(schemes))
    pipe = load(pkg.root, "cpu", digest=pkg.digest)  # the directory verified above
    transformer = getattr(pipe, pkg.manifest["model"]["transformer_attr"])
    inputs = capture_inputs(pipe, height, width)
    detach_cache(transformer)  # the graph is one plain forward; the schedule is the caller's
    names = list(inputs)
    model = _Positional(transformer, names).eval()
    with torch.inference_mode():
        reference = model(*inputs.values())
    batch = reference.shape[0]
    rows = _batch_rows(inputs, batch)
    with torch.inference_mode():
        reference1 = model(*rows.values())
    program = torch.onnx.export(
        model,
        tuple(inputs.values()),
        input_names=names,
        output_names=["sample"],
        opset_version=opset,
        dynamo=True,
        dynamic_shapes=(_dynamic_axes(inputs),),
        custom_translation_table=translations(),
        verbose=False,
    )
    weight_bytes = sum(
        p.numel() * p.element_size() for p in list(transformer.parameters()) + list(transformer.buffers())
    )
    external = weight_bytes > EXTERNAL_DATA_BYTES
    schedule = schedule_file(pkg.manifest)
    with atomic_directory(target, check=lambda t: _check_out(t, force), mode=DIR_MODE) as tmp:
        program.save(str(tmp / MODEL_FILE), external_data=external)
        graph = onnx.load(str(tmp / MODEL_FILE), load_external_data=False).graph
        nodes = dict(sorted(Counter(n.op_type for n in graph.node).items()))
        shapes = {
            i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input
        }
        error = error1 = version = None
        if check:
            import onnxruntime as ort

            session = ort.InferenceSession(str(tmp / MODEL_FILE), providers=["CPUExecutionProvider"])
            error = _max_rel(session.run(None, {k: v.numpy() for k, v in inputs.items()})[0], reference)
            error1 = _max_rel(session.run(None, {k: v.numpy() for k, v in rows.items()})[0], reference1)
            version = ort.__version__
            bound = QUANT_REL if schemes else FLOAT_REL
            if not max(error, error1) <= bound:  # NaN fails too; nothing is written
                raise SdkilnError(
                    f"ONNX export: onnxruntime's output differs from sdkiln's runtime by {max(error, error1):.2e} "
                    f"(relative to its largest value), above the bound {bound:g}; nothing was written"
                )
        if schedule is not None:
            (tmp / SCHEDULE_FILE).write_bytes(bytes(pkg.data(schedule)))
        result = OnnxExport(
            out=str(target),
            opset=opset,
            schemes=schemes,
            inputs=shapes,
            nodes=nodes,
            quantization_nodes=sum(nodes.get(op, 0) for op in QDQ_OPS),
            external_data=external,
            max_rel_error=error,
            max_rel_error_batch1=error1,
            onnxruntime=version,
            cache_schedule=SCHEDULE_FILE if schedule is not None else None,
            seconds=round(time.perf_counter() - started, 1),
        )
        if schedule is not None:
            result.notes.append(
                f"{SCHEDULE_FILE}: the package's cache schedule; the graph is one uncached forward and the "
                "caller applies the schedule"
            )
        report = asdict(result) | {"package_digest": pkg.digest, "base_id": pkg.manifest["model"]["base_id"]}
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return result
