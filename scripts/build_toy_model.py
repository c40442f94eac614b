"""Build the toy Wan-architecture model of the embedded default and write it to assets/toy/.

The command line of :mod:`vsa2_rl.toy.build` (recipe, options and timings in its docstring):

    python scripts/build_toy_model.py [--out assets/toy] [--seed 0] [--device cuda]
    python scripts/build_toy_model.py --steps-scale 0.01 --out /tmp/toy   # a quick smoke run
    python scripts/build_toy_model.py --resume-from DIR ...   # continue a build cut short
"""

from vsa2_rl.toy.build import main

if __name__ == "__main__":
    main()
