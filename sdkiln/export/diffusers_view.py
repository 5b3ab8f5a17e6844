"""``sdkiln export-diffusers``: a package as a directory plain ``diffusers`` loads with
``from_pretrained``, for the schemes diffusers' torchao backend represents.

W8A8_DYNAMIC layers become torchao's ``Int8DynamicActivationInt8WeightConfig`` and W8A16 layers
(per channel) ``Int8WeightOnlyConfig``, each named by its exact module path (``FqnToConfig``), so
exactly the package's quantized layers are quantized. Both store an ``Int8Tensor`` of the same
layout as the package (int8 values [N, K], one fp32 scale per output channel): the package's
values and scales are copied in bit for bit, not re-quantized. The transformer is written with
``save_pretrained(safe_serialization=True)`` (safetensors, no pickle); the other components are the
package's files as they are. Activations are quantized at run time by torchao's own per-token rule,
so outputs agree with sdkiln's runtime to a stated tolerance, not bitwise
(``sdkiln_export.json`` holds the measured error on captured transformer inputs; above ``VIEW_REL``
the export fails and writes nothing).

Left out, and listed in ``dropped``: the package's cache schedule (diffusers runs every step; its
own cache hooks take another format) and quality report. Refused with one line: block-sparse
attention, static and step-dependent activation scales, SmoothQuant factors, grouped or 4-bit
weights and FP8.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sdkiln.errors import SdkilnError
from sdkiln.export.atomic import atomic_directory, check_export_target
from sdkiln.extras import require
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant import scheme_classes

REPORT_FILE = "sdkiln_export.json"
VIEW_REL = 1e-2
"""The check's bound, max |diffusers - runtime| / max |runtime| of the transformer: the weights are the
package's, but torchao quantizes activations per token by its own rule and computes in its own order
(measured 8e-4 on flux-tiny)."""
SDKILN_ONLY = ("eval/", "calibration/", "cache/", "attention/")
"""Package files diffusers has no use for; they stay out of the view."""
DIR_MODE = 0o755


@dataclass
class DiffusersView:
    out: str
    schemes: dict[str, int]
    max_rel_error: float | None
    """max |diffusers - sdkiln runtime| / max |sdkiln runtime| of the transformer on captured inputs."""
    torchao: str
    seconds: float
    dropped: list[str]


def _check_package(manifest: dict[str, Any]) -> dict[str, int]:
    if "experts" in manifest:
        raise SdkilnError(
            f"the diffusers view writes one transformer, and this package has others too "
            f"({', '.join(manifest['experts'])}: Wan2.2-A14B's experts); load it with sdkiln.load"
        )
    if "sparse_attention" in manifest:
        raise SdkilnError(
            "the diffusers view cannot carry block-sparse attention: export a package without it"
        )
    if "attention_quant" in manifest:
        raise SdkilnError(
            "the diffusers view cannot carry quantized attention (diffusers has no such attention backend): "
            "export a package made without attn-int8/attn-fp8"
        )
    encoders = manifest.get("text_encoders") or {}
    if encoders:
        name = next(iter(encoders))
        raise SdkilnError(
            f"the diffusers view copies the text encoders as plain transformers models, and this package "
            f"quantized {name} ({len(encoders[name]['modules'])} layers); make the package with a recipe "
            "without a te-* step (e.g. quant-auto+cache-auto) to export it"
        )
    representable = sorted(s for s, cls in scheme_classes().items() if cls.torchao_config)
    schemes: dict[str, int] = {}
    for name, info in manifest["modules"].items():
        scheme = info["scheme"]
        if scheme not in representable:
            raise SdkilnError(
                f"the diffusers view represents {', '.join(representable)} layers only (torchao in diffusers); "
                f"{name} is {scheme}"
            )
        extra = sorted(set(info) - {"scheme"})
        if extra:
            raise SdkilnError(
                f"the diffusers view cannot carry {name}'s {', '.join(extra)} (torchao's int8 layers are plain "
                "per-channel)"
            )
        schemes[scheme] = schemes.get(scheme, 0) + 1
    return dict(sorted(schemes.items()))


def _check_out(target: Path, force: bool) -> None:
    check_export_target(target, force, REPORT_FILE, "an sdkiln diffusers view")


def _torchao_config(manifest: dict[str, Any]):
    import torchao.quantization
    from diffusers import TorchAoConfig
    from torchao.quantization import FqnToConfig

    classes = scheme_classes()
    return TorchAoConfig(
        FqnToConfig(
            {
                n: getattr(torchao.quantization, classes[i["scheme"]].torchao_config)()
                for n, i in manifest["modules"].items()
            }
        )
    )


def _float_state(transformer: torch.nn.Module, quantized: list[str]) -> dict[str, torch.Tensor]:
    """The transformer's state with each quantized layer as a float Linear (values times scales)."""
    state = {}
    for name, tensor in transformer.state_dict().items():
        layer, _, leaf = name.rpartition(".")
        if layer in quantized:
            if leaf == "weight":
                module = transformer.get_submodule(layer)
                state[name] = module.weight.float() * module.weight_scale.reshape(-1, 1)
            elif leaf == "bias":
                state[name] = tensor
            continue  # scales, offsets: carried by the Int8Tensor
        state[name] = tensor
    return state


