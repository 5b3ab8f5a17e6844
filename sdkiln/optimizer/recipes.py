"""Recipe names -> recipes. Names combine with '+'; a JSON/YAML file is a recipe too.

Every registered recipe step kind has a name, its kind with dashes (``w8a8_dynamic`` ->
``w8a8-dynamic``), for its default config; a step with GPTQ rounding also has ``<name>-gptq``.
``PRESETS`` adds the other names: other floors of the cache search, and ``none``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sdkiln.configs import (
    RECIPE_STEPS,
    AttentionQuantConfig,
    CacheAutoConfig,
    RecipeConfig,
    RecipeStep,
    SparseAttentionConfig,
    TextEncoderQuantConfig,
    WeightRounding,
)
from sdkiln.configs.quant import TEXT_ENCODER_SCHEMES
from sdkiln.errors import PackageError, RecipeError, third_party
from sdkiln.runtime.package import parse_json

PRESETS: dict[str, Callable[[], list[RecipeStep]]] = {
    "none": lambda: [],
    # The same search, a different floor on the confirmed front (mean / 5th-percentile PSNR).
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
    # The text encoders in one scheme, behind the family's SQNR floor (docs/memory.md).
    **{
        f"te-{scheme.replace('_', '-')}": (lambda scheme=scheme: [TextEncoderQuantConfig(scheme=scheme)])
        for scheme in TEXT_ENCODER_SCHEMES
    },
    # Quantized attention per layer and step (docs/attention-quantization.md): SageAttention2's formats
    # (INT8 QK^T, FP8 PV), or FP8 throughout.
    "attn-int8": lambda: [AttentionQuantConfig(qk="int8", pv="fp8")],
    "attn-fp8": lambda: [AttentionQuantConfig(qk="fp8", pv="fp8")],
    # FP8 in MindIE SD's blocks (FP8RotateQuantFA): what export-ascend writes for Ascend (docs/ascend.md).
    "attn-fp8-ascend": lambda: [AttentionQuantConfig(qk="fp8", pv="fp8", layout="mindie")],
    # Block-sparse attention: calibrated per layer within the default error budget, or one sparsity
    # for every layer (for comparison; docs/sparsity.md).
    "sparse-attn": lambda: [SparseAttentionConfig()],
    **{f"sparse-attn@{s}": (lambda s=s: [SparseAttentionConfig(sparsity=s)]) for s in (0.5, 0.7, 0.8, 0.9)},
}
ALIASES = {"default": "te-w8a16+quant-auto+cache-auto"}
"""Without a model family; with one, ``default`` is its ``ModelSpec.default_recipe``."""


def named_recipes() -> dict[str, Callable[[], list[RecipeStep]]]:
    """Every recipe name: one per registered recipe step kind (and its GPTQ form), and the presets."""
    names: dict[str, Callable[[], list[RecipeStep]]] = {}
    for kind, cls in RECIPE_STEPS.items():
        name = kind.replace("_", "-")
        names[name] = lambda cls=cls: [cls()]
        if issubclass(cls, WeightRounding):
            names[f"{name}-gptq"] = lambda cls=cls: [cls(weight_rounding="gptq")]
    return names | PRESETS


def resolve_recipe(recipe: str | RecipeConfig, spec=None) -> RecipeConfig:
    """A recipe from a name (``w8a8-dynamic``, ``a+b``, ``default``), a JSON/YAML file, or a config.
    ``default`` is the model family's ``ModelSpec.default_recipe`` when ``spec`` is given."""
    if isinstance(recipe, RecipeConfig):
        return recipe
    if recipe.endswith((".json", ".yaml", ".yml")):
        return _recipe_file(Path(recipe))
    known = named_recipes()
    steps: list[RecipeStep] = []
    aliases = ALIASES if spec is None else {**ALIASES, "default": spec.default_recipe}
    parts = [p for part in recipe.split("+") for p in aliases.get(part.strip(), part.strip()).split("+")]
    for name in parts:
        if name not in known:
            names = ", ".join(sorted([*known, *ALIASES]))
            raise RecipeError(f"unknown recipe {name!r}; known: {names}, or a .json/.yaml recipe file")
        steps.extend(known[name]())
    kinds = [s.kind for s in steps]
    if len(set(kinds)) != len(kinds):
        raise RecipeError(f"recipe {recipe!r} applies the same recipe step twice: {kinds}")
    quantizers = [s.kind for s in steps if s.quantizes]
    if len(quantizers) > 1 and not _then_weight_only(quantizers):
        raise RecipeError(
            f"recipe {recipe!r} names {len(quantizers)} quantization schemes ({', '.join(quantizers)}); each would "
            "take every layer: name one (a weight-only scheme may follow one that quantizes activations: it "
            "takes the family's weight-only layers, e.g. w8a8-dynamic+w8a16), use quant-auto to mix them per "
            "layer, or split layers in a recipe file with 'exclude'"
        )
    return RecipeConfig(name=recipe, steps=sorted(steps, key=lambda s: s.order))


def _then_weight_only(kinds: list[str]) -> bool:
    """Two schemes, the first quantizing activations and the second weights only: the second takes
    what the first keeps float for that reason, the family's ``weight_only_layers`` (FLUX's adaLN
    modulations), and nothing else is left to it."""
    from sdkiln.runtime.quant import by_recipe_kind

    classes = by_recipe_kind()
    if len(kinds) != 2 or not all(k in classes for k in kinds):
        return False
    return classes[kinds[0]].quantizes_activations and not classes[kinds[1]].quantizes_activations


def _no_alias_loader() -> type:
    """YAML's safe loader without aliases: a 400-byte file of nested aliases expands to gigabytes
    (a "billion laughs"), and a recipe never needs one."""
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("aliases (*name) are not allowed in a recipe")
            return super().compose_node(parent, index)

    return NoAliasLoader


def _recipe_file(path: Path) -> RecipeConfig:
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if path.suffix == ".json":
        try:
            data = parse_json(text.encode("utf-8"), str(path))
        except PackageError as exc:
            raise RecipeError(f"cannot parse recipe: {exc}") from None
    else:
        import yaml

        with third_party(str(path), "cannot parse recipe: YAML", RecipeError):
            data = yaml.load(text, Loader=_no_alias_loader())
    data = dict(data) if isinstance(data, dict) else data
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    try:
        return RecipeConfig.from_dict(data)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
