import json

import pytest

from sdkiln.configs import (
    STEP_CONFIGS,
    CacheAutoConfig,
    QuantAutoConfig,
    RecipeConfig,
    StepConfig,
    W8A8DynamicConfig,
)
from sdkiln.errors import RecipeError
from sdkiln.optimizer.recipes import resolve_recipe


@pytest.mark.parametrize("kind", sorted(STEP_CONFIGS))
def test_every_step_config_round_trips_through_json(kind):
    config = STEP_CONFIGS[kind]()
    again = StepConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and type(again) is type(config)


def test_recipe_round_trips_through_json():
    recipe = RecipeConfig(name="x", steps=[W8A8DynamicConfig(exclude=("*.proj_out",))])
    again = RecipeConfig.from_dict(json.loads(json.dumps(recipe.to_dict())))
    assert again == recipe


def test_named_recipes():
    assert resolve_recipe("none").steps == []
    assert resolve_recipe("default").steps == [QuantAutoConfig(), CacheAutoConfig()]
    assert resolve_recipe("none+w8a8-dynamic").steps == [W8A8DynamicConfig()]


def test_unknown_recipe_and_kind_are_clear_errors(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe 'int3'"):
        resolve_recipe("int3")
    with pytest.raises(RecipeError, match="same step twice"):
        resolve_recipe("quant-auto+default")
    with pytest.raises(RecipeError, match="unknown recipe step kind"):
        StepConfig.from_dict({"kind": "pickle_me"})
    with pytest.raises(RecipeError, match="unknown fields"):
        StepConfig.from_dict({"kind": "w8a8_dynamic", "bits": 3})
    with pytest.raises(RecipeError, match="config version 9"):
        StepConfig.from_dict({"kind": "w8a8_dynamic", "version": 9})
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
