"""VSA2 inside diffusers' MiniMaxH3Transformer3DModel (vsa2_rl.models.minimax_h3), on a tiny
random model: the stock model at density 1, the block-sparse path merged with the text and
audio keys, gradients, the packed rows' bookkeeping and the video grid's checks."""

import copy

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.minimax_h3 import (
    MiniMaxVSA2AttnProcessor,
    enable_vsa2,
    video_grid,
    vsa2_parameters,
)

TINY_H3 = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "hidden_size": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "ffn_dim": 64,
    "in_channels": 4,
    "audio_in_channels": 4,
    "patch_size": (1, 2, 2),
    "text_dim": 8,
    "freq_dim": 16,
    "time_embed_hidden_dim": 32,
    "time_embed_dim": 16,
    "rope_freq_dim": 2,  # 12 of the 16 channels of a head rotated
}
TEXT, AUDIO, GRID = 5, 3, (2, 4, 16)  # video: 128 rows, 2 tiles of 64, 8 segments of 16
FRAME = GRID[1] * GRID[2]


def _tiny_h3(dtype=torch.float64):
    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(**TINY_H3).to(dtype)


def _video_positions(grid=GRID, start=float(TEXT)):
    """(t, h, w) of the video rows, frame-major raster order, with uneven steps as H3 has."""
    t = start + torch.tensor([0.0, 1.5, 6.5][: grid[0]], dtype=torch.float64)
    h = torch.linspace(-3.0, 29.0, grid[1], dtype=torch.float64)
    w = torch.linspace(0.5, 31.5, grid[2], dtype=torch.float64)
    return torch.stack(torch.meshgrid(t, h, w, indexing="ij"), dim=-1).reshape(-1, 3)


def _inputs(dtype=torch.float64, audio_first=False):
    """A batch of 2 packed sequences [text | audio | video] (or [audio | text | video]) with
    the same rows' values either way."""
    generator = torch.Generator().manual_seed(1)
    video_rows = GRID[0] * GRID[1] * GRID[2]
    text_pos = torch.zeros(TEXT, 3, dtype=torch.float64)
    text_pos[:, 0] = torch.arange(TEXT)
    audio_pos = torch.zeros(AUDIO, 3, dtype=torch.float64)
    audio_pos[:, 0], audio_pos[:, 2] = TEXT + torch.arange(AUDIO), 0.5
    text_at, audio_at = torch.arange(TEXT), TEXT + torch.arange(AUDIO)
    if audio_first:
        text_at, audio_at = AUDIO + torch.arange(TEXT), torch.arange(AUDIO)
    length = TEXT + AUDIO + video_rows
    positions = torch.zeros(length, 3, dtype=torch.float64)
    positions[text_at], positions[audio_at] = text_pos, audio_pos
    positions[TEXT + AUDIO :] = _video_positions()
    tags = torch.zeros(length, dtype=torch.long)
    tags[text_at], tags[audio_at] = 1, 2

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    return {
        "hidden_states": randn(2, video_rows, 16),
        "audio_hidden_states": randn(2, AUDIO, 4),
        "encoder_hidden_states": randn(2, TEXT, 8),
        "timestep": torch.tensor([0.7], dtype=dtype),
        "timestep_indices": torch.zeros(length, dtype=torch.long),
        "token_tags": tags,
        "position_ids": positions,
        "video_indices": torch.arange(TEXT + AUDIO, length),
        "audio_indices": audio_at,
        "text_indices": text_at,
    }


def _run(model, inputs):
    return model(**inputs, return_dict=False)


def _assert_close(outputs, expected, tolerance):
    for out, ref in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)


def test_vsa2_matches_the_stock_model_at_density_1():
    dense = _tiny_h3()
    inputs = _inputs()
    reference = _run(dense, inputs)

    # Density 0.995 >= dense_threshold 0.99: the VSA2 path's exact dense fine stage over every
    # key; fresh (zero) gates make it the stock model (projections, qk-norm, rotary, rows).
    state = SparsityState(sparsity=0.005)
    model = enable_vsa2(copy.deepcopy(dense), VSA2Config(backend="torch"), state)
    assert isinstance(model.transformer_blocks[0].attn.processor, MiniMaxVSA2AttnProcessor)
    refiner = model.token_refiner.refiner_blocks[0].attn
    assert not isinstance(refiner.processor, MiniMaxVSA2AttnProcessor)
    _assert_close(_run(model, inputs), reference, 1e-10)
    assert state.pop_density() == 1.0

    # The block-sparse path keeping every segment: its video partial merged with the text and
    # audio partial by their log-sum-exp (float32 in the kernel) is the joint dense attention.
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk", dense_threshold=1.0), state)
    state.sparsity = 1e-6
    _assert_close(_run(model, inputs), reference, 1e-6)
    assert state.pop_density() == pytest.approx(1.0)

    # Sparsity 0 runs the stock processor whatever the (here trained) VSA2 parameters.
    with torch.no_grad():
        for param in vsa2_parameters(model):
            param.normal_(0.0, 0.1)
    state.sparsity = 0.0
    _assert_close(_run(model, inputs), reference, 1e-10)
    state.sparsity = 0.005
    assert not torch.allclose(_run(model, inputs)[0], reference[0])


