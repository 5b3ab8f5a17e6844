"""``sdkiln serve``: its parser and command (the server itself is ``sdkiln.serve``)."""

from __future__ import annotations

import argparse
import re

from sdkiln.errors import SdkilnError


def _adapter(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=PATH, NAME of letters, digits, _ . - (at most 64)")
    return name, path


def _size(text: str) -> tuple[int, int]:
    from sdkiln.serve.requests import SIZE_PATTERN

    match = SIZE_PATTERN.match(text)
    if match is None or max(int(match.group(1)), int(match.group(2))) > 8192:
        raise argparse.ArgumentTypeError(f"{text!r}: WIDTHxHEIGHT, each at most 8192")
    return int(match.group(1)), int(match.group(2))


def add_serve_parser(sub) -> None:
    from sdkiln.cli import bounded  # cli imports this module: a function-level import, as cli_export's

    s = sub.add_parser(
        "serve",
        help="serve a package behind OpenAI's images API (POST /v1/images/generations; docs/serving.md)",
    )
    s.add_argument("package", help="package directory or modelscope://ORG/NAME")
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    s.add_argument("--port", type=bounded(int, 0, 65535), default=8000)
    s.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, npu, ...")
    s.add_argument("--digest", default=None, help="refuse the package unless its digest is this sha256:...")
    s.add_argument("--compile", action="store_true", help="compile the repeated blocks (the warm-up pays it)")
    s.add_argument(
        "--max-batch", type=bounded(int, 1, 256), default=4,
        help="most images in one pipeline call; requests of one size, steps, guidance and LoRA set share a call "
        "(default 4; also the most images one request may ask for, n)",
    )  # fmt: skip
    s.add_argument(
        "--max-queue", type=bounded(int, 1, 100_000), default=64,
        help="most requests waiting; more get 429 with Retry-After (default 64)",
    )  # fmt: skip
    s.add_argument(
        "--batch-window-ms", type=bounded(float, 0.0, 10_000.0), default=10.0,
        help="how long the worker waits for requests to batch with the oldest (default 10 ms)",
    )  # fmt: skip
    s.add_argument(
        "--request-timeout", type=bounded(float, 0.1, 86_400.0), default=300.0,
        help="seconds a request may take, queue included; past it: 504, its work dropped (default 300)",
    )  # fmt: skip
    s.add_argument(
        "--grace", type=bounded(float, 0.0, 86_400.0), default=30.0,
        help="on SIGTERM, seconds to finish the accepted requests before exiting (default 30)",
    )  # fmt: skip
    s.add_argument(
        "--lora", type=_adapter, action="append", default=[], metavar="NAME=PATH",
        help="load this LoRA (.safetensors) as adapter NAME; a request turns it on with \"lora\": {\"NAME\": 0.8}",
    )  # fmt: skip
    s.add_argument(
        "--size", type=_size, action="append", default=[], metavar="WxH",
        help="serve this size too (the package's default size is always served)",
    )  # fmt: skip
    s.add_argument(
        "--max-steps", type=bounded(int, 1, 1000), default=None,
        help="most num_inference_steps a request may ask for (default: the package's with a cache schedule, which "
        "runs no more, else twice that)",
    )  # fmt: skip
    par = s.add_argument_group(
        "parallel (launch with torchrun --nproc-per-node N -m sdkiln serve ...; rank 0 serves HTTP, the other ranks "
        "run each batch with it; docs/parallel.md)"
    )
    par.add_argument("--cfg-parallel", action="store_true", help="the two guidance branches on two ranks")
    par.add_argument(
        "--ulysses", type=bounded(int, 1, 1024), default=1, help="Ulysses sequence-parallel degree"
    )
    par.add_argument("--ring", type=bounded(int, 1, 1024), default=1, help="ring-attention degree")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from sdkiln.serve.server import ServeConfig, serve

    names = [n for n, _ in args.lora]
    if len(set(names)) != len(names):
        raise SdkilnError(f"--lora: adapter names must differ, got {', '.join(names)}")
    return serve(
        ServeConfig(
            package=args.package, host=args.host, port=args.port, device=args.device, compile=args.compile,
            max_batch=args.max_batch, max_queue=args.max_queue, batch_window_ms=args.batch_window_ms,
            request_timeout_s=args.request_timeout, grace_s=args.grace, loras=list(args.lora), sizes=list(args.size),
            max_steps=args.max_steps, digest=args.digest, cfg_parallel=args.cfg_parallel, ulysses=args.ulysses,
            ring=args.ring,
        )
    )  # fmt: skip
