"""Write the motion prompt sets of the Wan recipes into configs/prompts/.

    python scripts/make_prompt_sets.py [--out configs/prompts]

Text-to-video (``wan_motion_train.txt``, 400 prompts; ``wan_motion_eval.txt``, 100): each
prompt is "<Scene>, <subject> <motion>. <Camera>.", the motion one of five kinds (direction,
speed, rotation, deformation, interaction). Subjects are agents (people, animals, a robot) or
soft objects, each kind with the motions that suit it. One (subject, motion) pair in five is
held out, by the rule ``(subject index + motion index) % 5 == 0``: the evaluation prompts are
exactly those pairs, so every evaluated subject, motion, scene and camera occurs in training,
but never the subject with that motion. A motion reward's gain on them is generalisation, not
memorisation. Every pair appears twice, each time with its own scene and camera (drawn by a
seeded generator); both files are shuffled so that the first N prompts (``eval.num_prompts``)
mix subjects and kinds of motion.

Image-to-video (``i2v_example.jsonl`` and its images in ``i2v_images/``): an example of the
JSON Lines format, four drawn scenes with motion prompts naming their images by relative path.
It shows the format and lets a recipe run; train on photographs of your own subjects.

The output depends on nothing but this file: run it again and the files come out the same.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

SEED = 0
HELD_OUT_MODULUS = 5  # one (subject, motion) pair in five is held out for evaluation
COPIES = 2  # each pair appears with this many (scene, camera) draws
KINDS = ("direction", "speed", "rotation", "deformation", "interaction")

AGENTS = (
    "a young man in a red hoodie",
    "a woman in a long green coat",
    "a boy in a yellow raincoat",
    "a dancer in a white costume",
    "a small silver robot",
    "a golden retriever",
    "a black cat",
    "a brown horse",
    "a red fox",
    "a penguin",
)
# Four motions of each kind, in KINDS order, said so that any agent above can do them.
AGENT_MOTIONS = {
    "direction": (
        "walks from the left of the frame to the right",
        "runs straight toward the camera",
        "moves away from the camera into the distance",
        "jumps straight up and lands on the same spot",
    ),
    "speed": (
        "walks very slowly, one careful step at a time",
        "sprints at full speed across the frame",
        "starts walking, then breaks into a fast run",
        "runs, then slows down and stops",
    ),
    "rotation": (
        "turns around on the spot to face the camera",
        "spins in a full circle",
        "rolls over on the ground",
        "turns its head from left to right",
    ),
    "deformation": (
        "stretches its whole body out long, then curls up",
        "crouches down low, then springs up tall",
        "bends down to the ground and straightens up again",
        "shakes its whole body from side to side",
    ),
    "interaction": (
        "pushes a red ball forward",
        "knocks over a stack of wooden blocks",
        "jumps over a small log",
        "walks through a puddle, splashing water",
    ),
}
OBJECTS = (
    "a red rubber ball",
    "a water balloon",
    "a lump of blue clay",
    "a green jelly cube",
    "a striped beach ball",
)
OBJECT_MOTIONS = {
    "direction": (
        "rolls from the left of the frame to the right",
        "drops straight down from above the frame",
    ),
    "speed": ("rolls slowly to a stop", "shoots quickly across the frame"),
    "rotation": ("spins rapidly in place", "tumbles end over end through the air"),
    "deformation": (
        "squashes flat as it lands, then springs back",
        "wobbles and stretches as it bounces",
    ),
    "interaction": ("bounces off a brick wall", "knocks over a row of dominoes"),
}
SCENES = (
    "on a sandy beach at sunset",
    "in a grassy park on a sunny day",
    "on a wet city street at night",
    "in a snowy field",
    "in a large empty warehouse",
    "on a wooden pier by a lake",
    "in a desert under a clear sky",
    "in a sunlit living room",
)
CAMERAS = (
    "static camera",
    "the camera pans slowly to the right",
    "the camera pans slowly to the left",
    "the camera tracks alongside",
    "the camera slowly zooms in",
    "the camera slowly pulls back",
    "handheld camera with a slight shake",
    "the camera circles around the scene",
)


@dataclass(frozen=True)
class Prompt:
    """One prompt's parts; ``text`` is what the prompt file holds."""

    subject: str
    kind: str
    motion: str
    scene: str
    camera: str

    @property
    def text(self) -> str:
        return f"{_capital(self.scene)}, {self.subject} {self.motion}. {_capital(self.camera)}."


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


def motion_pairs() -> list[tuple[str, str, str, bool]]:
    """Every (subject, kind, motion, held_out) the sets draw from, agents then objects."""
    pairs = []
    for subjects, motions in ((AGENTS, AGENT_MOTIONS), (OBJECTS, OBJECT_MOTIONS)):
        listed = [(kind, motion) for kind in KINDS for motion in motions[kind]]
        for i, subject in enumerate(subjects):
            for j, (kind, motion) in enumerate(listed):
                pairs.append((subject, kind, motion, (i + j) % HELD_OUT_MODULUS == 0))
    return pairs


