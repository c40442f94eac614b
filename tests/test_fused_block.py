"""Fused Wan block kernels (vsa2_rl.kernels.fused_block) and their use in the Wan blocks.

Each op's forward and every gradient are compared with float64 math written here from
torch.nn.functional and complex multiplication, independent of the module's own references, at
small awkward sizes (odd token counts, C not a power of two) with broadcast ([B, 1, C]) and
per-token ([B, N, C]) modulation. On CPU the Triton kernels run under ``TRITON_INTERPRET=1``
(tests/conftest.py) in fp32; the ``gpu`` tests run bf16 at the Wan-1.3B width and bound the
kernels' error against float64 by the unfused bf16 math's error. The fused Wan block and the
fused model must equal the unfused ones, forward and gradients.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from test_models import _inputs, _outputs_and_grads, _perturbed_vsa2_wan, _run

from vsa2_rl.kernels.fused_block import (
    _GatedResidualNorm,
    _ModulatedLayerNorm,
    _RMSNormRoPE,
    gated_residual,
    gated_residual_layer_norm,
    gated_residual_layer_norm_torch,
    gated_residual_torch,
    modulated_layer_norm,
    modulated_layer_norm_torch,
    rms_norm_rope,
    rms_norm_rope_torch,
)
from vsa2_rl.models.wan import fuse_block_kernels, fused_wan_block_forward, wan_block_forward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def outputs_and_grads(fn, inputs, upstream):
    """fn's outputs and the gradients of sum(out * upstream) w.r.t. inputs (all leaves)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * g).sum() for o, g in zip(outs, upstream, strict=True))
    return [o.detach() for o in outs], torch.autograd.grad(loss, inputs)


def assert_matches(got, want, tol):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert torch.isfinite(a).all(), i
        assert rel_rms(a, b) < tol, (i, rel_rms(a, b))


# -- float64 math, written independently of the module ---------------------------------------------


def modulated_ln_64(x, shift, scale):
    return F.layer_norm(x.double(), (x.shape[-1],), eps=EPS) * (1 + scale) + shift


def gated_residual_ln_64(x, y, gate, weight, bias):
    h = x.double() + y.double() * gate
    return h, F.layer_norm(h, (h.shape[-1],), weight, bias, EPS)


def rms_rope_64(x, weight, angles, heads):
    """RMSNorm over all heads, then each pair (2j, 2j + 1) of a head as the complex number
    x[2j] + i x[2j+1] times exp(i angle_j); angles [N, D / 2]."""
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * weight
    pairs = torch.view_as_complex(normed.unflatten(-1, (heads, -1, 2)).contiguous())
    turned = pairs * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.view_as_real(turned).flatten(-2)


def wan_tables(angles: torch.Tensor):
    """diffusers' WanRotaryPosEmbed layout: [1, N, 1, D], each angle's cos / sin repeated for
    both channels of its pair."""
    cos = angles.cos().repeat_interleave(2, dim=-1)[None, :, None, :]
    sin = angles.sin().repeat_interleave(2, dim=-1)[None, :, None, :]
    return cos, sin


def modulation(B, N, C, per_token, device=DEVICE):
    return torch.randn(B, N if per_token else 1, C, device=device)


# -- ops against float64 ---------------------------------------------------------------------------


@pytest.mark.nan_empty
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("B,N,C", [(2, 7, 48), (1, 13, 40)])
def test_modulated_layer_norm_matches_float64(B, N, C, per_token, backend):
    x = torch.randn(B, N, C, device=DEVICE) * 3 + 1
    # chunks of one [B, N?, 2, C] tensor, as the block's modulation: strided views
    table = torch.randn(B, N if per_token else 1, 2, C, device=DEVICE)
    shift, scale = table.unbind(2)
    up = [torch.randn(B, N, C, device=DEVICE, dtype=torch.float64)]
    inputs = leaves(x, shift, scale)
    got = outputs_and_grads(
        lambda x, s, c: modulated_layer_norm(x, s, c, EPS, backend=backend), inputs, up
    )
    want = outputs_and_grads(modulated_ln_64, leaves(*(t.double() for t in inputs)), up)
    assert_matches([*got[0], *got[1]], [*want[0], *want[1]], 1e-5)


