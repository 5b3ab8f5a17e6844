"""The ``sdkiln`` command: parse arguments, call the library, print. See ``sdkiln COMMAND --help``."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from sdkiln.cli_export import add_export_parsers, print_ascend
from sdkiln.cli_run import check_text, cmd_run, kernel_lines
from sdkiln.cli_serve import add_serve_parser
from sdkiln.errors import ModelError, SdkilnError, failures_outside_sdkiln

MAX_ERROR_CHARS = 1000


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line reported as one line (its usage block is ``--help``'s)."""

    def error(self, message: str):
        _print_error(f"{message} (see `{self.prog} --help`)")
        sys.exit(2)


def bounded(kind: type, lo: float, hi: float):
    """An argparse type: ``kind`` (int or float) within [lo, hi]; NaN is never within."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text} is outside [{lo}, {hi}]")
        return value

    return parse


STEPS = bounded(int, 1, 1000)
SIZE = bounded(int, 8, 4096)
GUIDANCE = bounded(float, 0.0, 100.0)
SEED = bounded(int, 0, 2**63 - 1_000_000)  # image i uses seed + i
SAMPLES = bounded(int, 1, 10_000)
DEGREE = bounded(int, 1, 1024)
TIMEOUT = bounded(float, 1.0, 86_400.0)


def LORA(text: str):
    """``--lora FILE[:STRENGTH]`` as a ``LoraFile``; a bad one is argparse's one-line error."""
    from sdkiln.configs.runtime import LoraFile

    try:
        return LoraFile.parse(text)
    except SdkilnError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--lora {text}: ")) from None


def _print_error(message: str) -> None:
    line = " ".join(str(message).split())
    if len(line) > MAX_ERROR_CHARS:
        line = line[: MAX_ERROR_CHARS - 3] + "..."
    # lone surrogates (command-line bytes that are not UTF-8) would make the write itself fail
    print(f"sdkiln: error: {line}".encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)


def _quality_lines(q: dict[str, Any], source: str) -> list[str]:
    from sdkiln.export.summary import quality_lines

    return quality_lines(q, source)


def cmd_optimize(args) -> int:
    from sdkiln.configs import Deployment
    from sdkiln.optimizer import optimize

    check_text(args.recipe, "--recipe")
    if args.model is not None:
        check_text(args.model, "model")
    if args.ascend_dtype is not None and args.format != "ascend":
        raise SdkilnError("--ascend-dtype is the dtype of the Ascend files: it needs --format ascend")
    if args.match_slack is not None and args.match_quality is None:
        raise SdkilnError("--match-slack is how far under --match-quality's package the floor goes: give it")
    if args.match_quality is not None:
        check_text(args.match_quality, "--match-quality")
    from sdkiln.model_zoo import DTYPES
    from sdkiln.optimizer.match import DEFAULT_SLACK_DB

    if args.match_slack is None:
        args.match_slack = DEFAULT_SLACK_DB

    t0 = time.perf_counter()
    result = optimize(
        args.model,
        args.recipe,
        args.out,
        force=args.force,
        eval_samples=args.eval_samples,
        deployment=Deployment(
            num_inference_steps=args.steps,
            guidance=args.guidance,
            height=args.height,
            width=args.width,
            num_frames=args.frames,
            max_sequence_length=args.max_sequence_length,
        ),
        format=args.format,
        ascend_dtype=args.ascend_dtype,
        dtype=None if args.dtype == "auto" else DTYPES[args.dtype],
        device=args.device,
        eval_batch=args.eval_batch,
        lora=args.lora,
        match_quality=args.match_quality,
        match_slack_db=args.match_slack,
    )
    experts = "".join(
        f", {len(e.get('modules', {}))} in {attr}" for attr, e in result.manifest.get("experts", {}).items()
    )
    print(
        f"optimized {result.manifest['model']['base_id']} with recipe {args.recipe!r}: "
        f"{len(result.manifest['modules'])} layers quantized{experts}"
    )
    print("\n".join(_quality_lines(result.quality or {}, "measured now and stored in the package")))
    print(f"package: {result.package}  ({time.perf_counter() - t0:.1f} s)")
    if result.ascend is not None:
        print_ascend(result.ascend)
    return 0


class _OptimizeParser(_Parser):
    """``optimize --help`` ends with the families and their variants; reading the specs imports
    diffusers (the embedded model's), so it happens only when the help is shown."""

    def format_help(self) -> str:
        from sdkiln.model_zoo import families_help

        self.epilog = (
            "model families (a diffusers directory is recognised by its pipeline class, its variant by its "
            "transformer's width; docs/families.md says what each can do):\n" + families_help()
        )
        return super().format_help()


