"""``FmnistFluxPipeline``: text-to-image for the embedded model, FLUX-style, in pixel space.

Components: ``transformer`` (a small ``FluxTransformer2DModel``), ``text_encoder`` (``BertModel``,
all-MiniLM-L6-v2), ``tokenizer`` (``BertTokenizerFast``) and ``scheduler``
(``FlowMatchEulerDiscreteScheduler``). The sampling loop is FluxPipeline's with true
classifier-free guidance: the conditional and unconditional branches go through the transformer
as two calls, each in its own cache context (``"cond"``, ``"uncond"``), like diffusers' FLUX. Images are the 32x32 canvas the model is trained on (the 28x28 Fashion-MNIST image
centred on a black border); the metric classifier accepts the canvas as returned.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import PIL.Image
import torch
from diffusers import (
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    ImagePipelineOutput,
)
from diffusers.utils.torch_utils import randn_tensor
from transformers import BertModel, BertTokenizerFast

from sdkiln.model_zoo.fmnist.text import encode, load_text_encoder
from sdkiln.model_zoo.fmnist.transformer import (
    NUM_TOKENS,
    PACKED_CHANNELS,
    image_ids,
    load_transformer,
    text_ids,
    unpack,
)

DEFAULT_GUIDANCE = 4.0
SCHEDULER_SHIFT = 1.5
"""Timestep shift for 256 tokens. FLUX's resolution-dependent shift is exp(mu) with mu = 0.5 at
256 tokens (about 1.65); 1.5 spends slightly more of the steps near clean images, where the
32x32 canvas's fine structure forms."""


def new_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=SCHEDULER_SHIFT, use_dynamic_shifting=False
    )


class FmnistFluxPipeline(DiffusionPipeline):
    model_cpu_offload_seq = "text_encoder->transformer"
    _callback_tensor_inputs = ["latents"]

    def __init__(
        self,
        transformer: FluxTransformer2DModel,
        text_encoder: BertModel,
        tokenizer: BertTokenizerFast,
        scheduler: FlowMatchEulerDiscreteScheduler,
    ):
        super().__init__()
        self.register_modules(
            transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
        )

    @classmethod
    def from_shipped(cls, dtype: torch.dtype = torch.float32) -> FmnistFluxPipeline:
        """The embedded model from the files installed with sdkiln (no network, no hub)."""
        text_encoder, tokenizer = load_text_encoder()
        return cls(load_transformer(dtype=dtype), text_encoder, tokenizer, new_scheduler())

    @property
    def _execution_device(self) -> torch.device:
        return self.transformer.device

    def encode_prompt(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        states, pooled = encode(prompts, self.text_encoder, self.tokenizer)
        dtype, device = self.transformer.dtype, self._execution_device
        return states.to(device=device, dtype=dtype), pooled.to(device=device, dtype=dtype)

    def prepare_latents(
        self,
        batch: int,
        generator: torch.Generator | list[torch.Generator] | None,
        latents: torch.Tensor | None,
    ) -> torch.Tensor:
        shape = (batch, NUM_TOKENS, PACKED_CHANNELS)
        if latents is None:
            # Drawn on CPU in float32 so a seed gives the same image on every device and dtype.
            latents = randn_tensor(
                shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32
            )
        elif tuple(latents.shape) != shape:
            raise ValueError(f"latents must have shape {shape} (packed 2x2), got {tuple(latents.shape)}")
        return latents.to(device=self._execution_device, dtype=self.transformer.dtype)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        num_inference_steps: int = 28,
        guidance_scale: float = DEFAULT_GUIDANCE,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable[[DiffusionPipeline, int, torch.Tensor, dict], dict] | None = None,
        callback_on_step_end_tensor_inputs: tuple[str, ...] = ("latents",),
    ):
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        unknown = set(callback_on_step_end_tensor_inputs) - set(self._callback_tensor_inputs)
        if unknown:
            raise ValueError(
                f"callback tensor inputs {sorted(unknown)} not in {self._callback_tensor_inputs}"
            )
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = (
            [negative_prompt or ""] * len(prompts)
            if not isinstance(negative_prompt, list)
            else negative_prompt
        )
        if len(negatives) != len(prompts):
            raise ValueError(f"{len(negatives)} negative prompts for {len(prompts)} prompts")
        prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        negatives = [n for n in negatives for _ in range(num_images_per_prompt)]
        batch = len(prompts)
        if isinstance(generator, list) and len(generator) != batch:
            raise ValueError(f"{len(generator)} generators for {batch} images")

        do_cfg = guidance_scale > 1.0
        states, pooled = self.encode_prompt(prompts + negatives if do_cfg else prompts)
        device = self._execution_device
        img_ids = image_ids(device, self.transformer.dtype)
        txt_ids = text_ids(states.shape[1], device, self.transformer.dtype)
        latents = self.prepare_latents(batch, generator, latents)

        sigmas = np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)
        self.scheduler.set_timesteps(sigmas=sigmas, device=device)
        self.scheduler.set_begin_index(0)
        timesteps = self.scheduler.timesteps
        self._num_timesteps = len(timesteps)

        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                timestep = (t / 1000).expand(batch).to(latents.dtype)
                branches = [("cond", slice(0, batch))]
                if do_cfg:
                    branches.append(("uncond", slice(batch, 2 * batch)))
                predictions = []
                for name, rows in branches:
                    # one call per branch in its own cache context, as diffusers' FLUX and Wan
                    # pipelines call theirs: the cache hooks (diffusers' and sdkiln's) keep one state
                    # per branch, and CFG parallel gives each branch to one rank with the very
                    # shapes this single-device loop uses
                    with self.transformer.cache_context(
                        name, step_index=i, num_inference_steps=len(timesteps)
                    ):
                        predictions.append(
                            self.transformer(
                                hidden_states=latents,
                                timestep=timestep,
                                pooled_projections=pooled[rows],
                                encoder_hidden_states=states[rows],
                                txt_ids=txt_ids,
                                img_ids=img_ids,
                                return_dict=False,
                            )[0]
                        )
                noise_pred = predictions[0]
                if do_cfg:
                    noise_pred = predictions[1] + guidance_scale * (predictions[0] - predictions[1])
                latents = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]

                if callback_on_step_end is not None:
                    tensors = {"latents": latents}
                    callback_kwargs = {k: tensors[k] for k in callback_on_step_end_tensor_inputs}
                    callback_outputs = callback_on_step_end(self, i, t, callback_kwargs)
                    latents = callback_outputs.pop("latents", latents)
                progress_bar.update()

        if output_type == "latent":
            images = latents
        else:
            pixels = (unpack(latents.float()) * 0.5 + 0.5).clamp(0.0, 1.0).cpu()
            if output_type == "pt":
                images = pixels
            else:
                images = pixels.permute(0, 2, 3, 1).numpy()
                if output_type == "pil":
                    images = [
                        PIL.Image.fromarray((im[..., 0] * 255).round().astype(np.uint8)) for im in images
                    ]
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)
