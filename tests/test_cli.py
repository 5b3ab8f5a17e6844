"""The CLI end to end on the tiny zoo models: packages load and generate; errors are one line."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from sdkiln.cli import main

QUANTIZED_BYTES_CEILING = 0.27  # int8 weights + scales vs fp32 weights (issue acceptance)


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "sdkiln.cli", *args], capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    out = {}
    for name in ("flux-tiny", "sd3-tiny", "wan-tiny"):
        assert (
            main(
                [
                    "optimize",
                    name,
                    "--recipe",
                    "w8a8-dynamic",
                    "--out",
                    str(root / name),
                    "--eval-samples",
                    "2",
                ]
            )
            == 0
        )
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", ["flux-tiny", "sd3-tiny", "wan-tiny"])
def test_packages_load_and_generate(packages, name, tmp_path, capsys):
    png = tmp_path / "out.png"
    assert main(["run", str(packages[name]), "--prompt", "a red cube", "--seed", "1", "--out", str(png)]) == 0
    assert png.stat().st_size > 0


def test_run_verbose_prints_the_kernel_table_and_what_ran(packages, tmp_path, capsys):
    capsys.readouterr()
    png = tmp_path / "out.png"
    assert main(["run", str(packages["flux-tiny"]), "--prompt", "a", "--out", str(png), "--verbose"]) == 0
    out = capsys.readouterr().out
    from sdkiln.kernels.cpu import native
    from sdkiln.kernels.cpu_profile import cpu_profile

    prof = cpu_profile()
    assert f"int8 x int8 product (w8a8_linear, w8a8_static_linear): {prof.int8_product}" in out
    if native.available():  # the W8A8 layers ran their fused kernels, on the products chosen by size
        head = "  w8a8_linear_from_float, cpu: "
        ran = {line.removeprefix(head).split(" x ")[0] for line in out.splitlines() if line.startswith(head)}
        assert ran and ran <= {f"fused_{prof.int8_product}", f"fused_{prof.fused_product_small}"}
    else:  # the composite's reference: the two ops, dispatched
        assert f"  w8a8_linear, cpu: {prof.int8_product} x " in out
        assert "  quantize_per_token_int8, cpu: reference x " in out


def test_inspect_ends_with_the_cpu_table(packages, capsys):
    capsys.readouterr()
    assert main(["inspect", str(packages["flux-tiny"])]) == 0
    out = capsys.readouterr().out
    assert "on this machine (sdkiln run --device cpu):" in out and "int8 x int8 product" in out


def test_no_third_party_noise_before_the_error(packages, tmp_path):
    """With torchao installed (the test extra), `run` on a package whose tokenizer file is damaged
    (and listed with its damaged hash, so it loads as far as the tokenizer) prints sdkiln's one
    error line and nothing from torchao or torch's pytree (issue 30: four lines came first)."""
    bad = tmp_path / "pkg"
    shutil.copytree(packages["flux-tiny"], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    rel = next(r for r in sorted(manifest["files"]) if r.startswith("tokenizer/") and r.endswith(".json"))
    damaged = b'{"not a tokenizer": '
    (bad / rel).write_bytes(damaged)
    manifest["files"][rel] = {"sha256": hashlib.sha256(damaged).hexdigest(), "size": len(damaged)}
    (bad / "manifest.json").write_text(json.dumps(manifest, indent=2))
    code, out, err = run_cli("run", str(bad), "--prompt", "a")
    assert code == 2
    assert err.strip().count("\n") == 0 and err.startswith("sdkiln: error:"), err


def test_inspect_json_reports_quantized_bytes(packages, capsys):
    capsys.readouterr()
    assert main(["inspect", str(packages["flux-tiny"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    s = report["summary"]
    assert s["layers_quantized"] > 0 and s["layers_float"] > 0
    assert s["quantized_bytes"] <= QUANTIZED_BYTES_CEILING * s["quantized_float_bytes"]
    assert report["schema_version"] == 1 and "files" in report


def test_eval_json_recomputes_quality(packages, capsys):
    capsys.readouterr()
    assert main(["eval", str(packages["flux-tiny"]), "--num-samples", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"psnr", "ssim", "cosine", "latent_rel_l2", "num_samples", "steps"} <= set(report)
    assert report["num_samples"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["optimize", "/no/such/model", "--out", "x"], "/no/such/model"),
        (["optimize", "flux-tiny", "--recipe", "int3", "--out", "x"], "unknown recipe 'int3'"),
        (["inspect", "/no/such/package"], "no such package directory"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, message, tmp_path):
    code, out, err = run_cli(*args)
    assert code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_tampered_package_and_foreign_base_model(packages, tmp_path):
    import shutil

    root = tmp_path / "p"
    shutil.copytree(packages["flux-tiny"], root)
    (root / "eval" / "quality.json").write_text("{}")
    code, _, err = run_cli("inspect", str(root))
    assert code == 2 and "eval/quality.json: size" in err and "Traceback" not in err

    shutil.rmtree(root)
    shutil.copytree(packages["flux-tiny"], root)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["model"]["weights_hash"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("eval", str(root), "--num-samples", "1")
    assert code == 2 and "does not match" in err and "Traceback" not in err


def test_optimize_from_a_local_diffusers_directory(tmp_path, capsys):
    from sdkiln.model_zoo import get_spec

    get_spec("flux-tiny").build().save_pretrained(tmp_path / "base")
    out = tmp_path / "pkg"
    assert (
        main(
            [
                "optimize",
                str(tmp_path / "base"),
                "--recipe",
                "w8a8-dynamic",
                "--out",
                str(out),
                "--eval-samples",
                "1",
            ]
        )
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["base_id"] == str((tmp_path / "base").resolve())
    assert (manifest["model"]["family"], manifest["model"]["variant"]) == ("flux", "tiny")
    assert main(["eval", str(out), "--num-samples", "1", "--json"]) == 0


def test_a_guider_family_runs_and_refuses_guidance_in_one_line(tmp_path, capsys):
    """HunyuanVideo-1.5 takes its guidance from its guider component: the package keeps it, the report
    records its scale, and --guidance is one line on optimize, run and eval."""
    pkg = tmp_path / "hv15"
    assert main(["optimize", "hunyuan-video-1.5-tiny", "--recipe", "w8a8-dynamic", "--out", str(pkg), "--eval-samples", "1"]) == 0  # fmt: skip
    assert json.loads((pkg / "manifest.json").read_text())["call"]["guidance_arg"] is None
    assert json.loads((pkg / "guider" / "guider_config.json").read_text())["guidance_scale"] == 6.0
    assert "guidance 6.0" in capsys.readouterr().out
    png = tmp_path / "out.png"
    assert (
        main(["run", str(pkg), "--prompt", "a red cube", "--out", str(png)]) == 0 and png.stat().st_size > 0
    )
    for args in (
        ["optimize", "hunyuan-video-1.5-tiny", "--guidance", "4", "--out", str(tmp_path / "x")],
        ["run", str(pkg), "--prompt", "a", "--guidance", "4", "--out", str(tmp_path / "y.png")],
        ["eval", str(pkg), "--guidance", "4"],
    ):
        capsys.readouterr()
        assert main(args) == 2, args
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sdkiln: error:")]
        assert len(err) == 1 and "takes no guidance argument" in err[0], (args, err)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y.png").exists()
