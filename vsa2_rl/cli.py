"""The ``vsa2-rl`` console script: ``vsa2-rl train``, ``check``, ``eval``, ``export`` and
``serve-reward``.

All but ``serve-reward`` take ``--config FILE`` (default ``configs/default.yaml``) and OmegaConf
dotlist overrides (``train.num_steps=2 out_dir=runs/x``); ``eval`` and ``export`` also take the
models they work on, given like keys (``run_dir=DIR``, ``"run_dirs=[A,B]"``, ``checkpoint=DIR``:
:class:`vsa2_rl.config.EvalTargets`). A configuration problem (missing file, unknown key, wrong
type, missing local model path) prints one ``error:`` line and exits with status 2 before
anything is written; a failing reward prints one ``error:`` line naming it and exits with 1.
Ctrl-C (``serve-reward``'s way to stop) prints one line and exits with 130.
``check`` prints a training config's plan and every problem it finds (:mod:`vsa2_rl.check`) and
exits with 1 when there is one, else 0; ``train`` prints the same problems (rewards aside: it
builds them next) as ``error:`` lines and exits with 2 before anything loads.
"""

from __future__ import annotations

import argparse
import sys

from vsa2_rl.config import (
    DEFAULT_CONFIG,
    ConfigError,
    EvalTargets,
    help_lines,
    load_config,
    load_eval_config,
)
from vsa2_rl.rewards import RewardError
from vsa2_rl.rl.checkpoint import DiskFull

_EPILOG = """Overrides are KEY=VALUE pairs (OmegaConf dotlist), e.g.
  vsa2-rl train train.num_steps=2 out_dir=runs/x "eval.sparsities=[0.0,0.9]"

Keys (default, meaning):
"""
_TARGETS = "\nThe models to take, given like keys (vsa2_rl.config.EvalTargets, not run settings):"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vsa2-rl",
        description="RL post-training of sparse-attention (VSA2) video diffusion transformers.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    descriptions = {
        "train": "RL fine-tuning, Flow-GRPO or DiffusionNFT (rl.algorithm=flow_grpo|nft), with "
        "VSA2 rollouts and a hard-to-easy sparsity schedule.",
        "check": "Pre-flight of a training config, no weights loaded: prints the plan (model, "
        "what trains, tokens per video, sparsity schedule, prompts, rewards) and every problem, "
        "one line each naming the key; exit status 1 if there is one.",
        "eval": "Evaluate rewards and latency at several inference sparsities "
        "(run_dir=DIR | run_dirs=[...] | checkpoint=DIR | model.path=DIR).",
        "export": "Write a run's weights as a peft adapter (LoRA runs) or a diffusers folder "
        "(full fine-tuning), plus the VSA2 parameters and their attention settings "
        "(run_dir=DIR | checkpoint=DIR, and out_dir=DIR: required, a new or empty folder; the "
        "config's out_dir is a training run's folder, never an export's).",
    }
    for name, description in descriptions.items():
        targets = (
            [_TARGETS, *help_lines(EvalTargets, path=None)]
            if name not in ("train", "check")
            else []
        )
        command = commands.add_parser(
            name,
            description=description,
            epilog=_EPILOG + "\n".join(help_lines() + targets),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument(
            "--config", default=DEFAULT_CONFIG, help=f"YAML config file (default: {DEFAULT_CONFIG})"
        )
        command.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    serve = commands.add_parser(
        "serve-reward",
        description="Serve a registered reward over HTTP for remote:http://HOST:PORT rewards "
        "(safetensors bodies, never pickle; binds 127.0.0.1 unless --host says otherwise).",
    )
    serve.add_argument("--reward", required=True, help="registered name or module:callable")
    serve.add_argument(
        "--kwargs", default="{}", help="the reward's keyword arguments, a JSON object"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=8000, help="1..65535, or 0 = any free port (printed)"
    )
    serve.add_argument(
        "--max-request-mb",
        type=int,
        default=512,
        help="largest request body, compressed or not, in MiB (default: 512; larger: HTTP 413)",
    )
    serve.add_argument(
        "--client-timeout-s",
        type=float,
        default=60.0,
        help="drop a connection whose whole request (headers and body) has not arrived this "
        "long after it opened (default: 60)",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=32,
        help="connections handled at once, one thread each; one more gets HTTP 503, which "
        "clients retry (default: 32)",
    )
    serve.add_argument(
        "--max-inflight-mb",
        type=int,
        default=None,
        help="memory all requests in flight may hold together, in MiB (bodies, pixels and their "
        "float32 copies); a request beyond it gets HTTP 503 (default: 6 x --max-request-mb, "
        "one largest request; at least that)",
    )
    return parser


def _serve_kwargs(text: str) -> dict:
    import json

    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--kwargs: not JSON ({error})") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(
            f"--kwargs: expected a JSON object of keyword arguments, e.g. "
            f"'{{\"threshold\": 0.5}}', got {text}"
        )
    return kwargs


