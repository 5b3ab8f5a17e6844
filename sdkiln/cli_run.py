"""``sdkiln run``: load a package and generate images (the command's work and what it prints; its
parser is in ``sdkiln.cli``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from sdkiln.errors import SdkilnError, failures_outside_sdkiln


def check_text(value: str, what: str) -> str:
    """Command-line text that is not valid UTF-8 reaches Python as lone surrogates; refuse it here
    rather than in a tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SdkilnError(f"{what} {os.fsencode(value)!r} is not valid UTF-8") from None
    return value


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def image_of(array):
    """A pipeline's [H, W, C] image in [0, 1] (or [F, H, W, C] frames, side by side) as the 8-bit PIL
    image ``sdkiln run`` saves; ``sdkiln serve`` encodes the same one, so the two agree bit for bit."""
    import numpy as np
    from PIL import Image

    img = np.asarray(array)
    if img.ndim == 4:  # video frames side by side
        img = np.concatenate(list(img), axis=1)
    img = (np.clip(img, 0, 1) * 255).round().astype(np.uint8)
    return Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img)


def _save_image(array, path: Path) -> Path:
    image_of(array).save(path)
    return path


def kernel_lines(device_type: str) -> list[str]:
    """What this machine runs the sdkiln ops with on ``device_type``: each op's kernels in the order
    they are tried and, on a CPU, the profile's decisions with the measured times behind them."""
    from sdkiln import kernels

    lines = []
    if device_type == "cpu":
        from sdkiln.kernels.cpu_profile import PROBE_SHAPE, cpu_profile

        profile = cpu_profile()
        shape = "x".join(map(str, PROBE_SHAPE))
        lines += [
            f"cpu: {profile.info.describe()}, {profile.threads} thread(s); products timed at {shape} unless named"
        ]
        lines += [f"  {what}: {choice}  ({why})" for what, choice, why in profile.table()]
    kernels.load_device_kernels(device_type)
    lines.append(f"{device_type} kernels, in the order tried (then the reference):")
    for op in kernels.op_names() + kernels.composite_names():
        names = [k.name for k in kernels.kernels(op, device_type)]
        if names:
            lines.append(f"  {op}: {', '.join(names)}")
    return lines


def cmd_run(args) -> int:
    from sdkiln import kernels
    from sdkiln.runtime import load

    prompts = [check_text(p, "--prompt") for p in args.prompt]
    if args.negative_prompt is not None:
        check_text(args.negative_prompt, "--negative-prompt")
    out_path = Path(check_text(args.out, "--out"))
    if out_path.suffix.lower() not in IMAGE_SUFFIXES:
        raise SdkilnError(
            f"--out {args.out!r}: the image type comes from the suffix: one of {', '.join(IMAGE_SUFFIXES)}"
        )
    device = kernels.resolve_device(args.device)
    compile_config = None
    if args.compile or args.cuda_graphs:
        from sdkiln.configs.runtime import CompileConfig

        compile_config = CompileConfig(regional=True, cuda_graphs=args.cuda_graphs)
    memory = None
    if args.memory_budget is not None or args.memory_plan is not None:
        from sdkiln.configs.runtime import MemoryConfig

        memory = MemoryConfig(device_budget=args.memory_budget, plan=args.memory_plan)
    parallel = None
    if args.cfg_parallel or args.ulysses > 1 or args.ring > 1 or "WORLD_SIZE" in os.environ:
        from sdkiln.configs.runtime import ParallelConfig

        parallel = ParallelConfig(
            cfg=2 if args.cfg_parallel else 1,
            ulysses=args.ulysses,
            ring=args.ring,
            split_text=args.split_text,
            timeout_s=args.timeout,
        )
    if args.verbose:
        print("\n".join(kernel_lines(device.type)))
    try:
        pipe = load(
            args.package,
            device=device,
            digest=args.digest,
            compile=compile_config,
            parallel=parallel,
            memory=memory,
        )
        if pipe.sdkiln_memory is not None:
            print(pipe.sdkiln_memory.plan.describe(pipe.sdkiln_memory.sizes))
        if args.lora:
            pipe.sdkiln_lora.set_cache_policy(args.lora_cache)
            names = [f"lora{i}" for i in range(len(args.lora))]
            for name, lora in zip(names, args.lora, strict=True):
                pipe.load_lora_weights(lora.path, adapter_name=name)
            pipe.set_adapters(names, [lora.strength for lora in args.lora])
            _print_lora_cache(pipe, args.lora_cache)
        for component, dtype in pipe.sdkiln_widened.items():
            print(f"{component}: {dtype} weights computed in float32 (this CPU has no fast {dtype} matmul)")
        if args.verbose:
            kernels.reset_kernel_counts()
        status = _generate(args, pipe, prompts, out_path, parallel)
        if args.verbose:
            phases = pipe.sdkiln_cold_start.phases
            print(
                f"cold start {sum(phases.values()):.1f} s to the first step's end: "
                + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                + (f" (compile cache {pipe.sdkiln_compile_cache})" if compile_config else "")
            )
            print("kernels that ran (op, device: kernel x calls):")
            for (op, device_type, name), n in sorted(kernels.kernel_counts().items()):
                print(f"  {op}, {device_type}: {name} x {n}")
        return status
    finally:
        if parallel is not None:
            from sdkiln.runtime.parallel import shutdown

            shutdown()


