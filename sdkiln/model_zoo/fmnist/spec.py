"""ModelSpec of the embedded model, ``fmnist-flux``: sdkiln's default demo and quality testbed."""

from __future__ import annotations

from sdkiln.model_zoo.flux import FLUX_ATTENTION, FLUX_GRID, FLUX_PARALLEL
from sdkiln.model_zoo.fmnist.data import CLASS_NAMES
from sdkiln.model_zoo.fmnist.metrics import fmnist_metrics
from sdkiln.model_zoo.fmnist.pipeline import DEFAULT_GUIDANCE, FmnistFluxPipeline
from sdkiln.model_zoo.fmnist.text import CAPTIONS, eval_prompt
from sdkiln.model_zoo.fmnist.transformer import TRANSFORMER_CONFIG
from sdkiln.model_zoo.spec import BlockList, ModelSpec, Variant

# FLUX blocks take (hidden_states, encoder_hidden_states) and return them in the other order;
# diffusers' FluxSingleTransformerBlock keeps the two streams apart at its interface too.
_STREAMS_IN = ("hidden_states", "encoder_hidden_states")
_STREAMS_OUT = ("encoder_hidden_states", "hidden_states")


def build() -> FmnistFluxPipeline:
    """The shipped embedded model, float32 on CPU (weights are stored in bf16)."""
    return FmnistFluxPipeline.from_shipped()


EMBEDDED = Variant(
    "embedded",
    "the shipped weights: 4 heads of 32 over 2x2-packed pixels, MiniLM text width 384",
    match={
        key: TRANSFORMER_CONFIG[key]
        for key in (
            "in_channels",
            "num_attention_heads",
            "attention_head_dim",
            "joint_attention_dim",
            "pooled_projection_dim",
            "guidance_embeds",
        )
    },
    call_defaults={"num_inference_steps": 28, "guidance_scale": DEFAULT_GUIDANCE, "output_type": "np"},
    # 256 image tokens (16x16): 4x4 tiles give 16 image blocks to choose among
    sparse_block_size=16,
)

SPEC = ModelSpec(
    name="fmnist-flux",
    family="fmnist-flux",
    description="Embedded text-to-image model: a 2.4M-parameter FLUX transformer trained on Fashion-MNIST "
    "(32x32 pixels) with an all-MiniLM-L6-v2 text encoder",
    pipeline_class="sdkiln.model_zoo.fmnist.pipeline:FmnistFluxPipeline",
    cfg_calls=("guidance_scale",),
    transformer_attr="transformer",
    block_lists=(
        BlockList("transformer_blocks", _STREAMS_IN, _STREAMS_OUT),
        BlockList("single_transformer_blocks", _STREAMS_IN, _STREAMS_OUT),
    ),
    float_layers=(),
    weight_only_layers=(
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear",
    ),
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=build,
    eval_prompts=tuple(eval_prompt(c) for c in range(len(CLASS_NAMES))),
    calibration_prompts=tuple(cap for caps in CAPTIONS for cap in caps[1:]),
    metrics=fmnist_metrics,
    attention=FLUX_ATTENTION,
    parallel_plan=FLUX_PARALLEL,
    token_grid=FLUX_GRID,
    variants=(EMBEDDED,),
).resolve("embedded")
