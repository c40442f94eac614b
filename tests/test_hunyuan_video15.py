"""VSA2 inside diffusers' HunyuanVideo15Transformer3DModel (vsa2_rl.models.hunyuan_video15)."""

import copy

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from vsa2_rl import kernels
from vsa2_rl.attention import SparsityState, TileLayout, VSA2Attention
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.hunyuan_video15 import (
    HunyuanVSA2AttnProcessor,
    enable_vsa2,
    joint_vsa2_attention,
    vsa2_parameters,
)

TINY_HUNYUAN = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "mlp_ratio": 2.0,
    "text_embed_dim": 16,
    "text_embed_2_dim": 8,
    "image_embed_dim": 8,
    "rope_axes_dim": (4, 6, 6),
}


def _tiny_hunyuan(dtype=torch.float64):
    return HunyuanVideo15Transformer3DModel(**TINY_HUNYUAN).to(dtype)


def _inputs(latent_thw=(3, 4, 6), dtype=torch.float64, image=False):
    """Batch of 2 with padded text: MLLM tokens 5 and 2 of 7 valid, ByT5 3 and 0 of 4; image
    tokens all valid (image) or, with zero image embeddings, all masked (text-to-video)."""
    batch = 2
    mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 2 + [0] * 5])
    mask_2 = torch.tensor([[1] * 3 + [0], [0] * 4])
    image_embeds = torch.randn(batch, 3, 8, dtype=dtype)
    return {
        "hidden_states": torch.randn(batch, 4, *latent_thw, dtype=dtype),
        "timestep": torch.tensor([700.0, 30.0], dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, 7, 16, dtype=dtype),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": torch.randn(batch, 4, 8, dtype=dtype),
        "encoder_attention_mask_2": mask_2,
        "image_embeds": image_embeds if image else torch.zeros_like(image_embeds),
    }


def _run(model, inputs):
    return model(**inputs, return_dict=False)[0]


# --------------------------------------------------------------------------------------------
# Whole model


# (dtype, tolerance of the exact paths, of the block-sparse path): the kernel's LSE is float32
# also for float64 inputs, so its merge with the text partial is exact to float32 rounding.
TOLERANCES = [(torch.float64, 1e-10, 1e-6), (torch.float32, 1e-5, 1e-5)]


@pytest.mark.parametrize(("dtype", "exact", "merged"), TOLERANCES)
@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("latent_thw", [(3, 4, 6), (4, 4, 4)])
def test_vsa2_matches_stock_model_at_density_1(latent_thw, image, dtype, exact, merged):
    dense = _tiny_hunyuan(dtype)
    inputs = _inputs(latent_thw, dtype=dtype, image=image)
    reference = _run(dense, inputs)

    # Density 0.995 >= dense_threshold 0.99: the exact-dense fine stage over video and text
    # keys; fresh (zero-init) gates make it the stock model. The padded text tokens are not
    # zero in the blocks (AdaLN shifts them), so ignoring the mask would show here.
    state = SparsityState(sparsity=0.005)
    model = enable_vsa2(copy.deepcopy(dense), VSA2Config(backend="torch"), state)
    assert isinstance(model.transformer_blocks[0].attn.processor, HunyuanVSA2AttnProcessor)
    refiner = model.context_embedder.token_refiner.refiner_blocks[0].attn
    assert not isinstance(refiner.processor, HunyuanVSA2AttnProcessor)
    torch.testing.assert_close(_run(model, inputs), reference, rtol=exact, atol=exact)
    assert state.pop_density() == 1.0

    # The block-sparse path selecting every segment: its video partial and the text partial
    # merged by their log-sum-exp are the joint dense attention.
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk", dense_threshold=1.0), state)
    state.sparsity = 1e-6  # budget ceil((1 - 1e-6) * n) = n segments
    torch.testing.assert_close(_run(model, inputs), reference, rtol=merged, atol=merged)
    assert state.pop_density() == pytest.approx(1.0)

    # Sparsity exactly 0 is the stock model whatever the (here trained) VSA2 parameters.
    with torch.no_grad():
        for param in vsa2_parameters(model):
            param.normal_(0.0, 0.1)
    state.sparsity = 0.0
    torch.testing.assert_close(_run(model, inputs), reference, rtol=exact, atol=exact)
    state.sparsity = 0.005
    assert not torch.allclose(_run(model, inputs), reference)


