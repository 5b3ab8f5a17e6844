"""Qwen-Image-Edit: Qwen-Image's transformer, conditioned on a picture twice: through the text encoder
and by appending the picture's latent tokens.

``QwenImageEditPipeline`` resizes the input picture to about 1024x1024 pixels at its own aspect ratio
(``calculate_dimensions``: 1024^2 pixels, sides multiples of 32) and uses it twice. The text encoder is
the whole Qwen2.5-VL, vision tower included: the prompt template puts the picture's vision tokens
(``<|vision_start|><|image_pad|>...<|vision_end|>``, as many as the processor's patches merged 2x2) before
the prompt, the pipeline's ``processor`` (a ``Qwen2VLProcessor``) turns the picture and the templated prompt
into the encoder's inputs, and the pipeline keeps the encoder's last hidden state after the template's
system part (``prompt_template_encode_start_idx`` = 64 tokens): the text tokens are the vision tokens and
the prompt. The VAE encodes the resized picture; its packed latents are appended after the latents'
tokens (``hidden_states = cat(latents, image_latents)``), ``img_shapes`` has two entries per sample (the
output's and the picture's grids) from which the transformer's RoPE covers both, and the output is cut
back to the latents' tokens. Without height and width the output has the picture's aspect ratio at the
same area; the deployment's height and width set it.

The transformer is ``QwenImageTransformer2DModel`` at Qwen-Image's width, so the blocks, float layers,
SmoothQuant folds, attention site (text first, then every image token) and sequence-parallel plan are
Qwen-Image's (sdkiln/model_zoo/qwen_image.py): the split ``hidden_states`` and the image RoPE table carry
the picture's tokens with the latents', and the gather cuts the output back to their joint length before
the pipeline cuts it to the latents'. Qwen-Image's refusals hold here too: no token grid (``img_shapes`` is
a Python list) and no ONNX (complex RoPE tables).

Refused besides: CFG parallel. The pipeline cuts the conditional output to the latents' tokens inside its
``cache_context("cond")``, right after the call; under CFG parallel that call returns, on the second rank,
a placeholder that the unconditional call fills in later (docs/parallel.md), and cutting it first fails.

The processor pairs each prompt with a picture and refuses any other count: a call of several prompts
takes a list of pictures, one per prompt (``image_per_prompt``). The pipeline resizes a single picture
to the 1024^2 area for the processor too, and passes a list to it as given (each picture then resized
only within the processor's own pixel bounds); the VAE gets every picture at the 1024^2 area.

Variants, by transformer width (Qwen-Image's: 24 heads of 128, text width 3584, 64 packed channels):
Qwen-Image-Edit (``Qwen/Qwen-Image-Edit``), with QwenImageEditPipeline's defaults (50 steps,
``true_cfg_scale`` 4.0, the negative prompt " ") at 1024x1024, the output size of a square picture; the
zoo's tiny build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdkiln.model_zoo.qwen_image import (
    QWEN_IMAGE_ONE_STREAM,
    QWEN_IMAGE_PARALLEL,
    QWEN_IMAGE_REAL_WIDTH,
    QWEN_IMAGE_SMOOTH_FOLDS,
    TINY_SPECIALS,
    TINY_TEXT_DIM,
)
from sdkiln.model_zoo.qwen_image import SPEC as QWEN_IMAGE_SPEC
from sdkiln.model_zoo.spec import ModelSpec, Variant

if TYPE_CHECKING:
    from diffusers import QwenImageEditPipeline

_SEED = 0

EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""QwenImageEditPipeline's ``prompt_template_encode``: the tiny tokenizer spells its system part in
``prompt_template_encode_start_idx`` (64) tokens, as the real Qwen2 tokenizer does."""
_VISION_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The tiny processor's chat template: Qwen2.5-VL's form for text messages. The pipeline formats its own
template and never applies it; it is there because the published processor has one, which a package
keeps in JSON (``chat_template.json``)."""
_VL_MAX_PIXELS = 28 * 28 * 20
"""The tiny image processor's largest picture: a square one becomes 112x112 pixels, 8x8 patches of 14,
16 vision tokens after the 2x2 merge."""


def tiny() -> QwenImageEditPipeline:
    """A real ``QwenImageEditPipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer and scheduler: Qwen-Image's test build's (``qwen_image.tiny_transformer``, same weights,
    and ``tiny_scheduler``). The text encoder is a 2-layer Qwen2.5-VL of width 32 whose 2-block vision
    tower (width 16) runs on the picture; its tokenizer spells :data:`EDIT_TEMPLATE`, with the vision
    tokens after Qwen-Image's three specials.
    The processor (``model_zoo.qwen_vl_processor``: Qwen2VLProcessor without the video processor that
    needs torchvision) makes at most 112x112-pixel pictures, 16 vision tokens. The VAE has Qwen-Image's
    16 latent channels but 32x spatial compression (five 2x downsamples at base width 4, no residual
    block in the encoder): the pipeline VAE-encodes every picture at 1024x1024, which is 32x32 latents,
    16x16 = 256 packed tokens, in about 0.3 s on one CPU thread (an 8x VAE would make 4096 tokens and
    take seconds). A 256x256 output is 4x4 = 16 tokens; the output size is a multiple of 64.

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from sdkiln.model_zoo.qwen_image import (
        qwen2_5_vl_text_encoder,
        qwen2_tokenizer,
        tiny_scheduler,
        tiny_transformer,
    )
    from sdkiln.model_zoo.qwen_vl_processor import Qwen2VLImageTextProcessor

    tokenizer = qwen2_tokenizer(EDIT_TEMPLATE, (*TINY_SPECIALS, *_VISION_SPECIALS))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _VISION_SPECIALS}
    processor = Qwen2VLImageTextProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            size={"shortest_edge": 56 * 56, "longest_edge": _VL_MAX_PIXELS}
        ),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = tiny_transformer()
        vae = AutoencoderKLQwenImage(
            base_dim=4,
            z_dim=16,
            dim_mult=[1] * 6,
            num_res_blocks=0,
            temperal_downsample=[False] * 5,
        ).eval()
        # as in Qwen-Image's test build: a 4x output convolution spreads the decoder's grey images
        with torch.no_grad():
            vae.decoder.conv_out.weight.mul_(4.0)
            vae.decoder.conv_out.bias.mul_(4.0)
        text_encoder = qwen2_5_vl_text_encoder(
            TINY_TEXT_DIM,
            16 * -(-len(tokenizer) // 16),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    return QwenImageEditPipeline(
        scheduler=tiny_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )


EDIT_VARIANTS = (
    Variant(
        "Qwen-Image-Edit",
        "Qwen/Qwen-Image-Edit, Qwen-Image's 20B MMDiT conditioned on a picture, 1024x1024",
        match={**QWEN_IMAGE_REAL_WIDTH, **QWEN_IMAGE_ONE_STREAM},
        # QwenImageEditPipeline.__call__'s defaults and the model card's example: 50 steps, true_cfg_scale
        # 4.0, negative prompt " "; the output of a square picture is 1024x1024 (calculate_dimensions). No
        # max_sequence_length: the pipeline only checks it (at most 1024) and never cuts the text
        call_defaults={
            "num_inference_steps": 50,
            "true_cfg_scale": 4.0,
            "negative_prompt": " ",
            "height": 1024,
            "width": 1024,
            "output_type": "np",
        },
        guidance_arg="true_cfg_scale",
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): Qwen-Image's test transformer, a 32x VAE",
        match=next(v.match for v in QWEN_IMAGE_SPEC.variants if v.name == "tiny"),
        call_defaults={
            "num_inference_steps": 4,
            "true_cfg_scale": 4.0,
            "negative_prompt": " ",
            "height": 256,
            "width": 256,
            "output_type": "np",
        },
        guidance_arg="true_cfg_scale",
        size_multiple=64,
    ),
)

