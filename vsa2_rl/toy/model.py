"""The toy task's model: a tiny WanTransformer3DModel on pixel-space latents, as a bundle.

The model is diffusers' ``WanTransformer3DModel`` at about 0.25 M parameters per block
(4 blocks, width 128, 4 heads of 32) with ``out_channels = 3``: the "latents" are the RGB pixels
mapped to [-1, 1], so decoding is an affine map and no VAE is needed. Prompts go through the
built-in word-level text encoder (:mod:`vsa2_rl.toy.text`). The bundle's velocity is the
transformer output plus a fixed linear estimate of the velocity (:func:`linear_velocity`, a skip
preconditioning), so the transformer learns a residual.

The input has one channel more than the latents: the frame's position in the clip, -1 at the
first frame to 1 at the last (:func:`with_frame_positions`), concatenated as Wan's image-to-video
models concatenate their mask channels. Wan's only time signal is its 3D RoPE, which is
relative: a network that sees noise at high noise levels cannot tell the first frame from the
last, so its posterior mean is the same in every frame and which way a shape moves is left to the
sampling noise (measured: the earlier model, trained without this channel, moved "right" shapes
left as often as right). Real Wan latents carry absolute time anyway (the causal VAE's first
latent frame encodes one frame, the others four); the toy's pixels do not, so it gets a channel.

The checkpoint (``toy.safetensors`` with ``transformer.*`` and ``text_encoder.*`` tensors, and
``config.json`` with the architecture, the recipe and every build stage's figures) is written by
:func:`save_toy_checkpoint` (:mod:`vsa2_rl.toy.build` trains it) and ships in ``assets/toy/``;
:func:`load_toy_bundle` loads it as a ``VideoDiTBundle`` (``model.kind=toy``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import ConfigError, VSA2Config
from vsa2_rl.device import resolve_dtype
from vsa2_rl.models.wan import enable_vsa2, wan_velocity
from vsa2_rl.toy.text import ToyTextEncoder, WordTokenizer, toy_vocabulary

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "toy"
WEIGHTS_FILE = "toy.safetensors"
CONFIG_FILE = "config.json"

TOY_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 4,  # RGB + the frame-position channel (with_frame_positions)
    "out_channels": 3,
    "text_dim": 64,
    "freq_dim": 64,
    "ffn_dim": 256,
    "num_layers": 4,
    "rope_max_seq_len": 64,
}
TOY_TEXT = {"dim": 64, "max_length": 8}


def toy_transformer_config(frame_positions: bool = True, overrides: dict | None = None) -> dict:
    """``TOY_TRANSFORMER`` with ``overrides`` of its keys (a larger model of the same family),
    or its variant without the frame-position input channel."""
    unknown = sorted(set(overrides or {}) - set(TOY_TRANSFORMER))
    if unknown:
        raise ValueError(f"architecture overrides {unknown} are not keys of TOY_TRANSFORMER")
    config = {**TOY_TRANSFORMER, **(overrides or {})}
    config["in_channels"] = config["out_channels"] + int(frame_positions)
    return config


def make_toy_transformer(config: dict | None = None) -> nn.Module:
    """A randomly initialised toy ``WanTransformer3DModel`` (``TOY_TRANSFORMER`` by default)."""
    from diffusers import WanTransformer3DModel

    config = dict(TOY_TRANSFORMER if config is None else config)
    config["patch_size"] = tuple(config["patch_size"])
    return WanTransformer3DModel(**config)


def make_toy_text_encoder(config: dict | None = None) -> tuple[WordTokenizer, ToyTextEncoder]:
    config = TOY_TEXT if config is None else config
    vocabulary = toy_vocabulary()
    tokenizer = WordTokenizer(vocabulary, config["max_length"])
    return tokenizer, ToyTextEncoder(len(vocabulary), config["dim"], config["max_length"])


def pixels_to_latents(videos: torch.Tensor) -> torch.Tensor:
    """Videos [B, T, C, H, W] in [0, 1] -> toy latents [B, C, T, H, W] in [-1, 1]."""
    return videos.permute(0, 2, 1, 3, 4) * 2.0 - 1.0


def latents_to_pixels(latents: torch.Tensor) -> torch.Tensor:
    """Toy latents [B, C, T, H, W] -> videos [B, T, C, H, W] in [0, 1], float32."""
    return (latents.float() * 0.5 + 0.5).clamp(0.0, 1.0).permute(0, 2, 1, 3, 4).contiguous()


# Per-pixel mean and variance of the synthetic videos in latent units (measured on the training
# distribution: black background at -1, one coloured shape covering about 10 % of the frame).
DATA_MEAN = -0.92
DATA_VAR = 0.11


def linear_velocity(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Best linear estimate of the velocity noise - data from ``latents`` at noise level sigma.

    For data of mean m and variance s2 per pixel and x = (1 - sigma) data + sigma noise, the
    linear MMSE estimate of v = noise - data is ``c(sigma) (x - (1 - sigma) m) - m`` with
    ``c = (sigma - (1 - sigma) s2) / ((1 - sigma)^2 s2 + sigma^2)``. The toy transformer predicts
    the residual over it, the rectified-flow analogue of EDM's skip preconditioning (Karras et
    al., 2022): reproducing the noise at high sigma no longer has to be learnt, which a tiny DiT
    trained for a few hundred steps does badly (speckled samples).
    """
    s = sigma.float().view(-1, 1, 1, 1, 1)
    c = (s - (1.0 - s) * DATA_VAR) / ((1.0 - s) ** 2 * DATA_VAR + s**2)
    return c * (latents.float() - (1.0 - s) * DATA_MEAN) - DATA_MEAN