def test_sparse_forward_backward_reaches_vsa2_parameters():
    model = _tiny_hunyuan(dtype=torch.float32)
    dense_out = _run(model, _inputs((4, 4, 8), dtype=torch.float32))
    state = SparsityState(sparsity=0.5)
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk"), state)
    inputs = _inputs((4, 4, 8), dtype=torch.float32)  # grid 4x4x8: 2 tiles, 8 segments
    out = _run(model, inputs)
    assert torch.isfinite(out).all() and not torch.allclose(out, dense_out, atol=1e-4)
    assert state.pop_density() == pytest.approx(0.5)  # topk budget ceil(0.5 * 8) = 4 of 8

    (out - torch.randn_like(out)).square().mean().backward()
    attn = model.transformer_blocks[0].attn
    for name, param in [
        ("alpha", attn.vsa2.alpha),
        ("to_gate_coarse", attn.vsa2.to_gate_coarse.weight),
        ("to_gate_fine", attn.vsa2.to_gate_fine.weight),
        ("to_k", attn.to_k.weight),
        ("add_k_proj", attn.add_k_proj.weight),
    ]:
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), name
    params = vsa2_parameters(model)
    assert len(params) == 2 * 5  # alpha + 2 weights + 2 biases per block
    assert all(torch.isfinite(p.grad).all() for p in params)


def test_enable_vsa2_wrong_class_disabled_and_repeated():
    with pytest.raises(ValueError, match=r"HunyuanVideo15Transformer3DModel.*Linear"):
        enable_vsa2(torch.nn.Linear(2, 2), VSA2Config(), SparsityState())
    model = _tiny_hunyuan()
    enable_vsa2(model, VSA2Config(enabled=False), SparsityState())
    assert not hasattr(model.transformer_blocks[0].attn, "vsa2")
    state = SparsityState()
    enable_vsa2(model, VSA2Config(), state)
    alpha = model.transformer_blocks[0].attn.vsa2.alpha
    enable_vsa2(model, VSA2Config(kv_block=32), state)
    assert model.transformer_blocks[0].attn.vsa2.alpha is alpha
    assert model.transformer_blocks[0].attn.vsa2.config.kv_block == 32
    assert len(model._forward_pre_hooks) == 1
    with pytest.raises(ValueError, match="token grid"):  # the attention without the model
        model.transformer_blocks[0].attn(
            torch.randn(1, 8, 32, dtype=torch.float64),
            torch.randn(1, 3, 32, dtype=torch.float64),
            attention_mask=torch.ones(1, 3, dtype=torch.bool),
            image_rotary_emb=(torch.ones(8, 16), torch.zeros(8, 16)),
        )


# --------------------------------------------------------------------------------------------
# Joint attention of the video queries


def _qkv(tokens, text, heads=2, head_dim=16, dtype=torch.float64):
    def randn(n):
        return torch.randn(2, n, heads, head_dim, dtype=dtype)

    return randn(tokens), randn(tokens), randn(tokens), randn(text), randn(text)


def _vsa2_module(config, state, dim=32, heads=2):
    module = VSA2Attention(dim, heads, config, state).double()
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.1)
    return module


@pytest.mark.parametrize("sparsity", [0.5, 0.005])
def test_joint_attention_without_valid_text_is_vsa2(sparsity):
    # No valid text key: the joint attention must be VSA2Attention's own (coarse stage, router
    # bias, gates), both sparse and in the dense fallback.
    layout = TileLayout.from_grid((3, 4, 10))  # 120 tokens: 2 tiles, 8 segments
    state = SparsityState(sparsity)
    module = _vsa2_module(VSA2Config(backend="torch", mode="topk"), state)
    q, k, v, text_k, text_v = _qkv(120, 5)
    hidden = torch.randn(2, 120, 32, dtype=torch.float64)
    no_text = torch.zeros(2, 5, dtype=torch.bool)
    out = joint_vsa2_attention(module, q, k, v, hidden, layout, text_k, text_v, no_text)
    torch.testing.assert_close(out, module(q, k, v, hidden, layout), rtol=1e-10, atol=1e-10)


