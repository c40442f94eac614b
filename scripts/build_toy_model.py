"""Build the toy Wan-architecture model of the embedded default and write it to assets/toy/.

Trains ``vsa2_rl.models.toy.ToyBuildConfig``'s recipe (flow matching on synthetic moving-shape
videos; dense at 16 px, sparse rebasing to VSA2, then 32 px) on the CPU in a few minutes and
prints the validation flow-matching loss of dense attention and of VSA2 at several sparsities.

    python scripts/build_toy_model.py [--out assets/toy] [--seed 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vsa2_rl.models.toy import ASSET_DIR, ToyBuildConfig, build_toy_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSET_DIR, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = build_toy_model(args.out, ToyBuildConfig(seed=args.seed))
    final = info["stages"][-1]["validation"]
    rows = [("dense attention (VSA2 layers removed)", info["final_dense_without_vsa2"], 1.0)]
    for key, loss in final.items():
        if key.startswith("vsa2@"):
            sparsity = key.split("@")[1]
            rows.append((f"VSA2 at sparsity {sparsity}", loss, final[f"density@{sparsity}"]))
    print("\n| attention | validation flow-matching loss | achieved density |\n|---|---|---|")
    for name, loss, density in rows:
        print(f"| {name} | {loss:.4f} | {density:.3f} |")
    print(json.dumps({"build_seconds": info["build_seconds"]}))


if __name__ == "__main__":
    main()