def cmd_inspect(args) -> int:
    from sdkiln.export.summary import matched_text, summarize
    from sdkiln.runtime.manifest_schema import check_quality
    from sdkiln.runtime.package import QUALITY_REPORT, open_package

    pkg = open_package(args.package, digest=args.digest)
    pkg.verify()  # the weights too: inspect vouches for the whole package
    summary = summarize(pkg)
    quality = check_quality(pkg.read_json(QUALITY_REPORT), QUALITY_REPORT)
    if args.json:
        print(json.dumps({**pkg.manifest, "digest": pkg.digest, "summary": summary}, indent=2))
        return 0
    m = pkg.manifest
    print(
        f"package {pkg.root}: {m['format']} v{m['schema_version']}, sdkiln {m['sdkiln_version']}, {m['created']}"
    )
    print(f"digest: {pkg.digest}  (pin it: sdkiln run --digest, sdkiln.load(..., digest=))")
    info = m["model"]
    variant = f" {info['variant']}" if "variant" in info else ""
    print(f"model: {info['base_id']} ({info['family']}{variant}; {info['pipeline_class']}, {info['dtype']})")
    print(f"recipe: {summary['recipe']}  recipe steps: {', '.join(summary['steps']) or '(none)'}")
    print(f"sections: {', '.join(summary['sections']) or '(none)'}")
    print(
        f"layers: {summary['layers_quantized']} quantized {summary['schemes']}, {summary['layers_float']} kept in float"
    )
    for name, te in summary["text_encoders"].items():
        layers = ", ".join(f"{n} layers {scheme}" for scheme, n in te["schemes"].items()) or "float"
        sqnr = te["sqnr_db"]
        gate = f"{sqnr:.1f} dB" if isinstance(sqnr, float) else str(sqnr)
        why = str(te["decision"]).removeprefix("float: ")
        print(
            f"text encoder {name}: {layers} (conditioning SQNR {gate})"
            if te["schemes"]
            else f"text encoder {name}: float ({why})"
        )
    lora = summary["lora_layers"]
    print(
        f"LoRA: a runtime LoRA may target {lora['quantized'] + lora['float']} layers ({lora['quantized']} quantized, "
        f"as branches; {lora['float']} float) (docs/lora.md)"
    )
    for fused in summary["fused_loras"]:
        print(
            f"fused LoRA: {fused['file']} at strength {fused['strength']:g} on {fused['layers']} layers (sha256 {fused['sha256'][:12]}...)"
        )
    if summary["quantized_float_bytes"]:
        print(
            f"quantized layers: {summary['quantized_bytes']:,} bytes vs {summary['quantized_float_bytes']:,} "
            f"in fp32 ({summary['quantized_ratio']:.3f}x)"
        )
    if summary.get("cache"):
        c = summary["cache"]
        steps = (
            f"steps {c['steps'][0]}-{c['steps'][1]} of {c['num_steps']}"
            if summary["experts"]
            else f"{c['num_steps']} steps"
        )
        print(
            f"cache schedule: {steps}, {c['block_evaluations_ratio']:.3f}x block evaluations; actions {' '.join(c['actions'])}"
        )
        if summary["quality_target"]:
            print(f"cache quality matched to: {matched_text(summary['quality_target'])}")
        if c.get("guard"):
            g, held = c["guard"], c["guard"].get("forced_on_held_out") or {}
            print(
                f"cache guard: {g['indicator']} above {g['quantile']:g}-quantile x {g['margin']:g} of calibration runs "
                f"the step full (held-out: {held.get('forced', '?')} of {held.get('checks', '?')} reuse checks forced)"
            )
    if summary.get("attention_quant"):
        a = summary["attention_quant"]
        blocks = " in MindIE SD's FP8 blocks" if a["layout"] == "mindie" else ""
        print(
            f"quantized attention: {a['qk']} QK, {a['pv']} PV{blocks} on {a['layers']} layers ({a['rotated_layers']} rotated), "
            f"{a['quantized_fraction']:.1%} of the attention layers' denoising steps ({a['file']})"
        )
    for attr, e in summary["experts"].items():
        c = e["cache"]
        cache = (
            f"; cache steps {c['steps'][0]}-{c['steps'][1]}, {c['block_evaluations_ratio']:.3f}x block evaluations, "
            f"actions {' '.join(c['actions'])}"
            if c
            else ""
        )
        print(f"expert {attr}: {e['layers_quantized']} layers quantized {e['schemes']}{cache}")
    for kind, ratio in summary["gptq"].items():
        print(
            f"{kind}: weights rounded by GPTQ (median calibration output error {ratio:.3f}x nearest rounding's)"
        )
    print(f"package size: {summary['package_bytes']:,} bytes")
    from sdkiln.runtime.memory.table import table_lines

    print("\n".join(table_lines(summary["memory"])))
    print("\n".join(_quality_lines(quality, "stored in the package when it was made")))
    print("on this machine (sdkiln run --device cpu):")
    print("\n".join("  " + line for line in kernel_lines("cpu")))
    return 0


