"""How fast the toy base can learn its direction words from the best data a reward could give.

RL with a 0/1 "moved the prompted way" reward can at best fine-tune on the samples that did;
this script measures that ceiling. From a toy checkpoint, for each learning rate, Adam on the
transformer (the text encoder frozen, as in RL) at the rollout sparsity, per step one of:

- ``captioned``: flow matching on fresh synthetic videos that move as captioned (perfect,
  off-policy data: how fast the weights can move toward the skill at all);
- ``filtered``: flow matching on the model's own ODE samples of the train prompts (drawn at
  ``--filter-sparsity``, default the rollout sparsity) that move the prompted way
  (rejection-sampling fine-tuning: what a perfect binary reward gives);
- ``own``: the same samples, all kept (what fine-tuning on the model's own rollouts does by
  itself, without any reward).

Every ``--eval-every`` steps: ODE samples of the held-out prompts at the eval sparsity, the
share moving the prompted way and the shape fidelity (``score_samples``).

    python benchmarks/toy_ceiling.py --model assets/toy [--device cuda] [--lrs 3e-5 1e-4 3e-4]
        [--modes captioned filtered own] [--steps 40] [--batch 64] [--filter-sparsity S]
        [--out ceiling.md]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from vsa2_rl.config import load_config
from vsa2_rl.rewards import get_reward
from vsa2_rl.toy.build import flow_matching_loss
from vsa2_rl.toy.gate import GateSettings, captioned_batch
from vsa2_rl.toy.model import load_toy_bundle, pixels_to_latents
from vsa2_rl.toy.prompts import toy_prompts
from vsa2_rl.toy.report import draw_samples, score_samples

MODES = ("captioned", "filtered", "own")


def own_batch(bundle, count: int, shape: dict, step: int, num_steps: int, only_followed: bool):
    """Prompts and latents of the model's ODE samples of ``count`` train prompts (drawn with
    ``step`` as seed); ``only_followed``: only those that move the prompted way."""
    generator = torch.Generator().manual_seed(10_000 + step)
    pool = toy_prompts("train")
    prompts = [pool[i] for i in torch.randint(len(pool), (count,), generator=generator)]
    videos = draw_samples(
        bundle, prompts, seeds_per_prompt=1, num_steps=num_steps, seed=1000 + step, **shape
    )
    kept = get_reward("prompt_direction")(videos, prompts) > 0.5
    if not only_followed:
        kept = torch.ones_like(kept)
    latents = pixels_to_latents(videos[kept].to(bundle.device))
    return [p for p, keep in zip(prompts, kept.tolist(), strict=True) if keep], latents


def held_out_figures(bundle, shape: dict, args, sparsity: float) -> dict:
    prompts = toy_prompts("eval")
    bundle.sparsity_state.sparsity = sparsity
    videos = draw_samples(
        bundle, prompts, seeds_per_prompt=args.eval_seeds, num_steps=args.eval_num_steps, **shape
    )
    return score_samples(videos, prompts, args.eval_seeds)


def fine_tune(base, mode: str, lr: float, shape: dict, args, sparsity: dict) -> list[dict]:
    """Figures at each evaluation of one fine-tuning run from a copy of ``base``."""
    bundle = copy.deepcopy(base)
    device = bundle.device
    params = list(bundle.transformer.parameters())
    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            rows.append({"step": step, **held_out_figures(bundle, shape, args, sparsity["eval"])})
            print(mode, lr, rows[-1], flush=True)
        if step == args.steps:
            break
        if mode == "captioned":
            data = GateSettings(num_frames=shape["num_frames"], size=shape["size"])
            prompts, latents = captioned_batch(args.batch, data, generator, device)
        else:
            bundle.sparsity_state.sparsity = sparsity["filter"]
            prompts, latents = own_batch(
                bundle, args.batch, shape, step, args.eval_num_steps, mode == "filtered"
            )
        bundle.sparsity_state.sparsity = sparsity["train"]
        rows[-1].setdefault("kept", []).append(len(prompts))
        if not prompts:
            continue
        text_emb = bundle.encode_prompts(prompts)
        noise = torch.randn(latents.shape, generator=generator).to(device)
        sigma = torch.sigmoid(torch.randn(len(prompts), generator=generator)).to(device)
        loss = flow_matching_loss(
            bundle.transformer, latents, text_emb, sigma, noise, bundle.frame_positions
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        bundle.sparsity_state.pop_density()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="toy checkpoint folder")
    parser.add_argument("--config", default="configs/default.yaml", help="run config (sparsities)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64, help="videos drawn per step")
    parser.add_argument(
        "--filter-sparsity",
        type=float,
        default=None,
        help="sparsity of the filtered and own samples (default: the rollouts)",
    )
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-seeds", type=int, default=4)
    parser.add_argument("--eval-num-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    config = load_config(args.config, [f"model.path={args.model}", "attention.backend=torch"])
    base = load_toy_bundle(config.attention, device=args.device, path=args.model)
    base.text_encoder.requires_grad_(False)
    shape = {"num_frames": config.model.num_frames, "size": config.model.height}
    sparsity = {"train": config.sparsity.train, "eval": config.sparsity.eval}
    sparsity["filter"] = sparsity["train"] if args.filter_sparsity is None else args.filter_sparsity
    evals = list(range(0, args.steps + 1, args.eval_every))
    lines = [
        f"model {args.model}; {args.batch} videos a step, Adam, train sparsity "
        f"{sparsity['train']} (own samples drawn at {sparsity['filter']}); held-out "
        f"direction match (shape fidelity) at eval sparsity "
        f"{sparsity['eval']}, ODE {args.eval_num_steps} steps, {args.eval_seeds} per prompt",
        "",
        "| data | lr | " + " | ".join(f"step {s}" for s in evals) + " | kept per step |",
        "|---" * (len(evals) + 3) + "|",
    ]
    for mode in args.modes:
        for lr in args.lrs:
            rows = fine_tune(base, mode, lr, shape, args, sparsity)
            cells = [f"{r['direction_match']:.3f} ({r['shape_fidelity']:.2f})" for r in rows]
            kept = [k for r in rows for k in r.get("kept", [])]
            lines.append(
                f"| {mode} | {lr:g} | " + " | ".join(cells) + f" | {sum(kept) / len(kept):.1f} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
