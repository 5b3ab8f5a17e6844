"""``optimize --match-quality PACKAGE`` (``optimizer.match``): the cache search's floors rise to that
package's held-out result less the slack, its front is confirmed on this model beside the search's own
candidates, and the manifest records the target; a package or recipe whose quality would not compare
is refused in one line, before any forward."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

import sdkiln
from sdkiln.cli import main
from sdkiln.configs import CacheAutoConfig, Deployment, RecipeConfig
from sdkiln.errors import PackageError, RecipeError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.match import QualityTarget
from sdkiln.runtime.cache import SCHEDULE_FILE
from sdkiln.runtime.manifest_schema import check_manifest
from sdkiln.runtime.package import open_package

STEPS = 6


def _cache(**kw) -> CacheAutoConfig:
    settings = dict(calib_samples=2, eval_samples=2, held_out_extend=0, budgets=4, refine=1)
    return CacheAutoConfig(**{**settings, "psnr_floor_db": 0.0, "psnr_p5_floor_db": 0.0, **kw})


def _recipe(steps: int = STEPS, **kw) -> RecipeConfig:
    return RecipeConfig("cache", steps=[_cache(**kw)], deployment=Deployment(num_inference_steps=steps))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A flux-tiny package with a searched schedule (floor 0: its cheapest confirmed schedule)."""
    path = tmp_path_factory.mktemp("match") / "base"
    sdkiln.optimize("flux-tiny", _recipe(), path, eval_samples=0, progress=False)
    return path


def _schedule(package) -> dict:
    return json.loads((package / SCHEDULE_FILE).read_text())


def test_a_fused_lora_package_matches_the_base_package(base, tmp_path, capsys):
    """The CLI, as a user makes a LoRA variant of a published package: floors from the base package's
    held-out result, its front confirmed on the LoRA'd model, the target in the manifest."""
    transformer = get_spec("flux-tiny").build().transformer
    g, state = torch.Generator().manual_seed(3), {}
    for name, module in transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_out.0", "proj_mlp")):
            k, n = module.in_features, module.out_features
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(4, k, generator=g) / k**0.5
            state[f"transformer.{name}.lora_B.weight"] = 0.3 * torch.randn(n, 4, generator=g)
    save_file(state, tmp_path / "style.safetensors")
    recipe_file = tmp_path / "recipe.json"
    recipe_file.write_text(json.dumps({"name": "cache", "steps": [_cache().to_dict()]}))
    out = tmp_path / "styled"
    args = ["optimize", "flux-tiny", "--recipe", str(recipe_file), "--steps", str(STEPS), "--out", str(out)]
    args += ["--eval-samples", "0", "--lora", f"{tmp_path / 'style.safetensors'}:1.0"]
    assert main([*args, "--match-quality", str(base), "--match-slack", "2"]) == 0
    printed = capsys.readouterr()

    theirs = _schedule(base)
    held = theirs["expected"]
    mean_floor = round(held["psnr_mean"] - 2, 2)
    p5_floor = round(held["psnr_p5"] - 2, 2)
    assert f"matching {base}'s cache quality (held-out {held['psnr_mean']:.2f} dB" in printed.err
    manifest = json.loads((out / "manifest.json").read_text())
    target = manifest["recipe"]["quality_target"]
    assert target["digest"] == open_package(base).digest and target["slack_db"] == 2.0
    assert target["held_out"]["psnr_mean_db"] == held["psnr_mean"]
    assert target["held_out"]["block_evaluations_ratio"] == held["block_evaluations_ratio"]
    step = manifest["recipe"]["steps"][0]
    config = step["config"]
    assert (config["psnr_floor_db"], config["psnr_p5_floor_db"]) == (max(0.0, mean_floor), max(0.0, p5_floor))
    front = [",".join(p["actions"]) for p in theirs["search"]["front"]]
    assert config["candidates"] == front and target["front_given"] == len(front)
    assert config["eval_samples"] == max(_cache().eval_samples, len(held["prompts"]))

    ours = _schedule(out)
    given = ours["search"]["given"]
    assert given["candidates"] == given["fit"] == len(front)
    # each of the base's schedules ran on this model: block evaluations follow from the actions alone
    ratios = sorted(p["block_evaluations_ratio"] for p in theirs["search"]["front"])
    assert [p["block_evaluations_ratio"] for p in given["confirmed"]] == pytest.approx(ratios)
    # the chosen schedule meets the raised floor on the held-out samples, or the search said it missed
    expected = ours["expected"]
    met = expected["psnr_mean"] - expected["psnr_se"] >= config["psnr_floor_db"]
    assert met or "misses the floor after" in printed.out + printed.err
    assert step["result"]["source"] in {p.get("source") for p in ours["search"]["front"]}

    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"cache quality matched to: {base} ({target['digest'][:19]}...): its held-out" in shown
    for change, message in [
        (lambda t: t.update(digest="sha256:xyz"), r"quality_target.digest: 'sha256:xyz' is not of the form"),
        (
            lambda t: t["held_out"].update(psnr_mean_db=float("nan")),
            r"held_out.psnr_mean_db: must be a finite",
        ),
        (lambda t: t.pop("slack_db"), "quality_target: missing 'slack_db'"),
        (lambda t: t["held_out"].update(samples=True), "held_out.samples: must be an integer"),
    ]:
        bad = copy.deepcopy(manifest)
        change(bad["recipe"]["quality_target"])
        with pytest.raises(PackageError, match=message):
            check_manifest(bad)