def _copy_int8(view: torch.nn.Module, runtime: torch.nn.Module, quantized: list[str]) -> None:
    """Put the package's int8 values and scales into the view's Int8Tensors (same layout)."""
    for name in quantized:
        weight = view.get_submodule(name).weight
        source = runtime.get_submodule(name)
        qdata, scale = weight.qdata, weight.scale
        if qdata.shape != source.weight.shape or scale.numel() != source.weight_scale.numel():
            raise SdkilnError(
                f"{name}: torchao's int8 layout {tuple(qdata.shape)} differs from the package's"
            )
        with torch.no_grad():
            qdata.copy_(source.weight)
            scale.copy_(source.weight_scale.reshape(scale.shape))


def export_diffusers(
    package: str | os.PathLike, out_dir: str | os.PathLike, *, check: bool = True, force: bool = False
) -> DiffusersView:
    """Write the diffusers view of ``package`` into ``out_dir`` (atomically; an existing view is
    replaced only with ``force``); with ``check``, load it back with plain diffusers and compare its
    transformer with sdkiln's runtime on inputs captured from one denoising step."""
    require("torchao", extra="diffusers-view", what="the diffusers view")
    import torchao

    from sdkiln.export.onnx import capture_inputs
    from sdkiln.runtime.cache.hooks import detach_cache
    from sdkiln.runtime.components import resolve_class
    from sdkiln.runtime.loader import load

    started = time.perf_counter()
    target = Path(out_dir)
    _check_out(target, force)
    pkg = open_package(package)
    manifest = pkg.manifest
    schemes = _check_package(manifest)
    model = manifest["model"]
    attr = model["transformer_attr"]
    pipe = load(pkg.root, "cpu", digest=pkg.digest)  # the directory verified above
    runtime = getattr(pipe, attr)
    inputs = capture_inputs(pipe, None, None) if check else None
    detach_cache(runtime)  # compared as diffusers runs it: every step computed
    quantized = sorted(manifest["modules"])
    cls = resolve_class(f"diffusers:{model['transformer_class']}", torch.nn.Module, "transformer")
    dtype = getattr(torch, model["dtype"])
    dropped = sorted({rel.split("/")[0] + "/" for rel in manifest["files"] if rel.startswith(SDKILN_ONLY)})
    with tempfile.TemporaryDirectory(prefix="sdkiln-view-") as scratch:
        float_model = cls.from_config(runtime.config)
        float_model.load_state_dict(_float_state(runtime, quantized), strict=True)
        float_model.save_pretrained(scratch, safe_serialization=True)
        view = cls.from_pretrained(scratch, quantization_config=_torchao_config(manifest), torch_dtype=dtype)
        _copy_int8(view, runtime, quantized)
        with atomic_directory(target, check=lambda t: _check_out(t, force), mode=DIR_MODE) as tmp:
            for rel in manifest["files"]:
                if rel.startswith((f"{attr}/", *SDKILN_ONLY)):
                    continue
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                pkg.copy(rel, tmp / rel)
            view.save_pretrained(str(tmp / attr), safe_serialization=True)
            error = None
            if check:
                loaded = cls.from_pretrained(str(tmp / attr), torch_dtype=dtype).eval()
                with torch.inference_mode():
                    ours = runtime(**inputs, return_dict=False)[0].float()
                    theirs = loaded(**inputs, return_dict=False)[0].float()
                error = float((theirs - ours).abs().max() / ours.abs().max().clamp(min=1e-30))
                if not error <= VIEW_REL:  # NaN fails too; nothing is written
                    raise SdkilnError(
                        f"diffusers view: plain diffusers' transformer differs from sdkiln's runtime by {error:.2e} "
                        f"(relative to its largest value), above the bound {VIEW_REL:g}; nothing was written"
                    )
            result = DiffusersView(
                out=str(target),
                schemes=schemes,
                max_rel_error=error,
                torchao=torchao.__version__,
                seconds=round(time.perf_counter() - started, 1),
                dropped=dropped,
            )
            report = asdict(result) | {"package_digest": pkg.digest, "base_id": model["base_id"]}
            (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return result