def _image_input(path: str | None, model: dict) -> dict:
    """``run --image``: the conditioning image under the family's pipeline argument; one line when the
    family takes none, or needs one and none was given."""
    from sdkiln.model_zoo import get_spec

    spec = get_spec(model["family"], model.get("variant"))
    if path is None:
        if spec.image_required:
            raise SdkilnError(f"{spec.family} generates from an image: give --image PATH")
        return {}
    if spec.image_arg is None:
        raise SdkilnError(f"--image: {spec.family} takes no conditioning image (text only)")
    from PIL import Image

    try:
        with Image.open(path) as image:
            return {spec.image_arg: image.convert("RGB")}
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise SdkilnError(f"--image {path}: not a readable image ({exc})") from None


def _generate(args, pipe, prompts: list[str], out_path: Path, parallel) -> int:
    """``sdkiln run``'s images from a loaded pipeline; under a parallel layout every rank denoises
    and rank 0 alone decodes, writes and prints."""
    import torch

    main = parallel is None or pipe.sdkiln_parallel.mesh.is_main
    call = pipe.sdkiln_manifest["call"]
    kwargs = dict(call["defaults"])
    kwargs["output_type"] = "np"
    if args.steps is not None:
        kwargs["num_inference_steps"] = args.steps
    if args.guidance is not None:
        if call["guidance_arg"] is None:
            raise SdkilnError(
                f"--guidance: {pipe.sdkiln_manifest['model']['pipeline_class'].rpartition(':')[2]} takes no "
                "guidance argument; its guidance is its guider component's guidance_scale, which the package keeps"
            )
        kwargs[call["guidance_arg"]] = args.guidance
    if args.negative_prompt is not None:
        kwargs["negative_prompt"] = args.negative_prompt
    for key in ("height", "width"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    from sdkiln.model_zoo.spec import with_area

    with_area(kwargs)
    kwargs.update(_image_input(args.image, pipe.sdkiln_manifest["model"]))
    guided = (
        kwargs.get(call["guidance_arg"], 0) > 1
        if call["guidance_arg"] is not None
        else getattr(getattr(pipe, "guider", None), "num_conditions", 1) > 1  # a guider's branches
    )
    if parallel is not None and parallel.cfg == 2 and not guided and call["guidance_arg"] is None:
        raise SdkilnError(
            "--cfg-parallel runs the two guidance branches on two ranks; this package's guider runs one "
            "(its guidance_scale is 1): drop --cfg-parallel"
        )
    if parallel is not None and parallel.cfg == 2 and not guided:
        raise SdkilnError(
            f"--cfg-parallel runs the two guidance branches on two ranks; this run's {call['guidance_arg']} is "
            f"{kwargs.get(call['guidance_arg'])!r}, which runs one: set --guidance above 1 or drop --cfg-parallel"
        )
    if not main:
        kwargs["output_type"] = "latent"  # rank 0 decodes and writes; the others only denoise
    else:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(prompts):
        path = out_path if len(prompts) == 1 else out_path.with_name(f"{out_path.stem}-{i}{out_path.suffix}")
        t0 = time.perf_counter()
        with failures_outside_sdkiln(f"generating {path.name}"):
            out = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(args.seed + i), **kwargs)
        elapsed = time.perf_counter() - t0
        if not main:
            continue
        _save_image((out.frames if hasattr(out, "frames") else out.images)[0], path)
        where = "" if parallel is None else f", {pipe.sdkiln_parallel.mesh.describe()}"
        print(
            f"{path}: {prompt!r}  ({kwargs.get('num_inference_steps')} steps, seed {args.seed + i}, "
            f"{elapsed:.2f} s{where})"
        )
    return 0


def _print_lora_cache(pipe, policy: str) -> None:
    """One line on what the package's cache schedule does under the LoRAs (``--lora-cache``)."""
    from sdkiln.runtime.cache import cache_runner

    runner = cache_runner(pipe.transformer)
    if runner is None:
        return
    ratio = runner.active.block_evaluations_ratio()
    if runner.active is runner.schedule:
        print(
            f"cache: the package's schedule as searched ({ratio:.2f} of the block evaluations; --lora-cache {policy})"
        )
    elif policy == "off":
        print("cache: off under the LoRA, every step computes (--lora-cache off)")
    else:
        up = runner.active.search["stepped_up"]
        print(
            f"cache: stepped up under the LoRA to {ratio:.2f} of the block evaluations from "
            f"{up['from']['block_evaluations_ratio']:.2f} (calibration PSNR {up['from']['psnr_mean']:.1f} -> "
            f"{up['to']['psnr_mean']:.1f} dB; --lora-cache keep runs it as searched)"
        )
