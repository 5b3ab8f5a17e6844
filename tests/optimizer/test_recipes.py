import json

import pytest

import sdkiln
from sdkiln.cli import main
from sdkiln.configs import (
    RECIPE_STEPS,
    CacheAutoConfig,
    Deployment,
    QuantAutoConfig,
    RecipeConfig,
    RecipeStep,
    TextEncoderQuantConfig,
    W8A8DynamicConfig,
    W8A8StaticConfig,
    WeightRounding,
)
from sdkiln.errors import RecipeError
from sdkiln.optimizer.recipes import named_recipes, resolve_recipe


@pytest.mark.parametrize("kind", sorted(RECIPE_STEPS))
def test_every_step_config_round_trips_through_json(kind):
    config = RECIPE_STEPS[kind]()
    again = RecipeStep.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and type(again) is type(config)


def test_recipe_round_trips_through_json():
    recipe = RecipeConfig(name="x", steps=[W8A8DynamicConfig(exclude=("*.proj_out",))])
    again = RecipeConfig.from_dict(json.loads(json.dumps(recipe.to_dict())))
    assert again == recipe


def test_named_recipes():
    assert resolve_recipe("none").steps == []
    assert resolve_recipe("default").steps == [TextEncoderQuantConfig(), QuantAutoConfig(), CacheAutoConfig()]
    assert resolve_recipe("none+w8a8-dynamic").steps == [W8A8DynamicConfig()]


def test_unknown_recipe_and_kind_are_clear_errors(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe 'int3'"):
        resolve_recipe("int3")
    with pytest.raises(RecipeError, match="same recipe step twice"):
        resolve_recipe("quant-auto+default")
    with pytest.raises(RecipeError, match="unknown recipe step kind"):
        RecipeStep.from_dict({"kind": "pickle_me"})
    with pytest.raises(RecipeError, match="unknown fields"):
        RecipeStep.from_dict({"kind": "w8a8_dynamic", "bits": 3})
    with pytest.raises(RecipeError, match="config version 9"):
        RecipeStep.from_dict({"kind": "w8a8_dynamic", "version": 9})
    with pytest.raises(RecipeError, match="not found"):
        resolve_recipe(str(tmp_path / "missing.json"))


def test_recipe_files_json_and_yaml(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"steps": [{"kind": "w8a8_dynamic", "exclude": ["*.ff.*"]}]}))
    (tmp_path / "r.yaml").write_text("name: mine\nsteps:\n  - kind: w8a8_dynamic\n")
    assert resolve_recipe(str(tmp_path / "r.json")).steps == [W8A8DynamicConfig(exclude=("*.ff.*",))]
    yaml_recipe = resolve_recipe(str(tmp_path / "r.yaml"))
    assert yaml_recipe.name == "mine" and yaml_recipe.steps == [W8A8DynamicConfig()]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RecipeError, match="cannot parse"):
        resolve_recipe(str(tmp_path / "bad.json"))


def test_two_quantization_schemes_in_one_recipe_are_refused():
    with pytest.raises(RecipeError, match="names 2 quantization schemes"):
        resolve_recipe("w8a16+w8a8-dynamic")


def test_every_recipe_step_kind_has_a_name_and_weight_rounding_a_gptq_name():
    names = named_recipes()
    for kind, cls in RECIPE_STEPS.items():
        assert names[kind.replace("_", "-")]() == [cls()]
        if issubclass(cls, WeightRounding):
            assert names[f"{kind.replace('_', '-')}-gptq"]() == [cls(weight_rounding="gptq")]


def test_deployment_round_trips_and_validates():
    recipe = RecipeConfig(
        "x", [W8A8DynamicConfig()], Deployment(num_inference_steps=6, guidance=3.5, height=64)
    )
    assert RecipeConfig.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    for bad, match in [
        (dict(num_inference_steps=0), "num_inference_steps must be a positive integer"),
        (dict(height=True), "height must be a positive integer"),
        (dict(guidance=float("nan")), "guidance must be a finite number"),
    ]:
        with pytest.raises(RecipeError, match=match):
            Deployment(**bad)
    with pytest.raises(RecipeError, match="deployment has unknown fields: steps"):
        Deployment.from_dict({"steps": 4})
    with pytest.raises(RecipeError, match="at least 3 denoising steps"):
        RecipeConfig("x", [CacheAutoConfig()], Deployment(num_inference_steps=2))


def test_one_denoising_step_count_per_recipe():
    """Recipe files from before deployments named the step count per step: it is lifted into the
    deployment, and steps that disagree (with each other or the deployment) are refused."""
    legacy = {"steps": [{"kind": "w8a8_static", "calib_steps": 6}, {"kind": "cache_auto", "steps": 6}]}
    recipe = RecipeConfig.from_dict(legacy)
    assert recipe.deployment.num_inference_steps == 6 and recipe.steps == [
        W8A8StaticConfig(),
        CacheAutoConfig(),
    ]
    with pytest.raises(RecipeError, match=r"different denoising step counts \(w8a8_static.calib_steps = 4; "):
        RecipeConfig.from_dict(
            {"steps": [{"kind": "w8a8_static", "calib_steps": 4}, {"kind": "cache_auto", "steps": 6}]}
        )
    with pytest.raises(RecipeError, match="deploys at num_inference_steps=4 but cache_auto.steps says 6"):
        RecipeConfig.from_dict(
            {"deployment": {"num_inference_steps": 4}, "steps": [{"kind": "cache_auto", "steps": 6}]}
        )
    with pytest.raises(
        RecipeError, match=r"CacheAutoConfig\(steps=...\): a recipe has one denoising step count"
    ):
        CacheAutoConfig(steps=6)  # the Python API has one home for it: RecipeConfig(deployment=...)
    with pytest.raises(RecipeError, match="deployment=Deployment"):
        W8A8StaticConfig(calib_steps=6)
    with pytest.raises(RecipeError, match="deploys at num_inference_steps=6 but the optimize call says 5"):
        recipe.deployment.merged(Deployment(num_inference_steps=5), "the optimize call")


def test_a_cache_schedule_recipe_at_6_steps_deploys_searches_and_records_6(tmp_path):
    """The case that used to write a manifest saying 4 steps and a schedule searched at 6: a recipe
    file whose cache_auto step names 6 denoising steps now makes everything agree at 6."""
    small = {"calib_samples": 2, "eval_samples": 1, "budgets": 2, "refine": 0}
    (tmp_path / "r.json").write_text(json.dumps({"steps": [{"kind": "cache_auto", "steps": 6, **small}]}))
    result = sdkiln.optimize("flux-tiny", str(tmp_path / "r.json"), tmp_path / "pkg", eval_samples=1)
    schedule = json.loads((tmp_path / "pkg" / "schedules" / "cache_schedule.json").read_text())
    step = result.manifest["recipe"]["steps"][0]
    assert result.manifest["call"]["defaults"]["num_inference_steps"] == 6
    assert result.manifest["recipe"]["deployment"]["num_inference_steps"] == 6
    assert schedule["num_steps"] == 6 and len(schedule["sigmas"]) == 6
    assert schedule["search"]["calibration"]["steps"] == 6 and result.quality["steps"] == 6
    assert step["config"]["kind"] == "cache_auto" and "steps" not in step["config"]
    assert result.manifest["cache_schedule"] == {"file": "schedules/cache_schedule.json"}
    assert main(["optimize", "flux-tiny", "--recipe", str(tmp_path / "r.json"), "--out", str(tmp_path / "o"),
                 "--steps", "5", "--eval-samples", "0"]) == 2  # fmt: skip