def test_joint_attention_matches_a_hand_built_block_mask():
    # Independent reference of the sparse fine stage: one dense softmax per query over the
    # video keys of the segments the router picked (plus its bias) and the valid text keys.
    layout = TileLayout.from_grid((3, 4, 10))  # 120 tokens: 2 tiles, 8 segments of 16
    config = VSA2Config(backend="torch", mode="topk")
    state = SparsityState(0.5)
    module = _vsa2_module(config, state)
    with torch.no_grad():  # g_f = 1, g_c = 0: the output is the fine stage
        for linear in (module.to_gate_coarse, module.to_gate_fine):
            linear.weight.zero_()
            linear.bias.zero_()
    q, k, v, text_k, text_v = _qkv(120, 5)
    hidden = torch.randn(2, 120, 32, dtype=torch.float64)
    text_valid = torch.tensor([[True] * 3 + [False] * 2, [True] + [False] * 4])
    out = joint_vsa2_attention(module, q, k, v, hidden, layout, text_k, text_v, text_valid)

    qt, kt, vt = (layout.tile(x).transpose(1, 2) for x in (q, k, v))  # (B, H, 128, D)
    tile_lengths, seg_lengths = layout.lengths(16, q.device)
    routing = kernels.route(
        kernels.pool_tiles(qt, tile_lengths, 64, backend="torch"),
        kernels.pool_tiles(kt, seg_lengths, 16, backend="torch"),
        seg_lengths, sparsity=0.5, mode="topk", top_p=config.top_p, min_kv=1, backend="torch",
    )  # fmt: skip
    video_terms = torch.full((2, 2, 2, 128), float("-inf"), dtype=torch.float64)  # (B, H, NQ, S)
    for b, h, tile in torch.cartesian_prod(*(torch.arange(n) for n in (2, 2, 2))).tolist():
        for slot in range(int(routing.kv_counts[b, h, tile])):
            seg = int(routing.kv_indices[b, h, tile, slot])
            bias = float(module.alpha[h].detach() * routing.log_probs[b, h, tile, slot])
            video_terms[b, h, tile, seg * 16 : seg * 16 + 16] = bias
    video_terms[..., 120:] = float("-inf")  # padding of the last tile
    text_terms = torch.where(text_valid, 0.0, float("-inf")).double()[:, None, None, :]
    terms = torch.cat(
        [video_terms.repeat_interleave(64, dim=2), text_terms.expand(-1, 2, 128, -1)], 3
    )
    keys = torch.cat([kt, text_k.transpose(1, 2)], dim=2)
    values = torch.cat([vt, text_v.transpose(1, 2)], dim=2)
    logits = qt @ keys.transpose(2, 3) / 4.0 + terms  # head_dim 16
    expected = layout.untile((torch.softmax(logits, dim=-1) @ values).transpose(1, 2))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # float32 LSE of the kernel
    assert state.pop_density() == pytest.approx(float(routing.density))


def test_joint_attention_triton_matches_torch_forward_and_backward():
    # On CPU the Triton kernels run under the interpreter (tests/conftest.py sets it); the
    # merge then takes the gradient of the Triton kernel's LSE.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layout = TileLayout.from_grid((4, 4, 8))  # 128 tokens: 2 tiles, 8 segments
    state = SparsityState(0.5)
    module = _vsa2_module(VSA2Config(), state).float().to(device)
    inputs = [x.float().to(device) for x in _qkv(128, 5)]
    hidden = torch.randn(2, 128, 32, device=device)
    text_valid = torch.tensor([[True] * 3 + [False] * 2, [True] + [False] * 4], device=device)
    results = []
    for backend in ("torch", "triton"):
        module.config = VSA2Config(backend=backend, mode="topk")
        leaves = [x.clone().requires_grad_() for x in inputs]
        q, k, v, text_k, text_v = leaves
        out = joint_vsa2_attention(module, q, k, v, hidden, layout, text_k, text_v, text_valid)
        module.zero_grad()
        out.square().sum().backward()
        results.append([out, *(x.grad for x in leaves), module.alpha.grad.clone()])
    for torch_result, triton_result in zip(*results, strict=True):
        torch.testing.assert_close(triton_result, torch_result, rtol=1e-4, atol=1e-4)


def test_conditioning_partial_in_chunks_matches_one_pass(monkeypatch):
    """The chunked, checkpointed conditioning partial gives the one-pass attention's outputs,
    log-sum-exps and gradients (float64), a sample without a valid key included, where the
    reference is a plain softmax written here."""
    from vsa2_rl.models import hunyuan_video15

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64, requires_grad=True) for n in (37, 5, 5))
    key_valid = torch.tensor([[True, True, False, True, False], [False] * 5])
    # chunks of 2 * 3 * 5 * 4 logits: 4 query rows, the last chunk 1 row
    monkeypatch.setattr(hunyuan_video15, "PARTIAL_CHUNK_ELEMENTS", 2 * 3 * 5 * 4)
    out, lse = hunyuan_video15._partial_attention(q, k, v, key_valid)
    (out[0].sin().sum() + lse[0].cos().sum()).backward()
    grads = [x.grad.clone() for x in (q, k, v)]

    logits = (q[0] @ k[0].transpose(-1, -2)) / 8**0.5
    logits = logits.masked_fill(~key_valid[0], float("-inf"))
    ref_out, ref_lse = torch.softmax(logits, -1) @ v[0], torch.logsumexp(logits, -1)
    torch.testing.assert_close(out[0], ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[0], ref_lse, rtol=1e-12, atol=1e-12)
    assert torch.isneginf(lse[1]).all()
    for x in (q, k, v):
        x.grad = None
    (ref_out.sin().sum() + ref_lse.cos().sum()).backward()
    for grad, x in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-12)
