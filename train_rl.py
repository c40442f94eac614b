"""RL fine-tuning entry point: ``python train_rl.py ARGS`` is ``vsa2-rl train ARGS``."""

import sys

from vsa2_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