def test_given_schedules_that_do_not_fit_the_search_are_left_out(flux_tiny, capsys):
    _, pipe = flux_tiny
    fits = "full,skip,full,skip,full,full"
    candidates = ("full,skip,skip,skip,full,full", "full,full", "skip,full,full,full,full,full", fits)
    recipe = _recipe(candidates=candidates, max_reuse=2, budgets=1, refine=0)
    data = sdkiln.optimize(pipe, recipe, out_dir=None, eval_samples=0, progress=False).files[SCHEDULE_FILE]
    given = data["search"]["given"]
    assert (given["candidates"], given["fit"]) == (4, 1)
    (point,) = given["confirmed"]
    assert point["block_evaluations_ratio"] == pytest.approx(4 / 6)  # 4 full steps of 6
    assert "3 of 4 given schedules left out" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown cache action 'bogus'"):
        CacheAutoConfig(candidates=("full,bogus,full",))


def test_a_target_whose_quality_would_not_compare_is_refused(base, tmp_path, capsys):
    with pytest.raises(RecipeError, match="made for steps 6, this one for 4"):
        sdkiln.optimize("flux-tiny", _recipe(steps=4), None, eval_samples=0, match_quality=base)
    with pytest.raises(RecipeError, match="has no cache_auto step"):
        sdkiln.optimize("flux-tiny", "w8a8-dynamic", None, eval_samples=0, match_quality=base)
    target = QualityTarget.read(base)
    sd3 = get_spec("sd3-tiny")
    with pytest.raises(RecipeError, match="that package is flux tiny, this model is sd3 tiny"):
        target.check(sd3, sd3.call_kwargs(num_inference_steps=STEPS))
    plain = sdkiln.optimize("flux-tiny", "none", tmp_path / "plain", eval_samples=0, progress=False).package
    with pytest.raises(RecipeError, match="has no cache schedule"):
        QualityTarget.read(plain)
    with pytest.raises(PackageError, match="is not a package directory"):
        QualityTarget.read(tmp_path / "missing")
    with pytest.raises(RecipeError, match="slack"):
        QualityTarget.read(base, slack_db=-1)
    floors = target.floors(CacheAutoConfig(psnr_floor_db=1e3 / 9, psnr_p5_floor_db=0.0))
    assert floors[0] == 1e3 / 9  # a floor is only ever raised
    argv = ["optimize", "--out", str(tmp_path / "x"), "--match-slack", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--match-slack" in err[0] and "--match-quality" in err[0]