def test_sparse_forward_backward_reaches_vsa2_parameters():
    model = _tiny_h3(torch.float32)
    inputs = _inputs(torch.float32)
    dense_video = _run(model, inputs)[0]
    state = SparsityState(sparsity=0.5)
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk"), state)
    video, audio = _run(model, inputs)
    assert torch.isfinite(video).all() and not torch.allclose(video, dense_video, atol=1e-4)
    assert state.pop_density() == pytest.approx(0.5)  # top-k: 4 of 8 segments

    ((video - 1.0).square().mean() + audio.square().mean()).backward()
    attn = model.transformer_blocks[0].attn
    for name, param in [
        ("alpha", attn.vsa2.alpha),
        ("to_gate_coarse", attn.vsa2.to_gate_coarse.weight),
        ("to_gate_fine", attn.vsa2.to_gate_fine.weight),
        ("to_k", attn.to_k.weight),
    ]:
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), name
    params = vsa2_parameters(model)
    assert len(params) == 2 * 5  # alpha + 2 weights + 2 biases per block
    assert all(torch.isfinite(p.grad).all() for p in params)


def test_the_order_of_text_and_audio_rows_does_not_change_the_sparse_output():
    # Attention is invariant to the order of its keys: packing audio before text (same rows,
    # same coordinates) must give the same video and audio outputs at sparsity 0.5, which
    # holds only if every row's output is written back to its own place.
    state = SparsityState(sparsity=0.5)
    model = enable_vsa2(_tiny_h3(), VSA2Config(backend="torch", mode="topk"), state)
    with torch.no_grad():
        for param in vsa2_parameters(model):
            param.normal_(0.0, 0.1)
    _assert_close(_run(model, _inputs(audio_first=True)), _run(model, _inputs()), 1e-10)


def test_video_grid_reads_the_raster_grid_and_refuses_other_layouts():
    assert video_grid(_video_positions()) == GRID
    assert video_grid(_video_positions((3, 4, 10))) == (3, 4, 10)
    order = torch.randperm(2 * FRAME, generator=torch.Generator().manual_seed(0))
    shuffled = _video_positions()[order]
    keyframe = torch.cat([_video_positions()[:FRAME], _video_positions()])  # a conditioning frame
    for rows in (shuffled, keyframe, _video_positions()[:-1]):
        with pytest.raises(ValueError, match=r"attention\.enabled=false"):
            video_grid(rows)


def test_a_keyframe_layout_is_refused_at_the_call():
    model = enable_vsa2(_tiny_h3(), VSA2Config(backend="torch"), SparsityState(sparsity=0.5))
    inputs = _inputs()
    inputs["position_ids"][TEXT + AUDIO : TEXT + AUDIO + FRAME, 0] = 99.0  # frame 0 moved
    with pytest.raises(ValueError, match=r"not one \(t, h, w\) grid"):
        _run(model, inputs)


def test_enable_vsa2_wrong_class_disabled_and_repeated():
    with pytest.raises(ValueError, match="MiniMaxH3Transformer3DModel"):
        enable_vsa2(torch.nn.Linear(2, 2), VSA2Config(), SparsityState())
    dense = _tiny_h3()
    enable_vsa2(dense, VSA2Config(enabled=False), SparsityState())
    assert not hasattr(dense.transformer_blocks[0].attn, "vsa2")
    state = SparsityState(sparsity=0.5)
    enable_vsa2(dense, VSA2Config(backend="torch"), state)
    alpha = dense.transformer_blocks[0].attn.vsa2.alpha
    enable_vsa2(dense, VSA2Config(backend="torch", mode="topk"), state)  # keeps the parameters
    assert dense.transformer_blocks[0].attn.vsa2.alpha is alpha
    assert dense.transformer_blocks[0].attn.vsa2.config.mode == "topk"
