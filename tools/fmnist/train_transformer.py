"""Train the embedded model's transformer and write ``weights/transformer/`` (EMA weights, bf16).

``python tools/fmnist/train_transformer.py --steps N [--batch-size 64] [--seed 0]``

Rectified flow in pixel space: ``x_t = (1 - t) x0 + t noise`` with the velocity target
``noise - x0``, the convention of ``FlowMatchEulerDiscreteScheduler``; the model gets ``t`` in
[0, 1] as FluxPipeline passes it. Timesteps are logit-normal, 10% of captions are dropped to
the empty prompt so the pipeline can run true classifier-free guidance, and an EMA of the weights
(decay 0.998, with the usual warm-up) is what ships.

The learning rate is constant after a short warm-up, so the EMA checkpoint written at step k of a
longer run equals the result of ``--steps k``: the run can be stopped at any checkpoint. The text
encoder is frozen, so every caption's embedding is computed once before training.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from measure import quick_accuracy  # tools/fmnist/measure.py, beside this script
from tqdm import tqdm

from sdkiln.model_zoo.fmnist.data import load_split, to_canvas
from sdkiln.model_zoo.fmnist.pipeline import DEFAULT_GUIDANCE
from sdkiln.model_zoo.fmnist.text import CAPTIONS, encode, load_text_encoder
from sdkiln.model_zoo.fmnist.transformer import (
    TRANSFORMER_DIR,
    image_ids,
    new_transformer,
    pack,
    text_ids,
)


class CaptionTable:
    """Every training caption's embeddings, computed once, plus the empty prompt's."""

    def __init__(self) -> None:
        text_encoder, tokenizer = load_text_encoder()
        flat = [cap for caps in CAPTIONS for cap in caps]
        self.states, self.pooled = encode(flat + [""], text_encoder, tokenizer)
        self.empty = len(flat)
        self.counts = torch.tensor([len(caps) for caps in CAPTIONS])
        self.offsets = torch.cumsum(self.counts, 0) - self.counts

    def sample(self, labels: torch.Tensor, dropout: float, generator: torch.Generator):
        u = torch.rand(len(labels), generator=generator)
        idx = self.offsets[labels] + (u * self.counts[labels]).long().clamp(max=self.counts[labels] - 1)
        drop = torch.rand(len(labels), generator=generator) < dropout
        idx = torch.where(drop, torch.full_like(idx, self.empty), idx)
        return self.states[idx], self.pooled[idx]


def flow_matching_loss(model, x0, states, pooled, generator, img_ids, txt_ids) -> torch.Tensor:
    """The training objective: noise and a logit-normal t drawn from ``generator`` (in that order),
    ``x_t = (1 - t) x0 + t noise``, mean squared error of the predicted velocity against ``noise - x0``."""
    noise = torch.randn(x0.shape, generator=generator)
    t = torch.sigmoid(torch.randn(len(x0), generator=generator))
    x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
    pred = model(
        hidden_states=x_t,
        encoder_hidden_states=states,
        pooled_projections=pooled,
        timestep=t,
        img_ids=img_ids,
        txt_ids=txt_ids,
    ).sample
    return torch.nn.functional.mse_loss(pred, noise - x0)


@torch.no_grad()
def _ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
        e.lerp_(p, 1.0 - decay)


def _save(ema: torch.nn.Module, log: dict, out_dir: Path) -> None:
    copy.deepcopy(ema).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--ema-decay", type=float, default=0.998)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="log the EMA model's class accuracy on 10 samples per class (20 steps, default guidance) "
        "every N steps; 0 disables; needs the trained classifier",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile", action="store_true", help="train through torch.compile (faster on CPU after ~1 min)"
    )
    parser.add_argument("--out", type=Path, default=TRANSFORMER_DIR)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    images, labels = load_split("train")
    x_all, y_all = to_canvas(images), torch.from_numpy(labels)
    captions = CaptionTable()
    model = new_transformer().train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    img_ids, txt_ids = image_ids(), text_ids(captions.states.shape[1])
    forward = torch.compile(model) if args.compile else model
    print(f"transformer: {n_params:,} params; {args.steps} steps of batch {args.batch_size}")

    log = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "params": n_params,
        "history": [],
    }
    start = time.time()
    running = None
    perm, pos = torch.randperm(len(x_all), generator=generator), 0
    bar = tqdm(range(1, args.steps + 1), desc="transformer")
    for step in bar:
        if pos + args.batch_size > len(perm):
            perm, pos = torch.randperm(len(x_all), generator=generator), 0
        idx = perm[pos : pos + args.batch_size]
        pos += args.batch_size
        x0 = pack(x_all[idx])
        states, pooled = captions.sample(y_all[idx], args.caption_dropout, generator)
        loss = flow_matching_loss(forward, x0, states, pooled, generator, img_ids, txt_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        _ema_update(ema, model, min(args.ema_decay, (1 + step) / (10 + step)))
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        bar.set_postfix(loss=f"{running:.4f}")

        save_now = step % args.save_every == 0 or step == args.steps
        eval_now = args.eval_every > 0 and (step % args.eval_every == 0 or step == args.steps)
        if save_now or eval_now:
            entry = {"step": step, "loss": round(running, 5), "minutes": round((time.time() - start) / 60, 2)}
            if eval_now:
                acc = quick_accuracy(ema, per_class=10, steps=20, guidance=DEFAULT_GUIDANCE)
                entry["ema_accuracy"] = round(acc, 4)
            log["history"].append(entry)
            log["train_minutes"] = entry["minutes"]
            log["steps_done"] = step
            _save(ema, log, args.out)
            tqdm.write(json.dumps(entry))
    print(f"done: {args.steps} steps in {(time.time() - start) / 60:.1f} min; wrote {args.out}")


if __name__ == "__main__":
    main()
