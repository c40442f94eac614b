"""Command-line entry point for RL fine-tuning: ``python train_rl.py ARGS`` = ``vsa2-rl train ARGS``."""

import sys

from vsa2_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
