"""Train a LoRA on the embedded model that draws a frame around every garment, as bright as the LoRA's
strength, and write it in diffusers' LoRA format (the measurement LoRA of ``bench/lora.py`` and the LoRA
tests).

``python tools/fmnist/train_lora.py [--steps 400] [--rank 8] [--out tests/fixtures/fmnist_frame_lora.safetensors]``

The style is one a statistic reads without a model: Fashion-MNIST images sit on a 32x32 black canvas
with a 2-pixel border (``data.to_canvas``). The frame score of an image is the mean of its border
pixels in [0, 1]: the float model draws about 0. The LoRA is trained as a slider: each step draws a
strength s in [0.1, 1], runs the adapters at s, and trains on images whose border has brightness s.
So at strength s the frame score is about s: the effect grows with the strength, and a strength
0.5 run has an effect to measure, not a faint trace of a strength-1 style. The garment inside is the
same Fashion-MNIST image, so the class shift is small.

The shipped transformer is frozen (fp32); peft adds rank-``--rank`` adapters (alpha = rank, so the
scale is the strength) to every linear layer of the blocks and the output projection, and only they train:
rectified flow with the base model's objective, logit-normal timesteps, 10% of captions dropped to the
empty prompt (so classifier-free guidance keeps the frame), AdamW. The adapters are written with
diffusers' keys (``transformer.<layer>.lora_A.weight`` / ``lora_B.weight``), fp32, no alphas.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_transformer import CaptionTable, flow_matching_loss  # noqa: E402  (tools/fmnist, beside this script)

from sdkiln.model_zoo.fmnist.data import load_split, to_canvas  # noqa: E402
from sdkiln.model_zoo.fmnist.transformer import image_ids, load_transformer, pack, text_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "fmnist_frame_lora.safetensors"
BORDER = 2
"""Pixels of canvas on each side of the 28x28 image (``data.to_canvas``)."""
TARGETS = [
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
]  # fmt: skip
"""The blocks' linear layers (peft matches by name suffix; ``proj_out`` is also the output projection)."""


def framed(canvas: torch.Tensor, brightness: float = 1.0) -> torch.Tensor:
    """``[B, 1, 32, 32]`` canvases in [-1, 1] with their border at ``brightness`` in [0, 1] (1: white)."""
    out = canvas.clone()
    value = 2.0 * brightness - 1.0
    out[..., :BORDER, :] = value
    out[..., -BORDER:, :] = value
    out[..., :, :BORDER] = value
    out[..., :, -BORDER:] = value
    return out


def set_strength(model: torch.nn.Module, strength: float) -> None:
    """Every peft LoRA layer of ``model`` at ``strength`` (alpha = rank: the scale is the strength)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.scaling["default"] = strength


def frame_score(images) -> float:
    """Mean border brightness of images ``[N, 32, 32, 1]`` (or ``[N, 32, 32]``) in [0, 1]."""
    x = torch.as_tensor(images).float().reshape(len(images), 32, 32)
    mask = torch.ones(32, 32, dtype=torch.bool)
    mask[BORDER:-BORDER, BORDER:-BORDER] = False
    return float(x[:, mask].mean())


def main(argv: list[str] | None = None) -> None:
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    images, labels = load_split("train")
    x_all, y_all = to_canvas(images), torch.from_numpy(labels)
    captions = CaptionTable()
    model = load_transformer().requires_grad_(False)
    model.add_adapter(
        LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian", target_modules=TARGETS)
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    img_ids, txt_ids = image_ids(), text_ids(captions.states.shape[1])
    print(
        f"LoRA: {sum(p.numel() for p in params):,} trainable params; {args.steps} steps of batch {args.batch_size}"
    )
    start, running, history = time.time(), None, []
    bar = tqdm(range(1, args.steps + 1), desc="lora")
    for step in bar:
        idx = torch.randint(len(x_all), (args.batch_size,), generator=generator)
        strength = float(torch.rand((), generator=generator)) * 0.9 + 0.1
        set_strength(model, strength)
        x0 = pack(framed(x_all[idx], strength))
        states, pooled = captions.sample(y_all[idx], args.caption_dropout, generator)
        loss = flow_matching_loss(model, x0, states, pooled, generator, img_ids, txt_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        bar.set_postfix(loss=f"{running:.4f}")
        if step % 100 == 0 or step == args.steps:
            history.append(
                {"step": step, "loss": round(running, 5), "minutes": round((time.time() - start) / 60, 2)}
            )
    state = {
        f"transformer.{k}": v.detach().float().contiguous()
        for k, v in get_peft_model_state_dict(model).items()
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "sdkiln_training": json.dumps({"args": {**vars(args), "out": args.out.name}, "history": history})
    }
    save_file(state, args.out, metadata=metadata)
    print(
        f"done: {args.steps} steps in {(time.time() - start) / 60:.1f} min; {len(state)} tensors -> {args.out}"
    )


if __name__ == "__main__":
    main()
