"""``model.vae_decode_dtype``: the Wan VAE decodes in bfloat16 through a copy of its decoder
(:func:`vsa2_rl.models.wan_bundle.decoding_vae`), within bfloat16's rounding of a float64 decode;
float32, the default, decodes exactly as before the option existed."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from vsa2_rl.config import ConfigError, VSA2Config, load_config
from vsa2_rl.config.model import ModelConfig
from vsa2_rl.models.wan_bundle import decode_latents, decoding_vae, load_wan_bundle
from vsa2_rl.runtime import build_bundle

sys.path.insert(0, os.path.dirname(__file__))
from wan_folders import save_wan_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "configs", "prompts", "wan_motion_train.txt")
BF16_UNIT_ROUNDOFF = 2.0**-8  # half the spacing of bfloat16's 8 significant bits, relative


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {kind: save_wan_folder(root / kind, kind) for kind in ("wan21_t2v", "wan22_ti2v")}


def _load(path: str, vae_decode_dtype: str = "float32"):
    components = ("transformer", "vae")
    return load_wan_bundle(
        path, VSA2Config(backend="torch"), components=components, vae_decode_dtype=vae_decode_dtype
    )


def _latents(bundle, size: tuple[int, int, int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, *bundle.latent_shape(*size), generator=generator)


def _decode_before(vae, latents: torch.Tensor) -> torch.Tensor:
    """``WanBundle.decode`` as it was before ``model.vae_decode_dtype``."""
    vae_param = next(vae.parameters())
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=vae_param.device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=vae_param.device).view(shape)
    latents = latents.to(device=vae_param.device, dtype=torch.float32) * std + mean
    with torch.no_grad():
        video = vae.decode(latents.to(vae_param.dtype), return_dict=False)[0]
    video = (video.float() * 0.5 + 0.5).clamp(0.0, 1.0)
    return video.permute(0, 2, 1, 3, 4).contiguous()


def _bf16_psnr(reference: torch.Tensor, convolutions: int) -> float:
    """The PSNR (dB, frames in [0, 1]) of a decode whose activations are rounded to bfloat16,
    against the exact decode ``reference``: a rounding leaves a relative error uniform in
    [-u, u] (RMS u / sqrt(3)); each convolution of the decoder adds about three (its output,
    the norm and the activation before it) and, in a normalised network, they add in quadrature
    and reach the output at its scale: an RMS error of u * sqrt(convolutions) * RMS(output in
    [-1, 1]), halved in [0, 1]."""
    output = reference.double() * 2 - 1
    rms = float(output.pow(2).mean().sqrt())
    return -20 * math.log10(0.5 * BF16_UNIT_ROUNDOFF * math.sqrt(convolutions) * rms)


@pytest.mark.parametrize(
    ("kind", "size", "tiled"),
    [
        ("wan21_t2v", (5, 32, 48), False),
        ("wan21_t2v", (5, 48, 48), True),
        ("wan22_ti2v", (5, 64, 64), False),  # Wan2.2's residual VAE, 2x2 pixel patches
    ],
)
def test_bfloat16_decode_is_float64_within_bfloat16_rounding(folders, kind, size, tiled):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    bundle = _load(folders[kind], "bfloat16")
    decoder = bundle.decode_vae
    if tiled:  # 2x2 tiles of 32 pixels, blended over 8: the tiled decode runs
        decoder.enable_tiling(32, 32, 24, 24)
    assert {p.dtype for p in decoder.decoder.parameters()} == {torch.bfloat16}
    assert decoder.post_quant_conv.weight.dtype == torch.bfloat16
    # the encoder is the float32 VAE's own (image conditions encode with it), not a copy
    assert decoder.encoder is bundle.vae.encoder and decoder.quant_conv is bundle.vae.quant_conv
    assert {p.dtype for p in bundle.vae.parameters()} == {torch.float32}

    convolutions = [m for m in decoder.decoder.modules() if isinstance(m, WanCausalConv3d)]
    seen = set()
    hooks = [c.register_forward_hook(lambda m, i, o: seen.add(o.dtype)) for c in convolutions]
    latents = _latents(bundle, size)
    video = bundle.decode(latents)
    for hook in hooks:
        hook.remove()
    assert seen == {torch.bfloat16}
    assert video.dtype == torch.float32 and video.shape == (2, size[0], 3, *size[1:])

    reference = decode_latents(decoding_vae(decoder, torch.float64), latents)
    psnr = -10 * math.log10(float((video.double() - reference).pow(2).mean()))
    expected = _bf16_psnr(reference, len(convolutions) + 1)  # + post_quant_conv
    # bfloat16's rounding, at most twice the expected error (6 dB); and not float32's, 2**16
    # times smaller (96 dB above): bfloat16 ran (measured here: 6 to 7 dB above the expectation)
    assert expected - 6.1 < psnr < expected + 18.1, (psnr, expected)


def test_float32_default_decodes_as_before(folders):
    bundle = _load(folders["wan21_t2v"])
    assert bundle.decode_vae is bundle.vae  # no copy
    latents = _latents(bundle, (5, 32, 48))
    assert torch.equal(bundle.decode(latents), _decode_before(bundle.vae, latents))


def test_the_config_key_reaches_the_bundle(folders, tmp_path):
    run = [
        "model.kind=wan",
        f"model.path={folders['wan21_t2v']}",
        "model.num_frames=5",
        f"prompts.file={PROMPTS}",
        f"out_dir={tmp_path / 'run'}",
    ]
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        config = load_config(None, [*run, f"model.vae_decode_dtype={name}"])
        bundle = build_bundle(config, torch.device("cpu"), torch.float32)
        assert bundle.decode_vae.decoder.conv_in.weight.dtype == dtype
        assert bundle.vae.decoder.conv_in.weight.dtype == torch.float32


def test_a_bad_vae_decode_dtype_names_the_key():
    assert ModelConfig().vae_decode_dtype == "float32"
    with pytest.raises(ConfigError, match=r"model\.vae_decode_dtype: got 'float16', expected"):
        ModelConfig(kind="wan", path="/data/wan", vae_decode_dtype="float16")
    with pytest.raises(ConfigError, match=r"model\.vae_decode_dtype: the toy model has no VAE"):
        ModelConfig(vae_decode_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"model\.vae_decode_dtype: got 'bf16'"):
        load_config(None, ["model.kind=wan", "model.path=/data/wan", "model.vae_decode_dtype=bf16"])
