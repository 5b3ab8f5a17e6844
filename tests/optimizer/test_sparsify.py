"""The sparsity recipe steps: their configs and recipe names, the calibration record on the embedded
model, and 2:4 weight pruning."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from sdkiln.configs import Deployment, RecipeConfig, RecipeStep, Sparse24Config, SparseAttentionConfig
from sdkiln.errors import RecipeError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.optimize import optimize
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.runtime.sparse import PLAN_FILE, SparseAttentionPlan, sparse_attention_of
from sdkiln.sparsify.weights import prune_2_4


def test_configs_round_trip_and_validate():
    for config in (
        SparseAttentionConfig(budget=0.1, head_groups=2, mask_reuse=2),
        Sparse24Config(exclude=("*.ff.*",)),
    ):
        assert RecipeStep.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad, match in [
        (dict(sparsity=0.5, mass=0.9), "not both"),
        (dict(sparsity=1.0), "sparsity must be in"),
        (dict(grid=()), "grid lists"),
        (dict(head_groups=0), "head_groups"),
        (dict(block_size=0), "block_size"),
        (dict(mass=0.0), "mass must be positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            SparseAttentionConfig(**bad)


def test_recipe_names_and_the_family_default():
    assert resolve_recipe("sparse-attn").steps == [SparseAttentionConfig()]
    assert resolve_recipe("sparse-attn@0.8").steps == [SparseAttentionConfig(sparsity=0.8)]
    kinds = [s.kind for s in resolve_recipe("default", get_spec("wan-tiny")).steps]
    # ordered: the text encoders, quantize, sparsify, cache
    assert kinds == ["text_encoder_quant", "quant_auto", "sparse_attention", "cache_auto"]
    assert "sparse_attention" not in [
        s.kind for s in resolve_recipe("default", get_spec("fmnist-flux")).steps
    ]
    assert [s.kind for s in resolve_recipe("sparse-2-4+w8a8-dynamic").steps] == ["sparse_2_4", "w8a8_dynamic"]
    with pytest.raises(RecipeError, match="unknown recipe 'sparse-attn@0.75'"):
        resolve_recipe("sparse-attn@0.75")


def test_calibration_chooses_per_layer_sparsity_within_the_budget_and_records_it():
    """The embedded model at 8 steps: per-layer sparsities within the default 0.05 budget; a floor
    between what 0 and 1 dense steps give (28.99 and 29.38 dB measured) makes the search take 1."""
    config = SparseAttentionConfig(psnr_floor_db=29.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the floor is met
        made = optimize(
            None, RecipeConfig("sa", [config], Deployment(num_inference_steps=8)), None, eval_samples=0
        )
    plan = SparseAttentionPlan.from_dict(made.files[PLAN_FILE])
    record = plan.record
    assert record["mode"] == "calibrated" and record["floor_met"]
    attention = {n for n, _ in made.pipeline.transformer.named_modules() if n.endswith(".attn")}
    assert plan.layers and set(plan.layers) <= attention
    assert len({v for vs in plan.layers.values() for v in vs}) > 1  # the layers differ
    for name, errs in record["layer_rel_l1"].items():
        assert all(0.0 < e <= 0.05 for e in errs), name
    search = record["dense_step_search"]
    assert [t["dense_steps"] for t in search] == [0, 1] and plan.dense_steps == 1
    assert search[0]["psnr_mean"] < 29.2 <= search[1]["psnr_mean"]
    assert sparse_attention_of(made.pipeline.transformer) is not None  # the rest of the recipe runs sparse


def test_2_4_pruning_keeps_the_two_largest_of_every_four():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.0, -1.0, 0.0]])
    assert torch.equal(
        prune_2_4(w), torch.tensor([[0.0, -3.0, 2.0, 0.0, 0.0, 1.0, -1.0, 0.0]])
    )  # ties: earlier dropped
    made = optimize("flux-tiny", "sparse-2-4", None, eval_samples=0)
    record = made.manifest["recipe"]["steps"][0]["result"]
    assert record["layers"] and 0.0 < record["mean_weight_rel_l2"] < 1.0
    for name in record["layers"]:
        groups = made.pipeline.transformer.get_submodule(name).weight.reshape(-1, 4)
        assert bool(((groups == 0).sum(-1) >= 2).all()), name
    assert all("float layer" in why for why in record["skipped"].values())
