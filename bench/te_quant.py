"""Text-encoder quantization on the embedded model: the MiniLM encoder's Linears in each weight or
weight-and-activation scheme, the transformer in float, against the float pipeline.

For each scheme: the encoder's output SQNR (both outputs the pipeline reads, the token states, all 16
positions and split into the prompt's tokens and the padding, and the pooled embedding, over the eval
prompts), and the final images' PSNR, class accuracy and FD-FMNIST
over the same samples and seeds as the float pipeline; and the SQNR the text-encoder recipe step's
gate reads (the lowest over the transformer's inputs the encoder reaches, on the calibration prompts
it runs to the transformer) with the decision the family's floor makes of it. The encoder is quantized as that step does it
(``sdkiln.optimizer.quant.encoders``: round to nearest, the schemes' default parameters).

    OMP_NUM_THREADS=2 python bench/te_quant.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

from sdkiln.configs import (  # noqa: E402
    FP8DynamicConfig,
    TextEncoderQuantConfig,
    W4A16Config,
    W8A8DynamicConfig,
    W8A16Config,
)
from sdkiln.metrics import ratio_db  # noqa: E402
from sdkiln.model_zoo import get_spec  # noqa: E402
from sdkiln.model_zoo.fmnist.text import encode  # noqa: E402
from sdkiln.optimizer.evaluate import generate, sample_plan  # noqa: E402
from sdkiln.optimizer.quant.encoders import (  # noqa: E402
    _swap,
    _trial,
    applicable,
    chosen_linears,
    conditioning_sqnr,
    run_to_transformer,
)
from sdkiln.optimizer.registry import TransformContext  # noqa: E402
from sdkiln.runtime.quant import by_recipe_kind  # noqa: E402

SCHEMES = (W8A16Config(), W4A16Config(), W8A8DynamicConfig(), FP8DynamicConfig())
GATE_SAMPLES = TextEncoderQuantConfig().calib_samples


def quantized_encoder(encoder: nn.Module, config, ctx, reference) -> tuple[nn.Module, int, list[str], dict]:
    """A copy of ``encoder`` quantized as the text-encoder recipe step does it (its layer choice and
    swap, ``sdkiln.optimizer.quant.encoders``), and the conditioning SQNRs its gate reads."""
    cls, params = by_recipe_kind()[config.kind], config.module_params()
    layers, _ = chosen_linears(encoder, ())
    taken, not_applicable = applicable(encoder, layers, cls, params)
    with _trial(encoder, taken, cls, params):
        gate = conditioning_sqnr(reference, run_to_transformer(ctx, GATE_SAMPLES)[1])
    model = copy.deepcopy(encoder)
    _swap(model, taken, cls, params)
    return model, len(taken), [f"{n}: {why}" for n, why in not_applicable.items()], gate


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(ratio_db(float(ref.float().pow(2).sum()), float((ref.float() - out.float()).pow(2).sum())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "te_quant_fmnist.json")
    args = parser.parse_args(argv)
    start = time.time()
    spec = get_spec("fmnist-flux")
    pipe = spec.build()
    call = spec.call_kwargs()
    prompts, seeds = sample_plan(spec, args.samples, seed=0)
    float_encoder = pipe.text_encoder
    with torch.inference_mode():
        ref_states, ref_pooled = encode(list(spec.eval_prompts), float_encoder, pipe.tokenizer)
    real = pipe.tokenizer(
        list(spec.eval_prompts),
        padding="max_length",
        max_length=ref_states.shape[1],
        truncation=True,
        return_tensors="pt",
    ).attention_mask.bool()  # the prompt's own tokens; the rest is padding, which the transformer reads too
    reference, _ = generate(pipe, call, prompts, seeds, batch_size=10, desc="float")
    rows = [{"scheme": "float", **_scores(reference, None, spec, prompts)}]
    ctx = TransformContext(pipeline=pipe, spec=spec, forward_loop=None)
    _, given = run_to_transformer(ctx, GATE_SAMPLES)
    for config in SCHEMES:
        encoder, layers, skipped, gate = quantized_encoder(float_encoder, config, ctx, given)
        with torch.inference_mode():
            states, pooled = encode(list(spec.eval_prompts), encoder, pipe.tokenizer)
        pipe.text_encoder = encoder
        images, _ = generate(pipe, call, prompts, seeds, batch_size=10, desc=config.kind)
        pipe.text_encoder = float_encoder
        rows.append(
            {
                "scheme": config.kind,
                "layers": layers,
                "layers_left_float": len(skipped),
                "gate_sqnr_db": min(gate.values()),
                "gate_sqnr_db_by_input": gate,
                "gate_decision": "quantized" if min(gate.values()) >= spec.text_encoder_floor_db else "float",
                "encoder_sqnr_db": {
                    "states": sqnr(ref_states, states),
                    "states_prompt_tokens": sqnr(ref_states[real], states[real]),
                    "states_padding": sqnr(ref_states[~real], states[~real]),
                    "pooled": sqnr(ref_pooled, pooled),
                },
                **_scores(images, reference, spec, prompts),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "bench": "te_quant",
        "machine": harness.machine(("torch", "transformers")),
        "model": "fmnist-flux (all-MiniLM-L6-v2 text encoder, float transformer)",
        "samples": args.samples,
        "encoder_prompts": len(spec.eval_prompts),
        "gate": {"samples": GATE_SAMPLES, "floor_db": spec.text_encoder_floor_db},
        "call": {k: v for k, v in call.items() if isinstance(v, int | float | str)},
        "rows": rows,
        "minutes": round((time.time() - start) / 60, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'scheme':<14} {'gate':>6} {'SQNR states':>12} {'prompt':>7} {'pooled':>7} {'PSNR':>7} {'acc':>5} {'FD':>7}"
    )
    for r in rows:
        s = r.get("encoder_sqnr_db", {})
        print(
            f"{r['scheme']:<14} {r.get('gate_sqnr_db', float('nan')):6.1f} {s.get('states', float('nan')):12.1f} {s.get('states_prompt_tokens', float('nan')):7.1f} "
            f"{s.get('pooled', float('nan')):7.1f} "
            f"{r.get('psnr', float('nan')):7.2f} {r.get('class_accuracy', float('nan')):5.2f} "
            f"{r.get('fd_fmnist', float('nan')):7.2f}"
        )
    print(f"wrote {args.out} ({result['minutes']} min)")
    return 0


def _scores(images, reference, spec, prompts) -> dict:
    out = harness.scores(images, reference, spec, prompts)
    out.pop("psnr_per_sample", None)
    return out


if __name__ == "__main__":
    sys.exit(main())