def with_frame_positions(latents: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, T, H, W] with a channel appended holding each frame's position in the
    clip, from -1 (first frame) to 1 (last): [B, C + 1, T, H, W]."""
    batch, _, frames, height, width = latents.shape
    positions = torch.linspace(-1.0, 1.0, frames, device=latents.device, dtype=latents.dtype)
    channel = positions.view(1, 1, frames, 1, 1).expand(batch, 1, frames, height, width)
    return torch.cat([latents, channel], dim=1)


def toy_velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    text_emb: torch.Tensor,
    frame_positions: bool = True,
) -> torch.Tensor:
    """Toy model velocity: transformer residual + :func:`linear_velocity`, float32.

    ``frame_positions``: the transformer takes :func:`with_frame_positions`' extra channel
    (models built before it existed do not)."""
    sigma = sigma.reshape(-1).expand(latents.shape[0])
    inputs = with_frame_positions(latents) if frame_positions else latents
    residual = wan_velocity(transformer, inputs, sigma, text_emb)
    return residual + linear_velocity(latents, sigma)


@dataclass
class ToyBundle:
    """The toy model as a ``VideoDiTBundle`` (docs/concepts.md, "The model bundle")."""

    transformer: nn.Module
    sparsity_state: SparsityState
    text_encoder: ToyTextEncoder
    tokenizer: WordTokenizer
    latent_channels: int = 3
    info: dict = field(default_factory=dict)  # training record from the checkpoint's json
    frame_positions: bool = True  # the input carries the frame-position channel

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        _, p_h, p_w = self.transformer.config.patch_size
        if num_frames < 1 or height % p_h or width % p_w or min(height, width) < 1:
            raise ValueError(
                f"height and width must be positive multiples of the patch ({p_h}, {p_w}), "
                f"got {num_frames}x{height}x{width}"
            )
        return self.latent_channels, num_frames, height, width

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, max_length, text_dim] embeddings (zero past each prompt)."""
        device = next(self.text_encoder.parameters()).device
        ids, mask = self.tokenizer(list(prompts))
        with torch.no_grad():
            emb = self.text_encoder(ids.to(device), mask.to(device))
        return emb.to(device=self.device, dtype=self.dtype)

    def velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, text_emb: torch.Tensor
    ) -> torch.Tensor:
        """Velocity = transformer output + the fixed linear estimate (see ``linear_velocity``)."""
        return toy_velocity(self.transformer, latents, sigma, text_emb, self.frame_positions)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents_to_pixels(latents)


