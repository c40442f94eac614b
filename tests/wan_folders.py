"""Tiny random-initialised diffusers Wan folders of every kind vsa2_rl loads, written locally
(nothing downloads): Wan2.1 T2V / I2V, Wan2.2 A14B T2V / I2V (two experts) and TI2V-5B (16x
VAE, per-token timesteps). The architectures are the real ones at toy widths.
:func:`count_index_reads` records who opens a folder's ``model_index.json``."""

from __future__ import annotations

import builtins
import json
import os

import numpy as np
import torch
from PIL import Image

WORDS = ["<pad>", "</s>", "<unk>", "a", "red", "blue", "square", "circle", "moving", "right"]
TEXT_DIM = 16
TRANSFORMER = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "text_dim": TEXT_DIM,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}
CLIP_DIM = 32
KINDS = ("wan21_t2v", "wan21_i2v", "wan22_a14b_t2v", "wan22_a14b_i2v", "wan22_ti2v")
BOUNDARY = {"wan22_a14b_t2v": 0.875, "wan22_a14b_i2v": 0.9}


def _text_parts(root: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(os.path.join(root, "tokenizer"))
    config = UMT5Config(
        vocab_size=len(WORDS), d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8,
    )  # fmt: skip
    UMT5EncoderModel(config).save_pretrained(os.path.join(root, "text_encoder"))


def _vae(root: str, kind: str) -> int:
    """The VAE; returns its latent channels."""
    from diffusers import AutoencoderKLWan

    if kind == "wan22_ti2v":  # Wan2.2's residual VAE: 2x2 pixel patches, 16x in space
        z_dim = 8
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True,
            in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
            latents_mean=[0.1] * z_dim,
            latents_std=[1.5] * z_dim,
        )  # fmt: skip
    else:
        z_dim = 16
        vae = AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    vae.save_pretrained(os.path.join(root, "vae"))
    return z_dim


def _clip(root: str) -> None:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=CLIP_DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8,
    )  # fmt: skip
    CLIPVisionModel(config).save_pretrained(os.path.join(root, "image_encoder"))
    processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    processor.save_pretrained(os.path.join(root, "image_processor"))


def save_wan_folder(root, kind: str, seed: int = 0) -> str:
    """Writes a tiny diffusers folder of ``kind`` (one of ``KINDS``) at ``root``; returns it."""
    from diffusers import WanTransformer3DModel

    root = str(root)
    torch.manual_seed(seed)
    _text_parts(root)
    z_dim = _vae(root, kind)
    image_channels = kind in ("wan21_i2v", "wan22_a14b_i2v")
    transformer = {
        **TRANSFORMER,
        "in_channels": 2 * z_dim + 4 if image_channels else z_dim,
        "out_channels": z_dim,
    }
    if kind == "wan21_i2v":
        inner = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
        transformer.update(image_dim=CLIP_DIM, added_kv_proj_dim=inner)
        _clip(root)
    folders = ["transformer", "transformer_2"] if kind in BOUNDARY else ["transformer"]
    for folder in folders:
        WanTransformer3DModel(**transformer).save_pretrained(os.path.join(root, folder))
    index = {
        "_class_name": "WanImageToVideoPipeline" if image_channels else "WanPipeline",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": (
            ["diffusers", "WanTransformer3DModel"] if kind in BOUNDARY else [None, None]
        ),
        "image_encoder": (
            ["transformers", "CLIPVisionModel"] if kind == "wan21_i2v" else [None, None]
        ),
        "boundary_ratio": BOUNDARY.get(kind),
        "expand_timesteps": kind == "wan22_ti2v",
    }
    with open(os.path.join(root, "model_index.json"), "w", encoding="utf-8") as handle:
        json.dump(index, handle)
    return root


def count_index_reads(monkeypatch) -> list[str]:
    """The paths of the ``model_index.json`` files opened from now on (the list fills as they
    open), by any reader: vsa2_rl's and its libraries' alike."""
    opened, real_open = [], builtins.open

    def counting_open(file, *args, **kwargs):
        if os.path.basename(str(file)) == "model_index.json":
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    return opened


def save_image(path, seed: int = 0, size: tuple[int, int] = (40, 24)) -> str:
    """A random RGB PNG (smooth enough for a VAE to keep); returns its path."""
    generator = np.random.default_rng(seed)
    coarse = generator.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    Image.fromarray(coarse).resize(size, Image.BILINEAR).save(path)
    return str(path)
