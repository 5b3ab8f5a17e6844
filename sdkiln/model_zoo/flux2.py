"""FLUX.2: 8 double-stream (MMDiT) blocks then 48 single-stream "parallel" blocks, a Mistral-3 text encoder.

Unlike FLUX.1, a FLUX.2 block holds no modulation Linear: the transformer computes three shared
modulations from the timestep/guidance embedding once per call, outside the blocks
(``double_stream_modulation_img``, ``double_stream_modulation_txt``, ``single_stream_modulation``),
and passes their outputs to every block of a kind. Only Linear layers inside ``block_lists`` are
quantized, so those three, ``x_embedder``, ``context_embedder``, ``time_guidance_embed``,
``norm_out`` and ``proj_out`` stay float without being listed, and there is nothing weight-only
inside a block. For the same reason SmoothQuant has no exact fold here: its factor would have to be
folded into a modulation Linear that all blocks of a kind share, while each block's Linears want a
factor of their own; every smoothed layer keeps an input multiplier.

A double block (``Flux2TransformerBlock``) is called with ``hidden_states`` (image) and
``encoder_hidden_states`` (text) and returns ``(encoder_hidden_states, hidden_states)``; its
``Flux2AttnProcessor`` attends over the joint sequence, text tokens first. Before the single blocks
the transformer concatenates the two streams itself, ``[text, image]``: a single block
(``Flux2SingleTransformerBlock``) is called with that joint ``hidden_states`` (and
``encoder_hidden_states=None``) and returns it, and its ``Flux2ParallelSelfAttnProcessor`` runs one
fused QKV + MLP-in projection, attention over the joint sequence (text first) and one fused output
projection. The transformer cuts the text off after the last single block. Position ids have four
axes (t, h, w, l): image tokens ``(0, row, column, 0)``, text tokens ``(0, 0, 0, index)``; the first
three are the (frame, row, column) block-sparse attention tiles by.

The pipeline is guidance-distilled: ``guidance_scale`` is an input of the transformer, one pass per
step, no negative prompt (so there is no CFG parallelism: ``refusals``). Its text embedding stacks the hidden states of Mistral layers 10, 20 and
30 (``text_encoder_out_layers``), so the joint attention width is three times the encoder's. The
prompt goes through the tokenizer's chat template with the pipeline's system message first. The
pipeline's first positional argument is ``image`` (reference images for editing): call it with
``prompt=``. Its packed latents ``(B, tokens, 4 * C)`` reach ``callback_on_step_end`` as
``"latents"``.

Variants, by transformer width:

* FLUX.2-dev (black-forest-labs/FLUX.2-dev): 48 heads of 128, text width 15360 (3 x Mistral-Small
  5120), 128 latent channels, guidance embedding. Defaults are Flux2Pipeline's own: 50 steps,
  guidance 4.0, 1024x1024 (``default_sample_size`` 128 x the VAE's 8), 512 text tokens.
* The tiny build below (4 heads of 32, text width 48).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import (
    AttentionSite,
    BlockList,
    ModelSpec,
    ParallelPlan,
    SequenceGather,
    SequenceSplit,
    TokenGrid,
    Variant,
)

if TYPE_CHECKING:
    from diffusers import Flux2Pipeline
    from transformers import Mistral3ForConditionalGeneration, TokenizersBackend

_SEED = 0
_MISTRAL_WIDTH = 16
_MISTRAL_LAYERS = 30
"""Flux2Pipeline reads hidden states 10, 20 and 30 of its text encoder by default: 30 layers at least."""
_TEXT_DIM = 3 * _MISTRAL_WIDTH
_MAX_TEXT_TOKENS = 32

# Mistral's control tokens (the Tekken vocabulary's names), then the 256 byte symbols. [IMG] and
# friends are what the pipeline strips from prompts and a Pixtral processor would look up.
_SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
_IMAGE_TOKEN = _SPECIALS.index("[IMG]")

# Mistral-Small's layout of a conversation: system prompt, then instruction turns. Message contents
# come as lists of typed blocks (Flux2Pipeline's format_input); only the text blocks are rendered.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def mistral_tokenizer() -> TokenizersBackend:
    """A byte-level BPE in Mistral's special-token layout with the chat template Flux2Pipeline applies.

    No merges: every byte is a token, except the pipeline's system message, which is one added token.
    The message comes before every prompt, and at byte level it alone (about 250 bytes) would fill a
    test-sized ``max_sequence_length``, truncating every prompt away. The published model uses a
    ``PixtralProcessor``, which needs torchvision to exist; the pipeline only calls
    ``apply_chat_template`` on it, which the tokenizer has itself, so the tiny build uses the tokenizer.
    """
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import TokenizersBackend

    symbols = (*_SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet()))
    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    backend.add_tokens([AddedToken(SYSTEM_MESSAGE, special=False, normalized=False)])
    return TokenizersBackend(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )


def mistral3_text_encoder(vocab_size: int) -> Mistral3ForConditionalGeneration:
    """A ``Mistral3ForConditionalGeneration`` (Mistral text model + Pixtral vision tower) at test
    width: 30 text layers of width 16, a one-layer vision tower the text-to-image path never runs."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": vocab_size,
            "hidden_size": _MISTRAL_WIDTH,
            "intermediate_size": 2 * _MISTRAL_WIDTH,
            "num_hidden_layers": _MISTRAL_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": _MISTRAL_WIDTH // 2,
            "max_position_embeddings": 512,
            "sliding_window": None,
            "bos_token_id": _SPECIALS.index("<s>"),
            "eos_token_id": _SPECIALS.index("</s>"),
            "pad_token_id": _SPECIALS.index("<pad>"),
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "image_size": 32,
            "patch_size": 16,
        },
        image_token_index=_IMAGE_TOKEN,
        spatial_merge_size=1,
        multimodal_projector_bias=False,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def tiny() -> Flux2Pipeline:
    """A real ``Flux2Pipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer: 3 double + 2 single blocks, width 128 (4 heads of 32, RoPE 8 per axis), MLP ratio 3,
    so every block Linear has in/out features that are multiples of 16. Three double blocks, not two,
    because of how ``save_pretrained`` lays the weights out: with two, every tensor of the
    transformer's safetensors file sits 8 bytes off a 16-byte boundary, from_pretrained maps them there,
    and the CPU matrix-vector product of the batch-1 timestep embedding sums in another order on
    such weights, so a reloaded copy differs from the built one in the last bits; with three they
    sit on 16-byte boundaries and the round trip is exact. The VAE has one 2x downsample
    and 16 latent channels, patchified 2x2 into the transformer's 64: a 32x32 image is 8x8 = 64 image
    tokens. The text encoder is :func:`mistral3_text_encoder` with :func:`mistral_tokenizer`.

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )

    tokenizer = mistral_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=3,
            num_single_layers=2,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=_TEXT_DIM,
            axes_dims_rope=(8, 8, 8, 8),
            guidance_embeds=True,
        ).eval()
        vae = AutoencoderKLFlux2(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(16, 16),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=8,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).eval()
        text_encoder = mistral3_text_encoder(len(tokenizer))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


# Both block kinds attend over one joint sequence, text tokens first: the double block's processor
# concatenates the projected text and image streams, the single blocks get the streams concatenated
# by the transformer.
FLUX2_ATTENTION = (
    AttentionSite("transformer_blocks.*.attn", "Flux2AttnProcessor", "dispatch", "first", "first"),
    AttentionSite(
        "single_transformer_blocks.*.attn", "Flux2ParallelSelfAttnProcessor", "dispatch", "first", "first"
    ),
)

# Sequence parallelism with the text replicated: diffusers' Flux2Transformer2DModel._cp_plan without
# its encoder_hidden_states and txt_ids splits. Every rank embeds the whole text and its shard of the
# image tokens and their ids ([B, S, 4] from the pipeline, unlike FLUX.1's [S, 3]): the RoPE of the
# joint sequence is computed from the ids. proj_out reads the image stream only; its output is gathered.
FLUX2_PARALLEL = ParallelPlan(
    splits=(SequenceSplit("", "hidden_states", 1, 3), SequenceSplit("", "img_ids", 1, 3)),
    gathers=(SequenceGather("proj_out", 1, 3),),
)

FLUX2_VARIANTS = (
    Variant(
        "FLUX.2-dev",
        "guidance-distilled FLUX.2 (black-forest-labs/FLUX.2-dev)",
        match={
            "in_channels": 128,
            "num_attention_heads": 48,
            "attention_head_dim": 128,
            "joint_attention_dim": 15360,
            "guidance_embeds": True,
        },
        call_defaults={
            "num_inference_steps": 50,
            "guidance_scale": 4.0,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 512,
            "output_type": "np",
        },
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 4 heads of 32, text width 48",
        match={
            "in_channels": 64,
            "num_attention_heads": 4,
            "attention_head_dim": 32,
            "joint_attention_dim": _TEXT_DIM,
            "guidance_embeds": True,
        },
        call_defaults={
            "num_inference_steps": 4,
            "guidance_scale": 4.0,
            "height": 32,
            "width": 32,
            "max_sequence_length": _MAX_TEXT_TOKENS,
            "output_type": "np",
        },
        sparse_block_size=16,
    ),
)

SPEC = ModelSpec(
    name="flux2-tiny",
    family="flux2",
    description="FLUX.2 architecture (double + parallel single stream MMDiT, Mistral-3 text) at test size",
    pipeline_class="diffusers:Flux2Pipeline",
    transformer_attr="transformer",
    block_lists=(
        BlockList(
            "transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("encoder_hidden_states", "hidden_states"),
        ),
        BlockList("single_transformer_blocks", inputs=("hidden_states",), outputs=("hidden_states",)),
    ),
    float_layers=(),
    # no cache-auto (refusals): FLUX.2 joins the two streams between its block lists
    default_recipe="te-w8a16+quant-auto",
    build=tiny,
    eval_prompts=("a photo of a cat", "a red car on a mountain road", "a bowl of fruit, oil painting"),
    calibration_prompts=("a photo of a dog", "a city skyline at night", "a watercolor of a lighthouse"),
    attention=FLUX2_ATTENTION,
    parallel_plan=FLUX2_PARALLEL,
    token_grid=TokenGrid("img_ids", "ids"),
    variants=FLUX2_VARIANTS,
    refusals={
        "cfg-parallel": "Flux2Pipeline's guidance is distilled: one transformer call per step with a batch of "
        "one, so there is no unconditional branch to run on a second rank",
        "cache": "the double blocks take and return the text and image streams and the single blocks one "
        "joined stream, so no residual spans the whole stack or its middle (skip, partial:1:1); caching the "
        "single blocks alone (partial:3:0, measured 69 dB on the test build) needs the search to offer it",
    },
).resolve("tiny")
