"""Memory budgets (``sdkiln.runtime.memory``): the planner's arithmetic, and every residency plan
giving the resident run's output bit for bit on CPU.

On the CPU a device copy is the host copy itself, so the comparison is exact (``torch.equal``); the
hooks still run and empty the tensors between uses, which the tests check, so a block or encoder
that ran without its onload would fail rather than pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sdkiln
from sdkiln.configs import (
    CacheAutoConfig,
    Deployment,
    MemoryConfig,
    RecipeConfig,
    TextEncoderQuantConfig,
    W8A8DynamicConfig,
)
from sdkiln.configs.runtime import parse_bytes
from sdkiln.errors import SdkilnError
from sdkiln.runtime.memory import Sizes, plan
from sdkiln.runtime.memory.plan import candidates, peak
from sdkiln.runtime.quant import QuantLinear

GIB = 2**30
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"
PLANS = ("resident", "encoders", "encoders+vae", "blocks:1", "blocks:2", "blocks:4")

# ---- the planner ----

SIZES = Sizes(
    components={"text_encoder": 1 * GIB, "text_encoder_2": 9 * GIB, "transformer": 12 * GIB, "vae": GIB // 4},
    encoders=("text_encoder", "text_encoder_2"),
    vae=("vae",),
    blocks={"transformer": [GIB // 4] * 40},  # 10 GiB in blocks, 2 GiB outside them
    activations=2 * GIB,
    encode_activations=GIB // 2,
    decode_activations=GIB,
)


@pytest.mark.parametrize(
    "budget, name, expected",
    [
        (80, "resident", 22.25 + 2),  # everything, plus the largest moment: a transformer call's activations
        (22, "encoders", 12.25 + 9 + 0.5),  # the transformer and the VAE stay; the T5 visiting is the peak
        (21.6, "encoders+vae", 12 + 9 + 0.5),
        (20, "blocks:4", 2 + 9 + 0.5),  # 2 GiB outside the blocks; the T5's visit still the peak moment
    ],
)
def test_the_first_plan_that_fits_is_chosen(budget, name, expected):
    p = plan(SIZES, int(budget * GIB), headroom=0.0)
    assert p.name == name and p.peak == int(expected * GIB)


def test_a_tiled_decode_follows_the_plan_it_extends():
    """A 12 GiB decode (untiled) outgrows the budget; in tiles it needs 1 GiB."""
    import dataclasses

    sizes = dataclasses.replace(SIZES, decode_activations=12 * GIB, decode_tiled_activations=GIB)
    names = [c[0] for c in candidates(sizes)]
    assert names.index("encoders+vae+tiled") == names.index("encoders+vae") + 1
    assert names[-3:] == ["blocks:4+tiled", "blocks:2+tiled", "blocks:1+tiled"]
    p = plan(sizes, 22 * GIB, headroom=0.0)
    assert (p.name, p.vae_tiled, p.peak) == ("encoders+vae+tiled", True, int((12 + 9 + 0.5) * GIB))
    forced = plan(sizes, None, "blocks:3+tiled")
    assert (forced.blocks_per_group, forced.vae_tiled, forced.peak) == (3, True, int((2 + 9 + 0.5) * GIB))
    assert "decodes in tiles" in forced.describe(sizes)
    assert [c[0] for c in candidates(SIZES)][-1] == "blocks:1"  # no tiled plan where tiling is not known
    MemoryConfig(plan="blocks:2+tiled")
    with pytest.raises(SdkilnError, match="MemoryConfig.plan is"):
        MemoryConfig(plan="resident+tiled")


def test_a_tenth_of_the_budget_is_kept_free():
    assert plan(SIZES, 24 * GIB).name == "encoders+vae"  # 21.5 GiB of 21.6 usable; encoders needs 21.75
    assert plan(SIZES, int(23.5 * GIB)).name == "blocks:4"


def test_a_budget_below_every_plan_is_refused_with_what_the_smallest_needs():
    with pytest.raises(
        SdkilnError, match=r"no memory plan fits a 11\.00 GiB .* blocks:4, needs about 11\.50 GiB"
    ):
        plan(SIZES, 11 * GIB)


def test_prefetch_keeps_two_groups_and_a_forced_plan_is_checked_against_the_budget():
    alone = Sizes(
        components={"transformer": 12 * GIB}, blocks={"transformer": [GIB // 4] * 40}, activations=2 * GIB
    )
    assert peak(alone, (), 4, prefetch=True) == (2 + 2 + 2) * GIB  # two groups of 4 blocks on the device
    assert peak(alone, (), 4, prefetch=False) == (2 + 1 + 2) * GIB
    assert peak(alone, (), 1, prefetch=True) == int((2 + 0.5 + 2) * GIB)
    assert plan(SIZES, None, "blocks:3").blocks_per_group == 3
    with pytest.raises(
        SdkilnError,
        match="memory plan resident needs about 24.25 GiB of device memory, more than the 16.00 GiB",
    ):
        plan(SIZES, 16 * GIB, "resident")
    with pytest.raises(SdkilnError, match="does not apply"):
        plan(Sizes(components={"transformer": GIB}), None, "encoders")


@pytest.mark.parametrize(
    "text, value", [("16G", 16 * GIB), ("512M", 512 * 2**20), ("1.5GiB", int(1.5 * GIB)), (42, 42)]
)
def test_budget_sizes_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["16Q", "-1G", "", "G"])
def test_bad_budgets_are_one_error(text):
    with pytest.raises(SdkilnError, match="memory size"):
        MemoryConfig(device_budget=text)


def test_bad_configs_are_refused():
    with pytest.raises(SdkilnError, match="needs a device_budget"):
        MemoryConfig()
    with pytest.raises(SdkilnError, match="MemoryConfig.plan is resident"):
        MemoryConfig(plan="blocks:0")


# ---- plans on real packages ----


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    """flux-tiny with every scheme and a cache schedule (the schema-1 fixture), wan-tiny W8A8 with a
    cache schedule and its UMT5 in W8A8 dynamic, the embedded model W8A8 with its MiniLM in W8A16 (the
    floor off: a quantized encoder visits the device)."""
    root = tmp_path_factory.mktemp("memory")
    cache = CacheAutoConfig(
        psnr_floor_db=0.0, psnr_p5_floor_db=0.0, calib_samples=1, eval_samples=1, budgets=2, refine=0
    )
    te = TextEncoderQuantConfig(scheme="w8a8_dynamic", sqnr_floor_db=0.0)
    recipe = RecipeConfig("wan", [te, W8A8DynamicConfig(), cache], Deployment(num_inference_steps=4))
    sdkiln.optimize("wan-tiny", recipe, root / "wan", eval_samples=0)
    te = TextEncoderQuantConfig(sqnr_floor_db=0.0)
    sdkiln.optimize(
        "fmnist-flux", RecipeConfig("fm", [te, W8A8DynamicConfig()]), root / "fmnist", eval_samples=0
    )
    return {"flux-tiny": FIXTURE, "wan-tiny": root / "wan", "fmnist-flux": root / "fmnist"}


def _run(pipe, family: str) -> torch.Tensor:
    from sdkiln.model_zoo import get_spec

    call = get_spec(family).call_kwargs(num_inference_steps=4)
    call["output_type"] = "np"  # decoded: the VAE runs too
    with torch.inference_mode():
        out = pipe(prompt="a photo of a coat", generator=torch.Generator().manual_seed(0), **call)[0]
    return torch.as_tensor(out)


@pytest.mark.parametrize("family", ["flux-tiny", "wan-tiny", "fmnist-flux"])
def test_every_plan_gives_the_resident_output_bit_for_bit(packages, family):
    reference = _run(sdkiln.load(packages[family], device="cpu"), family)
    ran = []
    for name in PLANS:
        try:
            pipe = sdkiln.load(packages[family], device="cpu", memory=MemoryConfig(plan=name))
        except SdkilnError as exc:  # the embedded model has no VAE
            assert name == "encoders+vae" and family == "fmnist-flux", exc
            continue
        res = pipe.sdkiln_memory
        assert res.plan.name == name
        if family != "flux-tiny":  # a quantized text encoder visits, or stays
            assert any(isinstance(m, QuantLinear) for m in pipe.text_encoder.modules())
        assert torch.equal(_run(pipe, family), reference), name
        onloads = res.onloads
        assert all(onloads[v] >= 1 for v in res.plan.visiting), onloads
        if res.plan.blocks_per_group:
            blocks = sum(len(b) for b in res.sizes.blocks.values())
            groups = sum(-(-n // res.plan.blocks_per_group) for n in _list_lengths(pipe))
            assert onloads["transformer"] % groups == 0 and onloads["transformer"] >= groups, (
                onloads,
                blocks,
            )
            streamed = next(iter(res.groups["transformer"]))
            assert all(t.numel() == 0 for t, _ in streamed.tensors)  # offloaded after the call
        for unit in res.visitors.values():
            assert all(t.numel() == 0 for t, _ in unit.tensors)
        ran.append(name)
    assert len(ran) >= 5


TILED_PSNR_DB = 40.0
"""A tiled decode against the untiled one at 320x64 (two tiles of 256 rows blended over 64), the tiny
random VAEs: measured 54.5 dB (flux-tiny) and 50.9 dB (wan-tiny). Tiles are blended, so it is never bit
for bit."""


@pytest.mark.parametrize("family", ["flux-tiny", "wan-tiny"])
def test_a_tiled_plan_decodes_in_tiles_close_to_the_untiled_decode(tmp_path, family):
    from sdkiln.metrics import psnr
    from sdkiln.model_zoo import get_spec

    size = {"num_inference_steps": 2, "height": 320, "width": 64}  # two tiles, one above the other
    sdkiln.optimize(
        family, "w8a16", tmp_path / "pkg", deployment=Deployment(**size), eval_samples=0, progress=False
    )
    call = get_spec(family).call_kwargs(**size) | {"output_type": "np"}
    outs, tiles = [], []
    for memory in (None, MemoryConfig(plan="encoders+vae+tiled")):
        pipe = sdkiln.load(tmp_path / "pkg", device="cpu", memory=memory)
        original = pipe.vae.tiled_decode
        pipe.vae.tiled_decode = lambda *a, _original=original, **k: tiles.append(1) or _original(*a, **k)
        with torch.inference_mode():
            outs.append(pipe(prompt="a coat", generator=torch.Generator().manual_seed(0), **call)[0])
    assert len(tiles) == 1 and pipe.sdkiln_memory.plan.vae_tiled  # the tiled plan's decode, only
    assert pipe.sdkiln_memory.onloads["vae"] >= 1
    measured = float(psnr(outs[0], outs[1])[0])
    assert TILED_PSNR_DB <= measured < float("inf"), measured


def _list_lengths(pipe) -> list[int]:
    from sdkiln.runtime.memory.sizes import block_lists

    return [len(b) for _, b in block_lists(pipe.transformer)]


def test_a_budget_picks_and_prints_the_plan_and_a_lora_runs_on_streamed_blocks(packages, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="sdkiln.load"):
        pipe = sdkiln.load(packages["flux-tiny"], device="cpu", memory=MemoryConfig(device_budget="1G"))
    assert pipe.sdkiln_memory.plan.name == "resident" and "memory plan resident" in caplog.text
    streamed = sdkiln.load(packages["flux-tiny"], device="cpu", memory=MemoryConfig(plan="blocks:1"))
    g = torch.Generator().manual_seed(3)
    name = "transformer_blocks.0.attn.to_q"
    layer = pipe.transformer.get_submodule(name)
    lora = {
        f"transformer.{name}.lora_A.weight": torch.randn(4, layer.in_features, generator=g),
        f"transformer.{name}.lora_B.weight": torch.randn(layer.out_features, 4, generator=g),
    }
    pipe.load_lora_weights(dict(lora), adapter_name="x")
    streamed.load_lora_weights(dict(lora), adapter_name="x")
    assert torch.equal(_run(streamed, "flux-tiny"), _run(pipe, "flux-tiny"))
    with pytest.raises(SdkilnError, match="stream from host copies"):
        streamed.fuse_lora()


def test_refusals(packages):
    from sdkiln.configs import CompileConfig

    with pytest.raises(SdkilnError, match="no memory plan fits a 0.0 MiB|no memory plan fits"):
        sdkiln.load(packages["flux-tiny"], device="cpu", memory=MemoryConfig(device_budget=1024))
    with pytest.raises(SdkilnError, match="CUDA graphs"):
        sdkiln.load(
            packages["flux-tiny"], device="cpu", memory=MemoryConfig(plan="encoders"),
            compile=CompileConfig(cuda_graphs=True),
        )  # fmt: skip
    with pytest.raises(SdkilnError, match="compile does not take yet"):
        sdkiln.load(
            packages["flux-tiny"], device="cpu", memory=MemoryConfig(plan="blocks:2"), compile=CompileConfig()
        )


def test_run_prints_the_plan_and_refuses_a_budget_in_one_line(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from sdkiln.cli import main

    outs = []
    for flags in ([], ["--memory-plan", "blocks:2"]):
        png = tmp_path / f"out{len(flags)}.png"
        assert (
            main(["run", str(FIXTURE), "--prompt", "a cat", "--steps", "4", "--out", str(png), *flags]) == 0
        )
        outs.append(np.asarray(Image.open(png)))
    assert np.array_equal(*outs)
    out = capsys.readouterr().out
    assert "memory plan blocks:2" in out and "2 at a time" in out
    assert main(["run", str(FIXTURE), "--prompt", "a cat", "--memory-budget", "1M", "--out", str(png)]) != 0
    err = capsys.readouterr().err
    # at 32x32 the decode is the largest moment, which streaming does not shrink: blocks:4 is as small
    assert (
        "no memory plan fits a 1.0 MiB device budget (0.9 MiB after 10% headroom): the smallest, blocks:4"
        in err
    )
    assert err.count("\n") == 1


def test_the_memory_table_reads_what_loading_measures(packages, tmp_path, capsys):
    """From the headers alone, the bytes per block and of the transformer and the VAE equal the loaded
    modules'; a text encoder's differ by its non-persistent buffers (CLIP's position ids: 77 int64)."""
    from sdkiln.cli import main
    from sdkiln.export.publish import model_card
    from sdkiln.runtime.memory import sizes_of
    from sdkiln.runtime.memory.table import memory_table, package_sizes
    from sdkiln.runtime.package import open_package

    pkg = open_package(FIXTURE)
    pipe = sdkiln.load(FIXTURE, device="cpu", memory=MemoryConfig(plan="resident"))
    live = pipe.sdkiln_memory.sizes
    from sdkiln.model_zoo import get_spec

    spec = get_spec("flux-tiny")
    sizes, disk = package_sizes(pkg, spec, spec.call_kwargs(height=32, width=32, max_sequence_length=16))
    assert sizes == live  # the loader plans from the table
    modules = sizes_of(pipe, spec, ("transformer",), spec.call_kwargs(height=32, width=32))
    assert sizes.components.keys() == modules.components.keys()
    for name, stored in sizes.components.items():
        assert stored == modules.components[name] or 0 < modules.components[name] - stored <= 77 * 8, name
    assert sorted(sizes.blocks["transformer"]) == sorted(modules.blocks["transformer"])
    assert all(disk[n] >= sizes.components[n] for n in disk)  # headers and the index on top
    table = memory_table(pkg)
    for name, p in table["plans"].items():
        fits = plan(live, p["budget_bytes"])
        assert fits.peak <= p["peak_bytes"], (
            name
        )  # the budget the table names fits that plan (or a faster one)
    assert main(["inspect", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "memory budgets: resident from" in out and "docs/memory.md" in out
    card = model_card(pkg, "org/flux-tiny", "apache-2.0")
    assert "## Memory" in card and "| blocks:1 |" in card


@pytest.mark.slow
def test_a_compiled_package_with_visiting_encoders_and_vae_equals_the_compiled_resident_run(packages):
    """The plans that leave the transformer resident compose with compile (the fast twin: the
    refusal of compile with streamed blocks in ``test_refusals``)."""
    from sdkiln.configs import CompileConfig

    compile = CompileConfig(regional=True)
    resident = sdkiln.load(packages["flux-tiny"], device="cpu", compile=compile)
    visiting = sdkiln.load(
        packages["flux-tiny"], device="cpu", compile=compile, memory=MemoryConfig(plan="encoders+vae")
    )
    assert torch.equal(_run(visiting, "flux-tiny"), _run(resident, "flux-tiny"))
    assert all(n >= 1 for n in visiting.sdkiln_memory.onloads.values())


def test_both_wan22_experts_are_in_the_table_and_stream(tmp_path):
    """Wan2.2-A14B's low-noise expert (``transformer_2``) is counted with its blocks, and a
    ``blocks:1`` plan streams both experts and equals the resident run."""
    from sdkiln.model_zoo import get_spec
    from sdkiln.runtime.memory.table import deployment_sizes
    from sdkiln.runtime.package import open_package

    sdkiln.optimize("wan2.2-a14b-tiny", "w8a16", tmp_path / "pkg", eval_samples=0, progress=False)
    sizes, _ = deployment_sizes(open_package(tmp_path / "pkg"))
    assert sizes.transformers == ("transformer", "transformer_2")
    assert len(sizes.blocks["transformer_2"]) == len(sizes.blocks["transformer"]) >= 2
    call = get_spec("wan2.2-a14b-tiny").call_kwargs(num_inference_steps=4) | {"output_type": "np"}
    outs = []
    for memory in (None, MemoryConfig(plan="blocks:1")):
        pipe = sdkiln.load(tmp_path / "pkg", device="cpu", memory=memory)
        with torch.inference_mode():
            outs.append(pipe(prompt="a cat", generator=torch.Generator().manual_seed(0), **call)[0])
    onloads = pipe.sdkiln_memory.onloads
    assert onloads["transformer"] > 0 and onloads["transformer_2"] > 0, onloads
    assert torch.equal(torch.as_tensor(outs[0]), torch.as_tensor(outs[1]))


def test_the_table_carries_the_report_generations_device_peak(packages, tmp_path):
    """What ``optimize`` measured on a GPU (``report/optimize.json``, per phase): the quality report's
    generation's device peak reaches the table and its line (a CPU run records none, as here before
    the edit)."""
    import json
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
    from fuzz_mutate import resign

    from sdkiln.runtime.memory.table import memory_table, table_lines
    from sdkiln.runtime.package import open_package

    pkg = tmp_path / "pkg"
    shutil.copytree(packages["wan-tiny"], pkg)
    assert "report_generation_peak_device_bytes" not in memory_table(open_package(pkg))["optimize_measured"]
    report = json.loads((pkg / "report" / "optimize.json").read_text())
    report |= {"device": "cuda:0", "peak_device_bytes": 3 * GIB}
    report["phases"].append({"name": "report: optimized model", "peak_device_bytes": 2 * GIB})
    (pkg / "report" / "optimize.json").write_text(json.dumps(report))
    resign(pkg)
    table = memory_table(open_package(pkg))
    assert table["optimize_measured"]["report_generation_peak_device_bytes"] == 2 * GIB
    assert "peak device 3.00 GiB (the quality report's generation: 2.00 GiB)" in table_lines(table)[-1]
