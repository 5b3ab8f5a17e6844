"""Hostile and damaged packages and bad command lines: each gets one clean ``SdkilnError`` (one line
and exit 2 from the CLI), fast, and nothing loads that differs from what was verified.

The package edits are the ones an outside fuzz run found crashing, hanging, exhausting memory or
silently changing the output; each is applied to a copy of the schema-1 flux-tiny fixture and the
manifest re-signed (as a forger would), so the check behind the hashes is what is tested.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

import sdkiln
from sdkiln.cli import main
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.runtime.cache.guard import INDICATOR
from sdkiln.runtime.package import open_package

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
from fuzz_mutate import resign, rewrite_header  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"
FAST_S = 5.0  # a refusal is a check, not a build: generous for a loaded 2-core CI machine


@pytest.fixture
def pkg(tmp_path):
    return Path(shutil.copytree(FIXTURE, tmp_path / "pkg"))


def edit_json(root: Path, rel: str, change) -> None:
    data = json.loads((root / rel).read_text())
    change(data)
    (root / rel).write_text(json.dumps(data))
    if rel != "manifest.json":
        resign(root)


def first_layer(m, scheme):
    return next(v for v in m["modules"].values() if v["scheme"] == scheme)


HOSTILE_EDITS = {
    "transformer num_layers 1e6": (
        "transformer/config.json",
        lambda c: c.update(num_layers=10**6),
        "elements",
    ),
    "vae layers_per_block 1e30": (
        "vae/config.json",
        lambda c: c.update(layers_per_block=10**30),
        "out of range",
    ),
    "vae layers_per_block float": (
        "vae/config.json",
        lambda c: c.update(layers_per_block=1e30),
        "building AutoencoderKL from its config failed",
    ),
    "text encoder 20000 tiny layers": (
        "text_encoder/config.json",
        lambda c: c.update(
            num_hidden_layers=20_000, hidden_size=4, intermediate_size=1, num_attention_heads=1
        ),
        "tensors",
    ),
    "vae shift_factor a string": (
        "vae/config.json",
        lambda c: c.update(shift_factor="x"),
        "shift_factor must be",
    ),
    "transformer posing as the VAE": (
        "model_index.json",
        lambda c: c.update(vae=["diffusers", "PixArtTransformer2DModel"]),
        "the pipeline takes a AutoencoderKL",
    ),
    "guidance_arg is the prompt": (
        "manifest.json",
        lambda m: m["call"].update(guidance_arg="prompt"),
        "guidance_arg",
    ),
    "guidance_arg the pipeline lacks": (
        "manifest.json",
        lambda m: m["call"].update(
            guidance_arg="cfg_weight",
            defaults={
                "cfg_weight" if k == "true_cfg_scale" else k: v for k, v in m["call"]["defaults"].items()
            },
        ),
        "takes no argument 'cfg_weight'",
    ),
    "call pixels": (
        "manifest.json",
        lambda m: m["call"]["defaults"].update(
            height=4096, width=4096, num_images_per_prompt=16, num_frames=2
        ),
        "at most",
    ),
    "cache sigmas infinite": (
        "schedules/cache_schedule.json",
        lambda s: s.update(sigmas=[1e999] * 4),
        "finite",
    ),
    "cache guard quantile a string": (
        "schedules/cache_schedule.json",
        lambda s: s.update(guards={"indicator": INDICATOR, "thresholds": {}, "quantile": "x", "margin": 1.0}),
        "quantile",
    ),
    "vae block_out_channels 100000": (
        "vae/config.json",
        lambda c: c.update(block_out_channels=[100_000] * len(c["block_out_channels"])),
        "elements",
    ),
    "scheduler num_train_timesteps 1e9": (
        "scheduler/scheduler_config.json",
        lambda c: c.update(num_train_timesteps=10**9),
        "num_train_timesteps",
    ),
    "scheduler shift is a dict": (
        "scheduler/scheduler_config.json",
        lambda c: c.update(max_shift={"a": 1}),
        "max_shift",
    ),
    "call num_images_per_prompt 1e6": (
        "manifest.json",
        lambda m: m["call"]["defaults"].update(num_images_per_prompt=10**6),
        "num_images_per_prompt",
    ),
    "call unknown argument": (
        "manifest.json",
        lambda m: m["call"]["defaults"].update(latents=[1]),
        "latents",
    ),
    "cache schedule 1e9 blocks": (
        "schedules/cache_schedule.json",
        lambda s: s["blocks"][0].update(count=10**9),
        "block count",
    ),
    "model.dtype manual_seed": ("manifest.json", lambda m: m["model"].update(dtype="manual_seed"), "dtype"),
    "model.dtype nn": ("manifest.json", lambda m: m["model"].update(dtype="nn"), "dtype"),
    "model.variant a list": ("manifest.json", lambda m: m["model"].update(variant=["tiny"]), "model.variant"),
    "pipeline class builds a VAE": (
        "manifest.json",
        lambda m: m["model"].update(pipeline_class="diffusers:AutoencoderKL"),
        "DiffusionPipeline",
    ),
    "schema_version true": ("manifest.json", lambda m: m.update(schema_version=True), "schema_version"),
    "schema_version 1.0": ("manifest.json", lambda m: m.update(schema_version=1.0), "schema_version"),
    "modules is a string": ("manifest.json", lambda m: m.update(modules="all"), "modules"),
    "scheme is a list": (
        "manifest.json",
        lambda m: first_layer(m, "W8A8").update(scheme=["W8A8"]),
        "scheme",
    ),
    "dynamic_steps true": (
        "manifest.json",
        lambda m: first_layer(m, "W8A8_TIMESTEP").update(dynamic_steps=True),
        "dynamic_steps",
    ),
    "recipe steps a dict": ("manifest.json", lambda m: m["recipe"].update(steps={}), "recipe.steps"),
    "tokenizer pads to a billion tokens": (
        "tokenizer/tokenizer_config.json",
        lambda t: t.update(model_max_length=10**9),
        "model_max_length",
    ),
    "tokenizer length a string": (
        "tokenizer/tokenizer_config.json",
        lambda t: t.update(model_max_length="x"),
        "model_max_length must be an integer",
    ),
    "text encoder vocabulary grows": (
        "tokenizer/tokenizer_config.json",
        lambda t: t.update(pad_token="<a-new-token>"),
        "tokens",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_EDITS))
def test_hostile_package_edit_is_one_clean_error_fast(pkg, name):
    rel, change, words = HOSTILE_EDITS[name]
    edit_json(pkg, rel, change)
    t0 = time.perf_counter()
    with pytest.raises(PackageError, match=words):
        sdkiln.load(pkg, device="cpu")
    assert time.perf_counter() - t0 < FAST_S


def safetensors_header(root: Path, rel: str, change) -> None:
    rewrite_header(root / rel, change)
    resign(root)


def test_a_renamed_text_encoder_tensor_is_missing_not_randomly_initialised(pkg):
    rel = "text_encoder/model.safetensors"
    safetensors_header(
        pkg, rel, lambda h: h.__setitem__("renamed.weight", h.pop(next(k for k in h if "weight" in k)))
    )
    with pytest.raises(PackageError, match="not part of the model"):
        sdkiln.load(pkg, device="cpu")


def test_a_quantized_weight_of_the_wrong_dtype_is_refused_at_load(pkg):
    m = json.loads((pkg / "manifest.json").read_text())
    layer = next(n for n, v in m["modules"].items() if v["scheme"] == "W8A8_DYNAMIC")
    safetensors_header(
        pkg,
        "transformer/diffusion_pytorch_model.safetensors",
        lambda h: h[f"{layer}.weight"].update(dtype="U8"),
    )
    with pytest.raises(PackageError, match=f"{layer}.weight.*torch.int8"):
        sdkiln.load(pkg, device="cpu")


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b'{"a": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"a": NaN}', "NaN"),
        (b'{"a": 1, "a": 2}', "twice"),
        (b"\xff\xfe{}", "JSON"),
    ],
)
def test_json_limits(pkg, raw, words):
    (pkg / "vae" / "config.json").write_bytes(raw)
    resign(pkg)
    with pytest.raises(PackageError, match=words):
        sdkiln.load(pkg, device="cpu")


def test_digest_pins_the_manifest(pkg, capsys):
    digest = open_package(pkg).digest
    assert main(["inspect", str(pkg)]) == 0
    assert f"digest: {digest}" in capsys.readouterr().out
    assert sdkiln.load(pkg, device="cpu", digest=digest).sdkiln_digest == digest
    # every layer's scheme renamed in the manifest: loads (other files untouched) but not under the digest
    edit_json(pkg, "manifest.json", lambda m: first_layer(m, "W8A8_DYNAMIC").update(scheme="FP8_DYNAMIC"))
    with pytest.raises(PackageError, match="digest"):
        sdkiln.load(pkg, device="cpu", digest=digest)
    args = ["run", str(pkg), "--prompt", "x", "--out", str(pkg.parent / "x.png"), "--digest", digest]
    assert main(args) == 2
    assert "digest" in capsys.readouterr().err
    with pytest.raises(PackageError, match="64 lowercase hex"):
        sdkiln.load(pkg, digest="sha256:abc")


def test_what_is_parsed_is_what_was_hashed(pkg):
    """A file rewritten after verification does not reach the parsers (the race a writer could win)."""
    loaded = open_package(pkg)
    (pkg / "vae" / "config.json").write_text('{"_class_name": "swapped"}')
    assert loaded.read_json("vae/config.json")["_class_name"] == "AutoencoderKL"


def test_a_bug_in_sdkiln_keeps_its_traceback(pkg, monkeypatch, capsys):
    from sdkiln.runtime.cache import hooks

    # compiled as if it were a line of hooks.py: a bug in sdkiln's own code during generation
    namespace: dict = {}
    exec(
        compile(
            "def planted(self, num_steps):\n    raise ZeroDivisionError('planted bug')",
            hooks.__file__,
            "exec",
        ),
        namespace,
    )
    monkeypatch.setattr(hooks.CacheRunner, "_schedule_for_run", namespace["planted"])
    args = ["run", str(pkg), "--prompt", "x", "--out", str(pkg.parent / "x.png")]
    with pytest.raises(ZeroDivisionError, match="planted bug"):
        main(args)
    with pytest.raises(ZeroDivisionError, match="planted bug"):
        main(["--debug", *args])


def test_a_pipeline_failure_inside_another_library_is_one_run_error(pkg, capsys):
    """transformers' "no limit" tokenizer length passes loading; CLIP's pipeline then pads to it."""
    edit_json(pkg, "tokenizer/tokenizer_config.json", lambda t: t.update(model_max_length=10**30))
    assert main(["run", str(pkg), "--prompt", "x", "--out", str(pkg.parent / "x.png")]) == 2
    assert "the package's configs do not work together" in capsys.readouterr().err


def test_debug_shows_the_traceback_of_a_clean_error(pkg):
    edit_json(pkg, "manifest.json", lambda m: m.update(schema_version=2))
    with pytest.raises(PackageError, match="schema_version"):
        main(["--debug", "inspect", str(pkg)])


def test_an_sdkiln_package_is_not_a_base_model(pkg, tmp_path):
    with pytest.raises(SdkilnError, match="is an sdkiln package, not a base model"):
        sdkiln.optimize(str(pkg), "none", tmp_path / "out", eval_samples=0)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh", strict=False)
)


OPT = ["optimize", "flux-tiny", "--out", "TMP/o"]
RUN = ["run", "PKG", "--prompt", "a cat", "--out", "TMP/x.png"]
# Every kind of bad command line the outside run found printing a traceback; PKG and TMP stand for
# the package and a directory holding the files named here.
BAD_COMMAND_LINES = {
    "optimize --steps 0": [*OPT, "--steps", "0"],
    "optimize --steps -1": [*OPT, "--steps", "-1"],
    "optimize --guidance nan": [*OPT, "--guidance", "nan"],
    "optimize --eval-samples -1": [*OPT, "--eval-samples", "-1"],
    "recipe file not UTF-8": [*OPT, "--recipe", "TMP/latin1.yaml"],
    "recipe file a YAML alias bomb": [*OPT, "--recipe", "TMP/bomb.yaml"],
    "recipe name not UTF-8": [*OPT, "--recipe", "caf\udce9"],
    "a package as the base model": ["optimize", "PKG", "--out", "TMP/o"],
    "existing --out without --force": ["optimize", "flux-tiny", "--out", "TMP/existing"],
    "--force onto user files": ["optimize", "flux-tiny", "--out", "TMP/existing", "--force"],
    "prompt not UTF-8": [*RUN[:3], "caf\udce9", *RUN[4:]],
    "run --steps -1": [*RUN, "--steps", "-1"],
    "run --steps 0": [*RUN, "--steps", "0"],
    "run --steps 1e9": [*RUN, "--steps", "1e9"],
    "run --height -64": [*RUN, "--height", "-64"],
    "run --height 1000000": [*RUN, "--height", "1000000"],
    "run --device bogus": [*RUN, "--device", "bogus"],
    "run --device cuda without CUDA": [*RUN, "--device", "cuda"],
    "run --seed 2**70": [*RUN, "--seed", str(2**70)],
    "run --out of an unknown image type": [*RUN[:-1], "TMP/x.unknown"],
    "run a missing package": ["run", "TMP/missing", "--prompt", "x"],
    "eval --num-samples 0": ["eval", "PKG", "--num-samples", "0"],
    "inspect --digest malformed": ["inspect", "PKG", "--digest", "md5:1"],
    "export-ascend onto user files": ["export-ascend", "PKG", "--out", "TMP/existing"],
    "unknown command": ["frobnicate"],
}


@pytest.mark.parametrize("name", list(BAD_COMMAND_LINES))
def test_every_bad_command_line_prints_one_line_and_exits_2(pkg, tmp_path, capsys, name):
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    (tmp_path / "bomb.yaml").write_text(BOMB)
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine")
    argv = [a.replace("PKG", str(pkg)).replace("TMP", str(tmp_path)) for a in BAD_COMMAND_LINES[name]]
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(argv))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("sdkiln: error: "), err
    assert len(err) < 1100
    assert (tmp_path / "existing" / "notes.txt").read_text() == "mine"


def test_a_fifo_in_the_package_does_not_block_the_loader(pkg):
    os.mkfifo(pkg / "eval" / "pipe.json")
    edit_json(
        pkg, "manifest.json", lambda m: m["files"].update({"eval/pipe.json": {"sha256": "0" * 64, "size": 0}})
    )
    with pytest.raises(PackageError, match="not a regular file"):
        open_package(pkg)