def cmd_eval(args) -> int:
    import gc

    from sdkiln import kernels
    from sdkiln.model_zoo import DTYPES, get_spec, load_model
    from sdkiln.model_zoo.fingerprint import fingerprint
    from sdkiln.model_zoo.spec import no_guidance_arg
    from sdkiln.optimizer.evaluate import measure, reference, save_side_by_side
    from sdkiln.runtime import load
    from sdkiln.runtime.package import open_package

    # The base model runs first and is freed before the package loads: one model in memory.
    target = kernels.resolve_device(args.device)  # a device this machine lacks fails before any load
    manifest = open_package(args.package, digest=args.digest).manifest  # the weights are not read
    info = manifest["model"]
    if args.guidance is not None and manifest["call"]["guidance_arg"] is None:
        no_guidance_arg(info["pipeline_class"])  # before the base model loads
    base, _, _ = load_model(args.base or info["base_id"], DTYPES.get(info.get("dtype", "")), target)
    # the package's family and variant decide, not what the base is detected as (a package made
    # before variants records the zoo name, "flux-tiny", and no variant: the zoo build)
    spec = get_spec(info["family"], info.get("variant"))
    models = {
        info["transformer_attr"]: info,
        **{a: e["model"] for a, e in manifest.get("experts", {}).items()},
    }
    for attr, recorded in models.items():  # each transformer (Wan2.2-A14B: both experts)
        found = fingerprint(getattr(base, attr))
        for key in ("config_hash", "weights_hash"):
            if found[key] != recorded[key]:
                raise ModelError(
                    f"{Path(args.package) / 'manifest.json'}: base model {info['base_id']!r} does not match the "
                    f"package ({attr} {key.replace('_', ' ')} {found[key][:12]} != {recorded[key][:12]})"
                )
    call = dict(manifest["call"]["defaults"])  # the deployment the package was made for
    if args.steps is not None:
        call["num_inference_steps"] = args.steps
    if args.guidance is not None:
        call[spec.guidance_arg] = args.guidance
    base.to(target)
    with failures_outside_sdkiln("running the base model"):
        ref = reference(base, spec, args.num_samples, call, batch_size=args.eval_batch)
    del base
    gc.collect()
    optimized = load(args.package, device=args.device, digest=args.digest)
    with failures_outside_sdkiln("running the package"):
        report, opt_imgs = measure(optimized, spec, ref, args.eval_batch)
    if args.grid:
        save_side_by_side(ref.images, opt_imgs, args.grid)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(_quality_lines(report, "recomputed now from the package against the base model")))
        if args.grid:
            print(f"side-by-side grid (original left, optimized right): {args.grid}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sdkiln", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    o = sub.add_parser(
        "optimize",
        help="apply a recipe to a model and write a package",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    o.__class__ = _OptimizeParser  # its epilog lists the families, read only when help is shown
    o.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a zoo name (listed below: <family>-tiny, fmnist-flux), a local diffusers directory or "
        "modelscope://ORG/NAME; default: the embedded model",
    )
    o.add_argument(
        "--recipe",
        default="default",
        help="none, w8a8-dynamic, default; combine with '+'; or a .json/.yaml recipe file",
    )
    o.add_argument("--out", required=True, help="package directory to write (atomically)")
    o.add_argument("--force", action="store_true", help="replace an existing package at --out")
    o.add_argument(
        "--eval-samples",
        type=bounded(int, 0, 10_000),
        default=20,
        help="samples in the quality report (0 skips it)",
    )
    o.add_argument(
        "--steps",
        type=STEPS,
        default=None,
        help="denoising steps the package is made for: calibration, cache search, quality report and "
        "manifest all use it (default: the recipe's, else the model family's)",
    )
    o.add_argument(
        "--guidance",
        type=GUIDANCE,
        default=None,
        help="guidance scale the package is made for (like --steps); the variant's guidance argument "
        "(Wan2.2-A14B: the high-noise expert's, guidance_scale_2 keeps the published value; "
        "HunyuanVideo-1.5: refused, its guider component holds it)",
    )
    o.add_argument(
        "--height", type=SIZE, default=None, help="image height the package is made for (like --steps)"
    )
    o.add_argument(
        "--width", type=SIZE, default=None, help="image width the package is made for (like --steps)"
    )
    o.add_argument(
        "--frames",
        type=bounded(int, 1, 10_000),
        default=None,
        help="frames a video package is made for (like --steps)",
    )
    o.add_argument(
        "--max-sequence-length",
        type=bounded(int, 1, 4096),
        default=None,
        help="text tokens the prompt is encoded to (like --steps; FLUX.1-dev ships at 512)",
    )
    o.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="dtype every component of a model given by name or directory is loaded and optimized in "
        "(auto: the dtype its transformer is stored in; a zoo model: float32)",
    )
    o.add_argument(
        "--device",
        default="cpu",
        help="where the model is loaded, calibrated, searched and measured: cpu, cuda, cuda:1, npu or auto "
        "(the accelerator if there is one)",
    )
    o.add_argument(
        "--eval-batch",
        type=bounded(int, 1, 1024),
        default=None,
        help="quality-report samples generated at once (default: what the deployment's size allows)",
    )
    o.add_argument(
        "--lora",
        type=LORA,
        action="append",
        default=[],
        metavar="FILE[:STRENGTH]",
        help="fuse this LoRA (.safetensors, any format diffusers reads for the family) into the float "
        "weights before calibration, at STRENGTH (default 1); repeatable. Best quality, no strength "
        "control at run time; for that, `sdkiln run --lora`",
    )
    o.add_argument(
        "--match-quality",
        default=None,
        metavar="PACKAGE",
        help="make the cache as good as this package's (same family and deployment; a LoRA fused, a "
        "fine-tune, another quantization of it): the cache search's floor rises to its held-out PSNR less "
        "--match-slack and starts from its schedules (docs/caching.md)",
    )
    o.add_argument(
        "--match-slack",
        type=bounded(float, 0, 50),
        default=None,
        metavar="DB",
        help="with --match-quality: how far under that package's held-out PSNR the floor goes (default 1)",
    )
    o.add_argument(
        "--format",
        choices=["package", "ascend"],
        default="package",
        help="ascend: also write MindIE SD's files to OUT-ascend (docs/ascend.md)",
    )
    o.add_argument(
        "--ascend-dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="with --format ascend: the dtype MindIE SD runs in (default: the model's)",
    )
    o.set_defaults(func=cmd_optimize)

    r = sub.add_parser("run", help="load a package and generate an image")
    r.add_argument("package", help="package directory or modelscope://ORG/NAME")
    r.add_argument("--prompt", required=True, action="append", help="repeat for several images")
    r.add_argument("--negative-prompt", default=None)
    r.add_argument("--steps", type=STEPS, default=None)
    r.add_argument(
        "--guidance", type=GUIDANCE, default=None, help="default: the package's (as optimize --guidance)"
    )
    r.add_argument("--seed", type=SEED, default=0, help="seed of the first image; image i uses seed + i")
    r.add_argument(
        "--image",
        default=None,
        help="conditioning image for image-to-video and image-editing families (Wan I2V, FLUX.1-Kontext)",
    )
    r.add_argument(
        "--lora",
        type=LORA,
        action="append",
        default=[],
        metavar="FILE[:STRENGTH]",
        help="run this LoRA (.safetensors) beside the package's layers at STRENGTH (default 1); repeatable, "
        "the LoRAs mixed (pipe.load_lora_weights and set_adapters; docs/lora.md)",
    )
    r.add_argument(
        "--lora-cache",
        choices=("headroom", "keep", "off"),
        default="headroom",
        help="the package's cache schedule under a LoRA: headroom (default) runs its search front's cheapest "
        "schedule 3 dB safer, keep runs it as searched, off computes every step (docs/lora.md)",
    )
    r.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES",
        help="run within this much device memory (16G, 512M): the planner keeps what fits on the device, lets "
        "the text encoders and the VAE visit it, streams the transformer's blocks, or decodes in tiles; prints the "
        "plan; a budget "
        "no plan fits is refused with what the smallest needs (docs/memory.md)",
    )
    r.add_argument(
        "--memory-plan",
        default=None,
        metavar="PLAN",
        help="force a plan: resident, encoders, encoders+vae, blocks:N, or encoders+vae+tiled / blocks:N+tiled "
        "(the VAE decodes in tiles) (docs/memory.md)",
    )
    r.add_argument("--height", type=SIZE, default=None)
    r.add_argument("--width", type=SIZE, default=None)
    r.add_argument(
        "--out",
        default="sdkiln.png",
        help="image path (.png, .jpg, ...); with several prompts, <stem>-<i>.png",
    )
    r.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, npu, ...")
    r.add_argument("--digest", default=None, help="refuse the package unless its digest is this sha256:...")
    r.add_argument(
        "--compile",
        action="store_true",
        help="compile the repeated blocks with sdkiln's backend (fused ops, then Inductor); the first "
        "image pays the compile",
    )
    r.add_argument(
        "--cuda-graphs", action="store_true", help="also capture CUDA graphs (implies --compile; CUDA only)"
    )
    r.add_argument(
        "--verbose",
        action="store_true",
        help="print the device's kernel table (on a CPU: its instruction sets and the products chosen) "
        "and, after generating, the cold start by phase (sdkiln.runtime.loader.ColdStart) and which kernel "
        "ran each sdkiln op how often",
    )
    par = r.add_argument_group(
        "parallel (launch with torchrun --nproc-per-node N -m sdkiln run ...; the degrees multiply to N; docs/parallel.md)"
    )
    par.add_argument(
        "--cfg-parallel",
        action="store_true",
        help="the two guidance branches on two ranks (needs guidance > 1)",
    )
    par.add_argument("--ulysses", type=DEGREE, default=1, help="Ulysses degree: heads split by all-to-all")
    par.add_argument("--ring", type=DEGREE, default=1, help="ring degree: K/V blocks passed around a ring")
    par.add_argument(
        "--split-text",
        action="store_true",
        help="shard the text tokens of joint attention too (diffusers' plan; default: replicated, exact)",
    )
    par.add_argument(
        "--timeout",
        type=TIMEOUT,
        default=600.0,
        help="seconds a collective may wait for a peer (default 600)",
    )
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="verify a package and show its recipe, layers, sizes and quality")
    i.add_argument("package")
    i.add_argument("--json", action="store_true", help="the manifest plus its digest and a summary object")
    i.add_argument("--digest", default=None, help="refuse the package unless its digest is this sha256:...")
    i.set_defaults(func=cmd_inspect)

    e = sub.add_parser("eval", help="recompute a package's quality against its base model")
    e.add_argument("package")
    e.add_argument("--base", default=None, help="base model (zoo name or directory); default: the manifest's")
    e.add_argument("--num-samples", type=SAMPLES, default=20)
    e.add_argument("--steps", type=STEPS, default=None, help="default: the package's deployment")
    e.add_argument("--guidance", type=GUIDANCE, default=None, help="default: the package's deployment")
    e.add_argument("--digest", default=None, help="refuse the package unless its digest is this sha256:...")
    e.add_argument(
        "--device", default="cpu", help="where both models run, one after the other: cpu, cuda, auto, ..."
    )
    e.add_argument(
        "--eval-batch",
        type=bounded(int, 1, 1024),
        default=None,
        help="samples generated at once (default: what the deployment's size allows)",
    )
    e.add_argument("--grid", default=None, help="write a side-by-side PNG (original left, optimized right)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    add_export_parsers(sub)
    add_serve_parser(sub)
    return p


THIRD_PARTY_LOGGERS = (
    "torch",
    "torchao",
    "diffusers",
    "transformers",
    "modelscope",
    "onnxscript",
    "accelerate",
)


def _quiet_libraries() -> None:
    """sdkiln's commands show sdkiln's progress and results; ``--debug`` shows everything else.

    diffusers and transformers warn on every tiny-model call (truncated prompts, missing
    torchvision, shard-writing bars); torchao, imported by diffusers' and transformers' quantizers
    when installed, logs the optional CUDA libraries it cannot load and torch's pytree deprecations
    on import. Their loggers show errors only, and Python warnings raised outside sdkiln are not
    shown. torch is imported first: its import sets the "torch" logger's level itself.
    """
    import logging

    import torch  # noqa: F401

    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"(?!sdkiln\b)")

    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.debug:
        _quiet_libraries()
    try:
        return args.func(args)
    except (SdkilnError, OSError) as exc:
        if args.debug:
            raise
        _print_error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
