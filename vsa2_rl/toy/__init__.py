"""The toy task: a tiny Wan-architecture video DiT learning to move shapes as its prompt says.

The embedded default (``model.kind=toy``, ``make demo``) runs RL on a testbed small enough for a
CPU and with a known right answer. Its videos are 16x16-pixel clips of one coloured shape
(square, circle or triangle) on black moving in a straight line, captioned "a red square moving
left fast"; its model is diffusers' ``WanTransformer3DModel`` at 4 blocks of width 128 on RGB
pixels (no VAE) with a word-level text encoder, pretrained on such videos with truthful
captions and stopped while it moves the shape the prompted way in about half of its samples;
RL on ``prompt_motion`` (or ``prompt_direction``) is to raise that share, with
``shape_fidelity`` guarding against a policy that buys motion by smearing the shape. Being
built with the same architecture and VSA2 layers as Wan, it exercises the whole RL loop on a
CPU in minutes. Its parts:

- :mod:`vsa2_rl.toy.data`: the synthetic videos (:class:`~vsa2_rl.toy.data.ShapeSpec`, rendering
  with a known motion, the pretraining batches);
- :mod:`vsa2_rl.toy.prompts`: the 144 captions split into disjoint train and held-out eval sets
  (the prompts of a run without a prompt file);
- :mod:`vsa2_rl.toy.text`: the word-level tokenizer and text encoder;
- :mod:`vsa2_rl.toy.model`: the model, its bundle (``ToyBundle``), checkpoint writing and
  :func:`~vsa2_rl.toy.model.load_toy_bundle` (the shipped checkpoint is ``assets/toy/``);
- :mod:`vsa2_rl.toy.rewards`: the shape detector and the rewards ``prompt_motion``,
  ``prompt_direction`` and ``shape_fidelity`` (registered when :mod:`vsa2_rl.rewards` is
  imported);
- :mod:`vsa2_rl.toy.report`: samples of a toy model scored with the detector;
- :mod:`vsa2_rl.toy.build`: the staged pretraining and sparse rebasing that builds the base
  (``scripts/build_toy_model.py`` runs its command line);
- :mod:`vsa2_rl.toy.gate`: the learnability gate, whether a base learns from perfect data.

Import from the modules; this package imports none of them, so that :mod:`vsa2_rl.rewards` can
register the toy rewards without loading the model.
"""
