"""The ``sdkiln`` commands that write a package into other formats or publish it: ``export-ascend``,
``export-onnx``, ``export-diffusers`` and ``publish`` (their parsers and what they print)."""

from __future__ import annotations


def print_ascend(export) -> None:
    layers = ", ".join(f"{n} {s}" for s, n in sorted(export.schemes.items()))
    print(f"ascend ({export.model_quant_type}; {layers}): {export.description}")
    print(f"  {export.weights}")
    if export.regridded:
        print(
            f"  {export.regridded} W8A8 layers' scales rounded for this dtype (a package from an older sdkiln): "
            "MindIE SD computes them slightly differently from the package's measurements"
        )
    if export.attention is not None:
        a = export.attention
        print(
            f"  attention ({a['formats']}): {a['layers']} of the plan's {a['plan_layers']} layers as MindIE SD's "
            f"FP8_DYNAMIC FA quantization with their q_rot/k_rot"
            + (
                f"; {a['left_float_pairs']} quantized (layer, step) pairs run float there: {a['reason']}"
                if a.get("reason")
                else ""
            )
        )
    policy = export.timestep_policy
    if policy:
        k, t = policy["dynamic_steps"], policy["num_steps"]
        if k < t:
            print(
                f"  W8A8_TIMESTEP: run exactly {t} steps, calling TimestepManager.set_timestep_idx(i) before "
                "step i, with this MindIE SD TimestepPolicyConfig (docs/ascend.md):"
            )
            print(f'  policy.register(list(range({k}, {t})), "static", target="w8a8_static_linear")')
        else:
            print(f"  W8A8_TIMESTEP: all {t} steps run dynamic, MindIE SD's default: no timestep policy")


def cmd_export_ascend(args) -> int:
    from sdkiln.export.ascend import export_ascend

    print_ascend(export_ascend(args.package, args.out, dtype=args.dtype, force=args.force))
    return 0


def cmd_export_onnx(args) -> int:
    from sdkiln.export.onnx import export_onnx

    result = export_onnx(
        args.package,
        args.out,
        opset=args.opset,
        height=args.height,
        width=args.width,
        check=not args.no_check,
        force=args.force,
    )
    schemes = ", ".join(f"{n} {s}" for s, n in result.schemes.items()) or "float"
    print(
        f"onnx: {result.out}/transformer.onnx (opset {result.opset}; {schemes}; "
        f"{result.quantization_nodes} QuantizeLinear/DequantizeLinear nodes; {result.seconds} s)"
    )
    dynamic = {k: [i for i, d in enumerate(v) if isinstance(d, str)] for k, v in result.inputs.items()}
    print("  dynamic axes: " + ", ".join(f"{k}{v}" for k, v in dynamic.items()))
    if result.max_rel_error is not None:
        print(
            f"  onnxruntime {result.onnxruntime} (CPU) vs sdkiln runtime: max relative error "
            f"{result.max_rel_error:.2e} (batch 1: {result.max_rel_error_batch1:.2e})"
        )
    for note in result.notes:
        print(f"  {note}")
    return 0


def cmd_export_diffusers(args) -> int:
    from sdkiln.export.diffusers_view import export_diffusers

    result = export_diffusers(args.package, args.out, check=not args.no_check, force=args.force)
    schemes = ", ".join(f"{n} {s}" for s, n in result.schemes.items()) or "float"
    print(f"diffusers view: {result.out} ({schemes} as torchao {result.torchao}; {result.seconds} s)")
    if result.max_rel_error is not None:
        print(
            f"  plain diffusers vs sdkiln runtime, transformer: max relative error {result.max_rel_error:.2e}"
        )
    if result.dropped:
        print(f"  left out (sdkiln only): {', '.join(result.dropped)}")
    print(f"  load: DiffusionPipeline.from_pretrained({result.out!r}, torch_dtype=<the package's dtype>)")
    return 0


def cmd_publish(args) -> int:
    from sdkiln.export.publish import publish

    result = publish(args.package, args.repo, hub=args.hub, private=args.private, license=args.license)
    print(
        f"published {args.package} to {result.hub} as {result.repo} ({'private' if result.private else 'public'}, "
        f"{len(result.files)} files with the model card): {result.url}"
    )
    return 0


def add_export_parsers(sub) -> None:
    """Add the export and publish subcommands to ``sdkiln``'s subparsers."""
    from sdkiln.cli import SIZE, bounded

    a = sub.add_parser("export-ascend", help="write a package's MindIE SD / msModelSlim files")
    a.add_argument("package")
    a.add_argument("--out", required=True, help="directory for the description and weights (atomically)")
    a.add_argument(
        "--dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="the dtype MindIE SD runs in; decides deq_scale's form (default: the model's)",
    )
    a.add_argument("--force", action="store_true", help="replace an existing --out")
    a.set_defaults(func=cmd_export_ascend)

    x = sub.add_parser(
        "export-onnx", help="write a package's transformer as ONNX (QDQ) and check it with onnxruntime"
    )
    x.add_argument("package")
    x.add_argument("--out", required=True, help="directory for transformer.onnx and export.json (atomically)")
    x.add_argument(
        "--opset",
        type=bounded(int, 18, 23),
        default=None,
        help="ONNX opset (default: 21 for a quantized package, 18 for a float one; 23 emits native Attention)",
    )
    x.add_argument("--height", type=SIZE, default=None, help="example input height (default: the package's)")
    x.add_argument("--width", type=SIZE, default=None, help="example input width (default: the package's)")
    x.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    x.add_argument("--force", action="store_true", help="replace an existing ONNX export at --out")
    x.set_defaults(func=cmd_export_onnx)

    d = sub.add_parser(
        "export-diffusers",
        help="write a directory plain diffusers loads (W8A8_DYNAMIC, W8A16 as torchao int8)",
    )
    d.add_argument("package")
    d.add_argument("--out", required=True, help="directory to write (atomically)")
    d.add_argument(
        "--no-check", action="store_true", help="skip loading it back and comparing with the runtime"
    )
    d.add_argument("--force", action="store_true", help="replace an existing diffusers view at --out")
    d.set_defaults(func=cmd_export_diffusers)

    u = sub.add_parser(
        "publish",
        help="upload a package with its model card to ModelScope or Modelers (token from the environment)",
    )
    u.add_argument("package")
    u.add_argument("--repo", required=True, help="ORG/NAME of the model repository (created if missing)")
    u.add_argument("--hub", choices=["modelscope", "modelers"], default="modelscope")
    u.add_argument("--private", action="store_true", help="create the repository private")
    u.add_argument(
        "--license",
        default=None,
        help="the base model's licence id for the card (default: apache-2.0 for sdkiln's own zoo models; "
        "required for others)",
    )
    u.set_defaults(func=cmd_publish)