def prompt_sets() -> dict[str, list[Prompt]]:
    """The train and eval prompts: each pair ``COPIES`` times with distinct scenes and cameras."""
    rng = random.Random(SEED)
    sets: dict[str, list[Prompt]] = {"train": [], "eval": []}
    for subject, kind, motion, held_out in motion_pairs():
        scenes, cameras = rng.sample(SCENES, COPIES), rng.sample(CAMERAS, COPIES)
        split = sets["eval" if held_out else "train"]
        split += [Prompt(subject, kind, motion, s, c) for s, c in zip(scenes, cameras, strict=True)]
    for prompts in sets.values():
        rng.shuffle(prompts)
    return sets


# ---- image-to-video example ----------------------------------------------------------------

IMAGE_SIZE = (832, 480)  # Wan's 480p frame; the trainer resizes to the run's size anyway
SKY, GRASS, WATER, WOOD = (135, 190, 235), (90, 160, 70), (60, 110, 170), (150, 105, 65)


def _ball_on_lawn(draw: ImageDraw.ImageDraw) -> None:
    draw.rectangle((0, 300, 832, 480), fill=GRASS)
    draw.ellipse((360, 220, 460, 320), fill=(210, 40, 40))


def _boat_on_pond(draw: ImageDraw.ImageDraw) -> None:
    draw.rectangle((0, 260, 832, 480), fill=WATER)
    draw.polygon([(300, 300), (520, 300), (480, 340), (340, 340)], fill=(245, 245, 240))
    draw.polygon([(410, 180), (410, 295), (480, 295)], fill=(250, 250, 250))


def _duck_on_table(draw: ImageDraw.ImageDraw) -> None:
    draw.rectangle((0, 330, 832, 480), fill=WOOD)
    draw.ellipse((350, 250, 490, 340), fill=(245, 205, 40))
    draw.ellipse((440, 200, 510, 270), fill=(245, 205, 40))
    draw.polygon([(505, 230), (540, 240), (505, 250)], fill=(240, 130, 30))


def _kite_in_sky(draw: ImageDraw.ImageDraw) -> None:
    draw.rectangle((0, 420, 832, 480), fill=GRASS)
    draw.polygon([(420, 90), (480, 170), (420, 260), (360, 170)], fill=(240, 120, 30))
    draw.line([(420, 260), (380, 330), (430, 380), (400, 430)], fill=(60, 60, 60), width=3)


# image name -> (how to draw it, the prompts that animate it)
I2V_EXAMPLE = {
    "ball_on_lawn.png": (
        _ball_on_lawn,
        (
            "The red ball rolls from the left to the right across the lawn, static camera.",
            "The red ball bounces high twice and squashes as it lands, the camera slowly zooms in.",
        ),
    ),
    "boat_on_pond.png": (
        _boat_on_pond,
        (
            "The paper boat drifts slowly to the left on rippling water, static camera.",
            "The paper boat spins around in a gust of wind, the camera pans to the right.",
        ),
    ),
    "duck_on_table.png": (
        _duck_on_table,
        (
            "The rubber duck slides across the wooden table toward the camera.",
            "A hand squeezes the rubber duck flat and lets go, static camera.",
        ),
    ),
    "kite_in_sky.png": (
        _kite_in_sky,
        (
            "The orange kite climbs higher into the sky, swaying from side to side.",
            "The kite dives toward the grass and loops back up, the camera tilts down.",
        ),
    ),
}


def write_i2v_example(out: str) -> None:
    """Writes the example's images to ``out/i2v_images/`` and ``out/i2v_example.jsonl``."""
    os.makedirs(os.path.join(out, "i2v_images"), exist_ok=True)
    lines = []
    for name, (draw_scene, prompts) in I2V_EXAMPLE.items():
        image = Image.new("RGB", IMAGE_SIZE, SKY)
        draw_scene(ImageDraw.Draw(image))
        image.save(os.path.join(out, "i2v_images", name))
        lines += [json.dumps({"prompt": text, "image": f"i2v_images/{name}"}) for text in prompts]
    _write_lines(os.path.join(out, "i2v_example.jsonl"), lines)


def _write_lines(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("configs", "prompts"))
    out = parser.parse_args(argv).out
    os.makedirs(out, exist_ok=True)
    for split, prompts in prompt_sets().items():
        _write_lines(os.path.join(out, f"wan_motion_{split}.txt"), [p.text for p in prompts])
    write_i2v_example(out)
    print(f"wrote {out}/wan_motion_train.txt, wan_motion_eval.txt, i2v_example.jsonl")


if __name__ == "__main__":
    main()