@pytest.mark.nan_empty
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("B,N,C", [(2, 7, 48), (1, 13, 40)])
def test_gated_residual_layer_norm_matches_float64(B, N, C, per_token, backend):
    x, y = torch.randn(B, N, C, device=DEVICE), torch.randn(B, N, C, device=DEVICE)
    gate = modulation(B, N, C, per_token)
    weight, bias = torch.randn(C, device=DEVICE), torch.randn(C, device=DEVICE)
    up = [torch.randn(B, N, C, device=DEVICE, dtype=torch.float64) for _ in range(2)]
    inputs = leaves(x, y, gate, weight, bias)
    got = outputs_and_grads(
        lambda *a: gated_residual_layer_norm(*a, EPS, backend=backend), inputs, up
    )
    want = outputs_and_grads(gated_residual_ln_64, leaves(*(t.double() for t in inputs)), up)
    assert_matches([*got[0], *got[1]], [*want[0], *want[1]], 1e-5)


@pytest.mark.nan_empty
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gated_residual_matches_float64(per_token, backend):
    B, N, C = 2, 9, 24
    x, y = torch.randn(B, N, C, device=DEVICE), torch.randn(B, N, C, device=DEVICE)
    gate = modulation(B, N, C, per_token)
    up = [torch.randn(B, N, C, device=DEVICE, dtype=torch.float64)]
    inputs = leaves(x, y, gate)
    got = outputs_and_grads(lambda *a: gated_residual(*a, backend=backend), inputs, up)
    want = outputs_and_grads(lambda x, y, g: x + y * g, leaves(*(t.double() for t in inputs)), up)
    assert_matches([*got[0], *got[1]], [*want[0], *want[1]], 1e-6)


