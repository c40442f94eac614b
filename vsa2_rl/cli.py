"""The ``vsa2-rl`` console script: ``vsa2-rl train``, ``vsa2-rl eval`` and ``vsa2-rl export``.

Both take ``--config FILE`` (default ``configs/default.yaml``) and OmegaConf dotlist overrides
(``train.num_steps=2 out_dir=runs/x``). A configuration problem (missing file, unknown key,
wrong type, missing local model path) prints one ``error:`` line and exits with status 2 before
anything is written; a failing reward prints one ``error:`` line naming it and exits with 1.
"""

from __future__ import annotations

import argparse
import sys

from vsa2_rl.config import DEFAULT_CONFIG, ConfigError, help_lines, load_config
from vsa2_rl.rewards import RewardError

_EPILOG = """Overrides are KEY=VALUE pairs (OmegaConf dotlist), e.g.
  vsa2-rl train train.num_steps=2 out_dir=runs/x "eval.sparsities=[0.0,0.9]"

Keys (default, meaning):
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vsa2-rl",
        description="RL post-training of sparse-attention (VSA2) video diffusion transformers.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    descriptions = {
        "train": "Flow-GRPO fine-tuning with VSA2 rollouts and a hard-to-easy sparsity schedule.",
        "eval": "Evaluate rewards and latency at several inference sparsities "
        "(run_dir=DIR | run_dirs=[...] | checkpoint=DIR | model.path=DIR).",
        "export": "Write a run's weights as a peft adapter (LoRA runs) or a diffusers folder "
        "(full fine-tuning), plus the VSA2 parameters and their attention settings "
        "(run_dir=DIR | checkpoint=DIR, out_dir=DIR).",
    }
    for name, description in descriptions.items():
        command = commands.add_parser(
            name,
            description=description,
            epilog=_EPILOG + "\n".join(help_lines()),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument(
            "--config", default=DEFAULT_CONFIG, help=f"YAML config file (default: {DEFAULT_CONFIG})"
        )
        command.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bad = [item for item in args.overrides if "=" not in item]
    try:
        if bad:
            raise ConfigError(f"{bad[0]}: overrides must be KEY=VALUE (e.g. train.num_steps=2)")
        config = load_config(args.config, args.overrides)
        if args.command == "train":
            from vsa2_rl.rl.trainer import train

            train(config)
        elif args.command == "eval":
            from vsa2_rl.eval import evaluate

            evaluate(config)
        else:
            from vsa2_rl.export import export

            print(f"exported to {export(config)}")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RewardError as error:  # a reward failed (rewards.on_error=stop, or during eval)
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