SPEC = ModelSpec(
    name="qwen-image-edit-tiny",
    family="qwen-image-edit",
    description="Qwen-Image-Edit (Qwen-Image with a picture through Qwen2.5-VL and appended latent tokens) at test size",
    pipeline_class="diffusers:QwenImageEditPipeline",
    cfg_calls=QWEN_IMAGE_SPEC.cfg_calls,
    transformer_attr="transformer",
    block_lists=QWEN_IMAGE_SPEC.block_lists,
    float_layers=(),
    weight_only_layers=QWEN_IMAGE_SPEC.weight_only_layers,
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=tiny,
    size_multiple=16,  # the published VAE's 8x and the 2x2 packing
    max_text_tokens=1024,  # QwenImageEditPipeline.check_inputs refuses more
    eval_prompts=("make the sky purple", "add a hat to the figure", "turn it into a watercolor"),
    calibration_prompts=("make it night", "replace the background with a forest", "add snow"),
    smooth_folds=QWEN_IMAGE_SMOOTH_FOLDS,
    attention=QWEN_IMAGE_SPEC.attention,
    parallel_plan=QWEN_IMAGE_PARALLEL,
    image_arg="image",
    image_required=True,
    image_per_prompt=True,
    refusals={
        **QWEN_IMAGE_SPEC.refusals,
        "cfg-parallel": "QwenImageEditPipeline cuts the picture's tokens off the conditional output right after "
        "its call, before the unconditional call at which CFG parallel fills that output in (docs/parallel.md)",
    },
    variants=EDIT_VARIANTS,
).resolve("tiny")
