"""Recipe names -> ordered step configs. Names combine with '+'; a JSON/YAML file is a recipe too."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sdkiln.configs import (
    CacheAutoConfig,
    FP8DynamicConfig,
    QuantAutoConfig,
    RecipeConfig,
    SmoothQuantConfig,
    StepConfig,
    W4A16Config,
    W8A8DynamicConfig,
    W8A8StaticConfig,
    W8A8TimestepConfig,
    W8A16Config,
)
from sdkiln.errors import RecipeError

NAMED_RECIPES: dict[str, Callable[[], list[StepConfig]]] = {
    "none": lambda: [],
    "w8a8-dynamic": lambda: [W8A8DynamicConfig()],
    "w8a8-dynamic-gptq": lambda: [W8A8DynamicConfig(weight_rounding="gptq")],
    "fp8-dynamic": lambda: [FP8DynamicConfig()],
    "w8a16": lambda: [W8A16Config()],
    "w4a16": lambda: [W4A16Config()],
    "w8a16-gptq": lambda: [W8A16Config(weight_rounding="gptq")],
    "w4a16-gptq": lambda: [W4A16Config(weight_rounding="gptq")],
    "w8a8-static": lambda: [W8A8StaticConfig()],
    "w8a8-timestep": lambda: [W8A8TimestepConfig()],
    "smoothquant": lambda: [SmoothQuantConfig()],
    "quant-auto": lambda: [QuantAutoConfig()],
    "cache-auto": lambda: [CacheAutoConfig()],
    # Presets: the same search, a different floor on the confirmed front (mean / 5th-percentile PSNR).
    "cache-fast": lambda: [CacheAutoConfig(psnr_floor_db=25.0, psnr_p5_floor_db=20.0)],
    "cache-balanced": lambda: [CacheAutoConfig()],
    "cache-safe": lambda: [CacheAutoConfig(psnr_floor_db=35.0, psnr_p5_floor_db=30.0, guard=True)],
    # More calibration samples, more actions and lengths, a longer refinement: slower, for a release.
    "cache-thorough": lambda: [
        CacheAutoConfig(
            actions=("skip", "skip~", "partial:1:1", "partial~:1:1", "partial:2:2"),
            max_reuse=5,
            calib_samples=8,
            eval_samples=16,
            budgets=32,
            refine=40,
        )
    ],
}
ALIASES = {"default": "quant-auto+cache-auto"}


def resolve_recipe(recipe: str | RecipeConfig) -> RecipeConfig:
    """A recipe from a name (``w8a8-dynamic``, ``a+b``, ``default``), a JSON/YAML file, or a config."""
    if isinstance(recipe, RecipeConfig):
        return recipe
    if recipe.endswith((".json", ".yaml", ".yml")):
        return _recipe_file(Path(recipe))
    steps: list[StepConfig] = []
    parts = [p for part in recipe.split("+") for p in ALIASES.get(part.strip(), part.strip()).split("+")]
    for name in parts:
        if name not in NAMED_RECIPES:
            known = ", ".join(sorted([*NAMED_RECIPES, *ALIASES]))
            raise RecipeError(f"unknown recipe {name!r}; known: {known}, or a .json/.yaml recipe file")
        steps.extend(NAMED_RECIPES[name]())
    kinds = [s.kind for s in steps]
    if len(set(kinds)) != len(kinds):
        raise RecipeError(f"recipe {recipe!r} applies the same step twice: {kinds}")
    quantizers = [s.kind for s in steps if s.quantizes]
    if len(quantizers) > 1:
        raise RecipeError(
            f"recipe {recipe!r} names {len(quantizers)} quantization schemes ({', '.join(quantizers)}); each would "
            "take every layer: name one, use quant-auto to mix them per layer, or split layers in a recipe file with 'exclude'"
        )
    return RecipeConfig(name=recipe, steps=sorted(steps, key=lambda s: s.order))


def _recipe_file(path: Path) -> RecipeConfig:
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json and yaml raise different types; both mean "not parseable"
        raise RecipeError(f"{path}: cannot parse recipe ({exc})") from None
    data = dict(data) if isinstance(data, dict) else data
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    try:
        return RecipeConfig.from_dict(data)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