def _check_serve_limits(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: {args.port} is not a port; use 1..65535, or 0 for any free one")
    if args.max_request_mb <= 0:
        raise ConfigError(f"--max-request-mb: must be > 0, got {args.max_request_mb} (e.g. 512)")
    if not args.client_timeout_s > 0:
        raise ConfigError(f"--client-timeout-s: must be > 0, got {args.client_timeout_s} (e.g. 60)")
    if args.max_connections < 1:
        raise ConfigError(f"--max-connections: must be >= 1, got {args.max_connections} (e.g. 32)")
    if args.max_inflight_mb is not None and args.max_inflight_mb < 6 * args.max_request_mb:
        raise ConfigError(
            f"--max-inflight-mb: {args.max_inflight_mb} cannot hold one largest request (6 x "
            f"--max-request-mb = {6 * args.max_request_mb}); raise it or lower --max-request-mb"
        )


def _bind_reward_server(args):
    """The bound server, before any reward loads: a bad address fails in a second."""
    import errno
    import socket

    from vsa2_rl.rewards.remote import RewardServer

    try:
        return RewardServer(
            args.host,
            args.port,
            max_request_mb=args.max_request_mb,
            client_timeout_s=args.client_timeout_s,
            max_connections=args.max_connections,
            max_inflight_mb=args.max_inflight_mb,
        )
    except socket.gaierror as error:
        raise ConfigError(
            f"--host: cannot resolve {args.host!r} ({error.strerror}); use an address or a "
            f"name this machine resolves, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port: {args.port} is in use on {args.host}; pick another, or 0 for any free one"
            ) from None
        raise ConfigError(
            f"--host/--port: cannot listen on {args.host}:{args.port} ({error.strerror}); use "
            f"an address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None


def _load_served_reward(args, kwargs: dict):
    from vsa2_rl.rewards import get_reward

    try:
        return get_reward(args.reward, **kwargs)
    except TypeError as error:  # a factory refusing a kwarg's type, e.g. a string for a number
        raise ConfigError(f"--kwargs: the reward {args.reward!r} refused them: {error}") from None
    except ValueError as error:
        raise ConfigError(f"--reward: {error}") from None
    except OSError as error:  # a weights file or folder named in the kwargs is missing
        raise ConfigError(f"--kwargs: the reward {args.reward!r} could not load: {error}") from None


def _serve_reward(args) -> None:
    kwargs = _serve_kwargs(args.kwargs)
    _check_serve_limits(args)
    server = _bind_reward_server(args)
    try:
        reward = _load_served_reward(args, kwargs)
    except BaseException:
        server.server_close()
        raise
    server.serve(reward)


def _refuse_export_without_out_dir(overrides: list[str]) -> None:
    """An export goes where ``out_dir=`` on the command line says, as ``save_pretrained`` writes
    where it is told: the config's own ``out_dir`` (``runs/default``) is a training run's."""
    if not any(item.split("=", 1)[0].strip() == "out_dir" for item in overrides):
        raise ConfigError(
            "out_dir: export needs out_dir=DIR on the command line, a new or empty folder for "
            "the export (e.g. out_dir=exports/my_run)"
        )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; overrides may stand on both sides of ``--config FILE`` (argparse
    alone would call those after it unrecognized)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    flags = [item for item in extra if item.startswith("-")]
    if args.command == "serve-reward" or flags:
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    args.overrides += extra
    return args


def _train(args) -> int:
    """``vsa2-rl train``: every problem ``vsa2-rl check`` finds, rewards aside, is an
    ``error:`` line (exit 2) before anything loads or is written."""
    from vsa2_rl.check import before_loading
    from vsa2_rl.rl.trainer import train

    # the paths too are among the problems, all listed at once: nothing is written before
    config = load_config(args.config, args.overrides, check_files=False)
    report = before_loading(config)
    for problem in report.problems:
        print(f"error: {problem}", file=sys.stderr)
    if report.problems:
        return 2
    train(config, report.facts)  # the model folder's facts, read once
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C, serve-reward's way to stop: one line, not a traceback
        what = "stopped" if args.command == "serve-reward" else "interrupted"
        after = {
            "train": "; the checkpoints written are whole, continue with train.resume=auto",
            "export": "; nothing was written to out_dir",
        }
        print(f"vsa2-rl {args.command}: {what} (Ctrl-C){after.get(args.command, '')}",
              file=sys.stderr)  # fmt: skip
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve-reward":
        try:
            _serve_reward(args)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0
    if args.command == "check":
        from vsa2_rl.check import check

        report = check(args.config, args.overrides)
        print(report.text())
        return 1 if report.problems else 0
    bad = [item for item in args.overrides if "=" not in item]
    try:
        if bad:
            raise ConfigError(f"{bad[0]}: overrides must be KEY=VALUE (e.g. train.num_steps=2)")
        if args.command == "export":
            _refuse_export_without_out_dir(args.overrides)
        if args.command == "train":
            return _train(args)
        if args.command == "eval":
            from vsa2_rl.eval import evaluate

            evaluate(*load_eval_config(args.config, args.overrides))
        else:
            from vsa2_rl.export import export

            print(f"exported to {export(*load_eval_config(args.config, args.overrides))}")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RewardError as error:  # a reward failed (rewards.on_error=stop, or during eval)
        print(f"error: {error}", file=sys.stderr)
        return 1
    except DiskFull as error:  # a checkpoint save: the earlier checkpoints are whole
        print(f"error: {error.strerror}", file=sys.stderr)
        return 1
    except RuntimeError as error:
        from vsa2_rl.rl.rollout import RolloutDiverged

        if not isinstance(error, RolloutDiverged):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