@pytest.mark.nan_empty
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("B,N,heads,D", [(2, 7, 3, 16), (1, 11, 2, 8)])
def test_rms_norm_rope_matches_float64(B, N, heads, D, backend):
    C = heads * D
    x = torch.randn(B, N, C, device=DEVICE) * 2
    weight = torch.randn(C, device=DEVICE)
    angles = torch.rand(N, D // 2, device=DEVICE, dtype=torch.float64) * 6.3
    # a token slice of a longer table (what sequence parallelism passes): strided views
    cos, sin = (t[:, 1:] for t in wan_tables(torch.cat([torch.zeros_like(angles[:1]), angles])))
    up = [torch.randn(B, N, heads, D, device=DEVICE, dtype=torch.float64)]
    inputs = leaves(x, weight)
    got = outputs_and_grads(
        lambda x, w: rms_norm_rope(x, w, cos.float(), sin, heads, EPS, backend=backend),
        inputs,
        up,
    )
    want = outputs_and_grads(
        lambda x, w: rms_rope_64(x, w, angles, heads), leaves(*(t.double() for t in inputs)), up
    )
    assert_matches([*got[0], *got[1]], [*want[0], *want[1]], 1e-5)


def test_references_are_the_unfused_wan_math():
    """The ``*_torch`` references (the path on CPU and under torch.compile) are diffusers' block
    and processor math: its FP32LayerNorms, RMSNorm and _rotate."""
    from vsa2_rl.models.wan import _rotate

    B, N, heads, D = 2, 5, 2, 8
    block = WanTransformerBlock(heads * D, 32, heads, cross_attn_norm=True)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, y = torch.randn(B, N, heads * D), torch.randn(B, N, heads * D)
    shift, scale, gate = torch.randn(3, B, 1, heads * D)
    angles = torch.rand(N, D // 2, dtype=torch.float64)
    cos, sin = (t.float() for t in wan_tables(angles))
    norm_q, norm2 = block.attn1.norm_q, block.norm2
    h = (x.float() + y * gate).type_as(x)
    cases = [
        (modulated_layer_norm_torch(x, shift, scale), block.norm1(x) * (1 + scale) + shift),
        (gated_residual_torch(x, y, gate), h),
        (gated_residual_layer_norm_torch(x, y, gate, norm2.weight, norm2.bias)[1], norm2(h)),
        (
            rms_norm_rope_torch(x, norm_q.weight, cos, sin, heads),
            _rotate(norm_q(x).unflatten(2, (heads, -1)), cos, sin),
        ),
    ]
    for got, want in cases:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_rejected_with_the_shapes_in_the_message():
    x = torch.randn(2, 5, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[B, 1, C\] or \[B, N, C\]"):
        modulated_layer_norm(x, torch.zeros(2, 3, 16), torch.zeros(2, 3, 16), backend="triton")
    with pytest.raises(ValueError, match="even head dim"):
        rms_norm_rope(x, torch.ones(16), *torch.ones(2, 1, 5, 1, 5), heads=3)
    with pytest.raises(ValueError, match=r"\[1, 5, 1, 8\]"):
        rms_norm_rope(x, torch.ones(16), *torch.ones(2, 1, 5, 1, 4), heads=2)


# -- the fused Wan block ---------------------------------------------------------------------------


def count_triton_launches(monkeypatch) -> list:
    """A list that grows by one at each call of a fused op's Triton autograd Function."""
    launches = []
    for function in (_GatedResidualNorm, _ModulatedLayerNorm, _RMSNormRoPE):
        monkeypatch.setattr(
            function, "apply", lambda *a, _apply=function.apply: launches.append(1) or _apply(*a)
        )
    return launches


def test_fused_kernels_and_compiled_blocks_are_refused_together():
    from vsa2_rl.config import ConfigError
    from vsa2_rl.config.model import ModelConfig

    assert ModelConfig(fused_kernels=True).fused_kernels
    with pytest.raises(ConfigError, match=r"model\.fused_kernels: .*model\.compile_blocks=true"):
        ModelConfig(fused_kernels=True, compile_blocks=True)


@pytest.mark.parametrize("per_token_temb", [False, True])
@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_fused_block_forward_equals_the_unfused_one(per_token_temb, cross_attn_norm):
    """fused_wan_block_forward against wan_block_forward (itself equal to diffusers' forward),
    fp32, Wan2.1 temb [B, 6, C] and Wan2.2-TI2V per-token temb [B, N, 6, C]."""
    dim, heads, tokens = 48, 2, 11
    block = WanTransformerBlock(dim, 64, heads, cross_attn_norm=cross_attn_norm).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():  # affine norms and biases away from their 1 / 0 init
            p.add_(0.1 * torch.randn_like(p))
    hidden = torch.randn(2, tokens, dim, device=DEVICE, requires_grad=True)
    text = torch.randn(2, 5, dim, device=DEVICE)
    temb_shape = (2, *((tokens,) if per_token_temb else ()), 6, dim)
    temb = torch.randn(temb_shape, device=DEVICE, requires_grad=True)
    angles = torch.rand(tokens, dim // heads // 2, device=DEVICE) * 6.3
    rotary = wan_tables(angles)
    upstream = torch.randn(2, tokens, dim, device=DEVICE)
    results = []
    for forward in (wan_block_forward, fused_wan_block_forward):
        out = forward(block, hidden, text, temb, rotary)
        params = [hidden, temb, *block.parameters()]
        results.append((out, torch.autograd.grad((out * upstream).sum(), params)))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)


def test_fused_vsa2_wan_equals_the_unfused_model(monkeypatch):
    """fuse_block_kernels on the tiny VSA2 Wan: the blocks' fused forward and the processor's
    fused qk-norm + RoPE give the unfused model's outputs and gradients; a deep copy (the
    frozen reference policy) stays fused."""
    launches = count_triton_launches(monkeypatch)
    eager = _perturbed_vsa2_wan(torch.float32, device=DEVICE)
    model = fuse_block_kernels(copy.deepcopy(eager))
    assert model._vsa2_context.fused_kernels and not eager._vsa2_context.fused_kernels
    # a 4 x 2 x 4 token grid (32 tokens: the interpreter runs one program a token), batch 2
    inputs = [x.to(DEVICE) for x in _inputs(dtype=torch.float32, latent_thw=(4, 4, 8))]
    got, want = _outputs_and_grads(model, inputs), _outputs_and_grads(eager, inputs)
    # per block: norm1, attn1 residual + norm2, norm3, FFN residual, q and k: the Triton path
    assert len(launches) == 6 * len(model.blocks)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-3, atol=1e-5)
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.args[0] is twin.blocks[0]
    assert twin._vsa2_context.fused_kernels
    with torch.no_grad():
        torch.testing.assert_close(_run(twin, inputs), got[0])


@pytest.mark.slow
def test_a_compiled_fused_model_traces_the_unfused_math(monkeypatch):
    """Under torch.compile the fused functions run their torch references (inductor fuses those
    itself): a compiled fused model gives the eager model's outputs and gradients, with no
    Triton Function in the graph."""
    eager = _perturbed_vsa2_wan(torch.float32)
    model = fuse_block_kernels(copy.deepcopy(eager))
    inputs = _inputs(dtype=torch.float32, latent_thw=(4, 4, 8))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    launches = count_triton_launches(monkeypatch)
    got, want = _outputs_and_grads(compiled, inputs), _outputs_and_grads(eager, inputs)
    assert not launches
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-3, atol=1e-5)


# -- GPU, bf16 at the Wan-1.3B width ---------------------------------------------------------------


def _bf16_errors(fused, unfused, exact, inputs, upstream):
    """rel. RMS errors against float64 of the fused op and the unfused bf16 math, per output
    and gradient."""
    results = [outputs_and_grads(fn, leaves(*inputs), upstream) for fn in (fused, unfused)]
    want = outputs_and_grads(exact, leaves(*(t.double() for t in inputs)), upstream)
    want = [*want[0], *want[1]]
    return [[rel_rms(a, b) for a, b in zip([*r[0], *r[1]], want, strict=True)] for r in results]


def _assert_within_eager_error(errors):
    fused, eager = errors
    for i, (f, e) in enumerate(zip(fused, eager, strict=True)):
        assert f < 2e-2, (i, f)
        assert f <= 1.5 * e + 1e-3, (i, f, e)  # no worse than the unfused bf16 math


@pytest.mark.gpu
@pytest.mark.nan_empty
@pytest.mark.parametrize("per_token", [False, True])
def test_gpu_bf16_layer_norms_within_the_eager_error(per_token):
    B, N, C = 1, 4097, 1536
    x = (torch.randn(B, N, C, device="cuda") * 2).bfloat16()
    shift, scale, gate = (modulation(B, N, C, per_token, device="cuda") for _ in range(3))
    y = torch.randn(B, N, C, device="cuda").bfloat16()
    weight, bias = torch.randn(C, device="cuda"), torch.randn(C, device="cuda")
    up = [torch.randn(B, N, C, device="cuda", dtype=torch.float64) for _ in range(2)]
    _assert_within_eager_error(
        _bf16_errors(
            modulated_layer_norm, modulated_layer_norm_torch, modulated_ln_64,
            [x, shift, scale], up[:1],
        )
    )  # fmt: skip
    _assert_within_eager_error(
        _bf16_errors(
            gated_residual_layer_norm, gated_residual_layer_norm_torch, gated_residual_ln_64,
            [x, y, gate, weight, bias], up,
        )
    )  # fmt: skip
    _assert_within_eager_error(
        _bf16_errors(
            gated_residual, gated_residual_torch, lambda x, y, g: x + y * g, [x, y, gate], up[:1]
        )
    )


@pytest.mark.gpu
@pytest.mark.nan_empty
def test_gpu_bf16_rms_norm_rope_within_the_eager_error():
    B, N, heads, D = 1, 4097, 12, 128
    x = torch.randn(B, N, heads * D, device="cuda").bfloat16()
    weight = (torch.rand(heads * D, device="cuda") + 0.5).bfloat16()
    angles = torch.rand(N, D // 2, device="cuda", dtype=torch.float64) * 6.3
    cos, sin = (t.float() for t in wan_tables(angles))
    up = [torch.randn(B, N, heads, D, device="cuda", dtype=torch.float64)]
    _assert_within_eager_error(
        _bf16_errors(
            lambda x, w: rms_norm_rope(x, w, cos, sin, heads),
            lambda x, w: rms_norm_rope_torch(x, w, cos, sin, heads),
            lambda x, w: rms_rope_64(x, w, angles, heads),
            [x, weight],
            up,
        )
    )
