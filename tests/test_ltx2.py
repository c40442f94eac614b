"""VSA2 inside diffusers' LTX2VideoTransformer3DModel (vsa2_rl.models.ltx2), on a tiny random
model: the stock model at density 1 (both rotary layouts, with and without output gates),
VSA2's own attention at sparsity 0.5, gradients and the refused calls."""

import copy

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from vsa2_rl.attention import SparsityState, TileLayout
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.ltx2 import LTX2VSA2AttnProcessor, enable_vsa2, vsa2_parameters

TINY_LTX2 = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "cross_attention_dim": 32,
    "audio_in_channels": 4,
    "audio_out_channels": 4,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 8,
    "audio_cross_attention_dim": 16,
    "num_layers": 2,
    "caption_channels": 8,
}
GRID = (2, 4, 16)  # 128 video tokens: 2 tiles of 64, 8 segments of 16


def _tiny_ltx2(dtype=torch.float64, **changes):
    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(**(TINY_LTX2 | changes)).to(dtype)


def _inputs(dtype=torch.float64):
    generator = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    frames, height, width = GRID
    return {
        "hidden_states": randn(2, frames * height * width, 4),
        "audio_hidden_states": randn(2, 5, 4),
        "encoder_hidden_states": randn(2, 7, 8),
        "audio_encoder_hidden_states": randn(2, 7, 8),
        "timestep": torch.tensor([700.0, 30.0], dtype=dtype),
        "num_frames": frames,
        "height": height,
        "width": width,
        "audio_num_frames": 5,
    }


def _run(model, inputs):
    return model(**inputs, return_dict=False)


def _assert_close(outputs, expected, tolerance):
    for out, ref in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("changes", [{}, {"rope_type": "split", "gated_attn": True}])
def test_vsa2_matches_the_stock_model_at_density_1(changes):
    dense = _tiny_ltx2(**changes)
    if changes:  # gates that matter: zero logits would make every gate exactly 1
        with torch.no_grad():
            for block in dense.transformer_blocks:
                block.attn1.to_gate_logits.weight.normal_(0.0, 0.5)
    inputs = _inputs()
    reference = _run(dense, inputs)

    # Density 0.995 >= dense_threshold 0.99: VSA2's exact dense fine stage; fresh (zero) gates
    # and alpha make it the stock model (projections, qk-norm, rotary, output gates).
    state = SparsityState(sparsity=0.005)
    model = enable_vsa2(copy.deepcopy(dense), VSA2Config(backend="torch"), state)
    block = model.transformer_blocks[0]
    assert isinstance(block.attn1.processor, LTX2VSA2AttnProcessor)
    assert not isinstance(block.audio_attn1.processor, LTX2VSA2AttnProcessor)
    _assert_close(_run(model, inputs), reference, 1e-10)
    assert state.pop_density() == 1.0

    # VSA2's block-sparse path keeping every segment is the dense attention too.
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk", dense_threshold=1.0), state)
    state.sparsity = 1e-6
    _assert_close(_run(model, inputs), reference, 1e-6)

    # Sparsity 0 runs the stock processor whatever the (here trained) VSA2 parameters.
    with torch.no_grad():
        for param in vsa2_parameters(model):
            param.normal_(0.0, 0.1)
    state.sparsity = 0.0
    _assert_close(_run(model, inputs), reference, 1e-10)
    state.sparsity = 0.005
    assert not torch.allclose(_run(model, inputs)[0], reference[0])


def test_the_sparse_attention_is_vsa2s_own_on_the_raster_grid():
    # One attn1 call at sparsity 0.5 against VSA2Attention run by hand on the processor's
    # projected, normed and rotated q, k, v: the grid and the rows' order are the call's.
    state = SparsityState(sparsity=0.5)
    model = enable_vsa2(_tiny_ltx2(), VSA2Config(backend="torch", mode="topk"), state)
    attn = model.transformer_blocks[0].attn1
    with torch.no_grad():
        for param in vsa2_parameters(model):
            param.normal_(0.0, 0.1)
    seen = {}
    attn.register_forward_hook(
        lambda module, args, kwargs, out: seen.update(kwargs, out=out), with_kwargs=True
    )
    model(**_inputs(), return_dict=False)
    hidden, rotary = seen["hidden_states"], seen["query_rotary_emb"]
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb

    q, k = (
        apply_interleaved_rotary_emb(norm(proj(hidden)), rotary).unflatten(2, (2, -1))
        for norm, proj in ((attn.norm_q, attn.to_q), (attn.norm_k, attn.to_k))
    )
    v = attn.to_v(hidden).unflatten(2, (2, -1))
    expected = attn.vsa2(q, k, v, hidden, TileLayout.from_grid(GRID))
    expected = attn.to_out[0](expected.flatten(2))
    torch.testing.assert_close(seen["out"], expected, rtol=1e-10, atol=1e-10)
    assert state.pop_density() == pytest.approx(0.5)


def test_sparse_forward_backward_reaches_vsa2_parameters():
    model = _tiny_ltx2(torch.float32)
    inputs = _inputs(torch.float32)
    dense_video = _run(model, inputs)[0]
    state = SparsityState(sparsity=0.5)
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk"), state)
    video, audio = _run(model, inputs)
    assert torch.isfinite(video).all() and not torch.allclose(video, dense_video, atol=1e-5)
    ((video - 1.0).square().mean() + audio.square().mean()).backward()
    attn = model.transformer_blocks[0].attn1
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


def test_refused_models_and_calls():
    with pytest.raises(ValueError, match="LTX2VideoTransformer3DModel"):
        enable_vsa2(torch.nn.Linear(2, 2), VSA2Config(), SparsityState())
    with pytest.raises(ValueError, match="perturbed attention"):
        enable_vsa2(_tiny_ltx2(perturbed_attn=True), VSA2Config(), SparsityState())
    model = enable_vsa2(_tiny_ltx2(), VSA2Config(backend="torch"), SparsityState(sparsity=0.5))
    inputs = _inputs()
    frames, height, width = (inputs.pop(key) for key in ("num_frames", "height", "width"))
    inputs["video_coords"] = model.rope.prepare_video_coords(2, frames, height, width, "cpu")
    with pytest.raises(ValueError, match="num_frames, height and width"):
        _run(model, inputs)
    dense = _tiny_ltx2()
    enable_vsa2(dense, VSA2Config(enabled=False), SparsityState())
    assert not hasattr(dense.transformer_blocks[0].attn1, "vsa2")