# --------------------------------------------------------------------------------------------
# Checkpoint


def save_toy_checkpoint(
    path: str | Path,
    transformer: nn.Module,
    text_encoder: ToyTextEncoder,
    info: dict,
) -> None:
    """Write ``toy.safetensors`` (transformer.* incl. VSA2 params, text_encoder.*) + config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"transformer.{k}": v for k, v in transformer.state_dict().items()}
    tensors.update({f"text_encoder.{k}": v for k, v in text_encoder.state_dict().items()})
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path / WEIGHTS_FILE))
    architecture = {key: transformer.config[key] for key in TOY_TRANSFORMER}
    architecture["patch_size"] = list(architecture["patch_size"])
    config = {"transformer": architecture, "text_encoder": TOY_TEXT, "training": info}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def split_state(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors under ``prefix`` ("transformer." or "text_encoder."), unprefixed."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def read_toy_config(path: str | Path | None = None) -> dict:
    """The architecture record (``config.json``) of the toy checkpoint at ``path`` (None: the
    shipped one); ConfigError naming model.path where the folder holds no checkpoint."""
    path = Path(ASSET_DIR if path is None else path)
    if not (path / WEIGHTS_FILE).exists() or not (path / CONFIG_FILE).exists():
        raise ConfigError(
            f"model.path={str(path)!r} has no toy checkpoint ({WEIGHTS_FILE} + {CONFIG_FILE}); "
            "leave model.path empty in a source checkout (assets/toy), point it at a folder "
            "written by scripts/build_toy_model.py, or build one there with "
            "`python scripts/build_toy_model.py --device cuda --out DIR`"
        )
    return json.loads((path / CONFIG_FILE).read_text())


def load_toy_bundle(
    vsa2: VSA2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    path: str | Path | None = None,
) -> ToyBundle:
    """Load the toy model as a ``VideoDiTBundle`` with VSA2 per ``vsa2``.

    ``dtype`` is a torch dtype or "auto" (bf16 on CUDA, fp32 on CPU); the text encoder stays fp32.

    ``path`` None: the shipped ``assets/toy`` checkpoint of a source checkout. A missing
    checkpoint is an error that says how to build one (minutes on a GPU, hours on a CPU: never
    started silently). With ``vsa2.enabled = False`` the checkpoint's VSA2 parameters are not
    used (plain dense model).
    """
    path = Path(ASSET_DIR if path is None else path)
    config = read_toy_config(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    tensors = load_file(str(path / WEIGHTS_FILE))
    transformer = make_toy_transformer(config["transformer"])
    state = SparsityState()
    transformer_state = split_state(tensors, "transformer.")
    base_state = {k: v for k, v in transformer_state.items() if ".vsa2." not in k}
    transformer.load_state_dict(base_state)
    if vsa2.enabled:
        enable_vsa2(transformer, vsa2, state)
        if len(base_state) < len(transformer_state):
            transformer.load_state_dict(transformer_state)
    tokenizer, text_encoder = make_toy_text_encoder(config["text_encoder"])
    text_encoder.load_state_dict(split_state(tensors, "text_encoder."))
    text_encoder = text_encoder.to(device).eval().requires_grad_(False)
    architecture = config["transformer"]
    transformer = transformer.to(device)
    if dtype != torch.float32:  # it is built in float32; diffusers warns on every dtype cast
        transformer = transformer.to(dtype)
    return ToyBundle(
        transformer=transformer,
        sparsity_state=state,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        latent_channels=architecture["out_channels"],
        info=config.get("training", {}),
        frame_positions=architecture["in_channels"] > architecture["out_channels"],
    )
