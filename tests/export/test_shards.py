"""Sharded packages: the transformer streamed to shards with an index, every shard listed and hashed,
float layers in the deployment dtype; loaded bit for bit as the single file; and every way of
damaging the set of shards refused with one clean error."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import sdkiln
from sdkiln.errors import PackageError
from sdkiln.export import package_writer
from sdkiln.export.shards import Planned, plan_shards
from sdkiln.model_zoo import get_spec
from sdkiln.runtime import W8A8DynamicLinear, open_package
from sdkiln.runtime.package import MANIFEST

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
from fuzz_mutate import resign  # noqa: E402
from reshard import reshard  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"
INDEX = "transformer/diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture
def sharded(tmp_path) -> Path:
    """The schema-1 fixture with its transformer in four shards of at most 1 MiB."""
    root = Path(shutil.copytree(FIXTURE, tmp_path / "pkg"))
    assert len(reshard(root, 1 << 20)) == 4
    return root


def test_plan_packs_consecutive_tensors_under_the_limit():
    sizes = [3, 3, 5, 1, 9, 2]
    planned = [Planned(f"t{i}", (n,), torch.uint8, lambda: None) for i, n in enumerate(sizes)]
    assert [[t.name for t in s] for s in plan_shards(planned, 6)] == [
        ["t0", "t1"],
        ["t2", "t3"],
        ["t4"],
        ["t5"],
    ]


def test_a_sharded_package_loads_bit_for_bit_as_the_single_file(sharded):
    one, many = sdkiln.load(FIXTURE, device="cpu"), sdkiln.load(sharded, device="cpu")
    a, b = one.transformer.state_dict(), many.transformer.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    call = dict(prompt="a cat", num_inference_steps=4, output_type="latent", generator=None)
    assert torch.equal(
        one(**call | {"generator": torch.Generator().manual_seed(1)}).images,
        many(**call | {"generator": torch.Generator().manual_seed(1)}).images,
    )
    files = open_package(sharded).manifest["files"]
    assert INDEX in files and "transformer/diffusion_pytorch_model.safetensors" not in files
    assert sum("-of-00004" in rel for rel in files) == 4


def _shard(root: Path, i: int = 2) -> Path:
    return root / f"transformer/diffusion_pytorch_model-0000{i}-of-00004.safetensors"


def _edit_index(root: Path, edit) -> None:
    index = json.loads((root / INDEX).read_text())
    edit(index["weight_map"])
    (root / INDEX).write_text(json.dumps(index))
    resign(root)


def _first_in(weight_map: dict, shard: str) -> str:
    return next(k for k, v in weight_map.items() if v == shard)


SHARD2 = "diffusion_pytorch_model-00002-of-00004.safetensors"
DAMAGE = {
    "a modified shard": (
        lambda r: _shard(r).write_bytes(_shard(r).read_bytes()[:-4] + b"\0\0\0\1"),
        "00002-of-00004.safetensors: sha256 does not match",
    ),
    "a missing shard": (
        lambda r: _shard(r).unlink(),
        "00002-of-00004.safetensors: listed in manifest.json but missing",
    ),
    "an extra shard": (
        lambda r: shutil.copy(
            _shard(r), r / "transformer/diffusion_pytorch_model-00005-of-00004.safetensors"
        ),
        "00005-of-00004.safetensors: file not listed",
    ),
    "an extra shard, listed (re-signed)": (
        lambda r: (
            shutil.copy(_shard(r), r / "transformer/extra.safetensors"),
            _add_listed(r, "transformer/extra.safetensors"),
        ),
        "does not name 'extra.safetensors'",
    ),
    "an index naming a file twice": (
        lambda r: _edit_index(r, lambda m: m.update({_first_in(m, SHARD2): f"./{SHARD2}"})),
        "is not the plain name",
    ),
    "an index naming a file outside": (
        lambda r: _edit_index(r, lambda m: m.update({_first_in(m, SHARD2): f"../vae/{SHARD2}"})),
        "is not the plain name",
    ),
    "an index naming a missing file": (
        lambda r: _edit_index(r, lambda m: m.update({_first_in(m, SHARD2): "gone.safetensors"})),
        "names 'gone.safetensors', which is not in the package",
    ),
    "an index putting a tensor in another shard": (
        lambda r: _edit_index(
            r,
            lambda m: m.update({_first_in(m, SHARD2): "diffusion_pytorch_model-00003-of-00004.safetensors"}),
        ),
        "is not where the shard index says",
    ),
    "an index naming a tensor no shard holds": (
        lambda r: _edit_index(r, lambda m: m.update({"nothing.weight": SHARD2})),
        "names tensor 'nothing.weight', which no shard holds",
    ),
}


def _add_listed(root: Path, rel: str) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["files"][rel] = {"sha256": "0" * 64, "size": 0}
    (root / MANIFEST).write_text(json.dumps(manifest))
    resign(root)


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_shards_are_one_clean_error(sharded, name):
    damage, words = DAMAGE[name]
    damage(sharded)
    with pytest.raises(PackageError, match=words):
        sdkiln.load(sharded, device="cpu")


def test_inspect_verifies_every_shard(sharded, capsys):
    from sdkiln.cli import main

    assert main(["inspect", str(sharded)]) == 0
    capsys.readouterr()
    _shard(sharded, 4).write_bytes(b"\1" + _shard(sharded, 4).read_bytes()[1:])
    assert main(["inspect", str(sharded)]) == 2
    assert "00004-of-00004.safetensors: sha256 does not match" in capsys.readouterr().err


def test_the_writer_streams_shards_in_the_deployment_dtype(tmp_path):
    """A bf16 model: its diffusers layers are stored in bf16 (never widened to fp32), the quantized
    layers' scales in the fp32 their scheme declares, shards under the limit, each listed and hashed
    as written."""
    pipe = get_spec("flux-tiny").build()
    pipe.transformer.to(torch.bfloat16)
    result = sdkiln.optimize(pipe, "w8a8-dynamic", None, eval_samples=0, in_place=True, progress=False)
    t = result.pipeline.transformer
    t.x_embedder.float()  # a float layer left in fp32 by mistake is written in the deployment dtype
    out = package_writer.write_package(
        tmp_path / "pkg", result.pipeline, result.manifest, {}, "transformer", max_shard_bytes=256 << 10
    )
    pkg = open_package(out)
    shards = [rel for rel in pkg.files if rel.startswith("transformer/") and rel.endswith(".safetensors")]
    assert len(shards) > 3
    for rel in shards:
        assert pkg.manifest["files"][rel]["size"] <= (256 << 10) + 64 * 1024  # the data limit plus its header
    loaded = sdkiln.load(out, device="cpu").transformer
    quantized = [m for m in loaded.modules() if isinstance(m, W8A8DynamicLinear)]
    assert quantized and all(m.weight_scale.dtype == torch.float32 for m in quantized)
    assert loaded.x_embedder.weight.dtype == torch.bfloat16
    floats = {n: p.dtype for n, p in loaded.named_parameters() if p.is_floating_point()}
    assert set(floats.values()) == {torch.bfloat16}, floats


def test_a_broken_header_reports_the_hash_unless_the_manifest_vouches_for_it(sharded):
    """A file whose header does not parse is first checked against its sha256: damage is reported as
    damage; only a file the manifest lists as it is (a forger's) gets the header's own error."""
    shard = _shard(sharded, 3)
    data = bytearray(shard.read_bytes())
    data[9] = ord("[")  # the header's opening brace: no longer an object
    shard.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="00003-of-00004.safetensors: sha256 does not match"):
        sdkiln.load(sharded, device="cpu")
    resign(sharded)
    with pytest.raises(PackageError, match="00003-of-00004.safetensors.*(header|JSON)"):
        sdkiln.load(sharded, device="cpu")
