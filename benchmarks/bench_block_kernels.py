"""GPU benchmark: the fused Wan block kernels (vsa2_rl.kernels.fused_block) against the unfused
torch math they replace, eager and under ``torch.compile``, at the Wan-1.3B shape.

Profiles of an uncompiled Wan-1.3B RL iteration put the blocks' LayerNorms, adaLN modulation,
RMS qk-norm, RoPE and casts ahead of their matmuls. Each op runs on one bf16 [1, N, 1536]
tensor (N = 32,760: 480p x 81 frames, 21 x 30 x 52 tokens; 12 heads of 128; broadcast float32
modulation as in Wan2.1) three ways: the unfused eager math of ``vsa2_rl.models.wan`` (diffusers'
block and processor), ``torch.compile`` of that math, and the fused kernel. "forward" runs under
``torch.no_grad`` (rollouts), "fwd+bwd" is a forward recorded by autograd and its backward
(training). Then one whole Wan block (diffusers' ``WanTransformerBlock`` at the 1.3B dims, random
weights frozen as under LoRA, 512 text tokens, the VSA2 processor at sparsity 0, i.e. dense
SDPA) eager, unfused against fused. Each number is the median of ``triton.testing.do_bench``
(CUDA events, L2 flushed between runs); "rel. RMS" is the fused output's distance to the eager
one (both bf16). Sub-millisecond medians are noisy (on an H100 one op's varied by up to 2x
between back-to-back runs) and can include gaps in which the GPU waits for the host to launch
autograd's small kernels; the whole-block rows, whose matmuls keep the GPU busy, are the
end-to-end measure.

    python benchmarks/bench_block_kernels.py --out block_kernels.md
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import triton.testing
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from vsa2_rl.attention import SparsityState, TileLayout, VSA2Attention
from vsa2_rl.config import VSA2Config
from vsa2_rl.kernels.fused_block import (
    gated_residual,
    gated_residual_layer_norm,
    gated_residual_layer_norm_torch,
    gated_residual_torch,
    modulated_layer_norm,
    modulated_layer_norm_torch,
    rms_norm_rope,
)
from vsa2_rl.models.wan import (
    VSA2Context,
    WanVSA2AttnProcessor,
    _rotate,
    fused_wan_block_forward,
    wan_block_forward,
)

GRID = (21, 30, 52)  # 480p x 81 frames after Wan's VAE and (1, 2, 2) patches: 32,760 tokens
DIM, HEADS, FFN_DIM, TEXT_TOKENS = 1536, 12, 8960, 512
DEVICE, DTYPE = "cuda", torch.bfloat16


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def rope_tables(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [1, N, 1, D] cos / sin, each angle repeated for its pair (WanRotaryPosEmbed)."""
    angles = torch.rand(tokens, head_dim // 2, device=DEVICE) * 6.3
    cos = angles.cos().repeat_interleave(2, dim=-1)[None, :, None, :]
    return cos, angles.sin().repeat_interleave(2, dim=-1)[None, :, None, :]


def modulated(fn, *chunks: int):
    """fn(*args, *modulation) as a function of (*args, adaln): the block's six [B, 1, C]
    modulation tensors enter as chunks of one float32 [B, 6, C] ``scale_shift_table + temb``,
    as in ``_modulation`` (and a [1, 1, C] leaf would meet pytorch/pytorch#178080 compiled)."""

    def call(*args):
        *args, adaln = args
        parts = adaln.chunk(6, dim=1)
        return fn(*args, *(parts[i] for i in chunks))

    return call


def op_cases(tokens: int) -> dict:
    """name: (unfused eager fn, fused fn, inputs, indices of the inputs that take gradients)."""
    x = torch.randn(1, tokens, DIM, device=DEVICE, dtype=DTYPE)
    y = torch.randn_like(x)
    adaln = 0.1 * torch.randn(1, 6, DIM, device=DEVICE)
    weight, bias = torch.rand(DIM, device=DEVICE) + 0.5, 0.1 * torch.randn(DIM, device=DEVICE)
    weight_q = weight.to(DTYPE)  # attn.norm_q's weight, in the model's dtype
    cos, sin = rope_tables(tokens, DIM // HEADS)

    def qk_norm_rope_unfused(x, w):  # attn.norm_q (torch.nn.RMSNorm), then _rotate
        normed = torch.nn.functional.rms_norm(x, (DIM,), w, 1e-6)
        return _rotate(normed.unflatten(2, (HEADS, -1)), cos, sin)

    return {
        "norm1/norm3 + shift/scale": (
            modulated(modulated_layer_norm_torch, 0, 1), modulated(modulated_layer_norm, 0, 1),
            [x, adaln], (0, 1),
        ),
        "attn1 gated residual + norm2": (
            modulated(lambda x, y, w, b, g: gated_residual_layer_norm_torch(x, y, g, w, b), 2),
            modulated(lambda x, y, w, b, g: gated_residual_layer_norm(x, y, g, w, b), 2),
            [x, y, weight, bias, adaln], (0, 1, 2, 3, 4),
        ),
        "FFN gated residual": (
            modulated(gated_residual_torch, 5), modulated(gated_residual, 5), [x, y, adaln],
            (0, 1, 2),
        ),
        "RMS qk-norm + RoPE (one of q, k)": (
            qk_norm_rope_unfused,
            lambda x, w: rms_norm_rope(x, w, cos, sin, HEADS),
            [x, weight_q], (0, 1),
        ),
    }  # fmt: skip


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def time_forward(fn, inputs, grad_indices=()) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(lambda: fn(*inputs), return_mode="median")


def time_forward_backward(fn, inputs, grad_indices, rep: int = 100) -> float:
    leaves = [t.detach().requires_grad_(i in grad_indices) for i, t in enumerate(inputs)]
    outs = as_tuple(fn(*leaves))
    grads = [torch.randn_like(o) for o in outs]

    def step():
        torch.autograd.backward(as_tuple(fn(*leaves)), grads)

    return triton.testing.do_bench(
        step, rep=rep, grad_to_none=[t for t in leaves if t.requires_grad], return_mode="median"
    )


def op_rows(tokens: int) -> list[str]:
    rows = []
    for name, (unfused, fused, inputs, grad_indices) in op_cases(tokens).items():
        with torch.no_grad():
            error = max(
                rel_rms(f, u)
                for f, u in zip(as_tuple(fused(*inputs)), as_tuple(unfused(*inputs)), strict=True)
            )
        compiled = torch.compile(unfused, dynamic=False)
        for label, timer in (("forward", time_forward), ("fwd+bwd", time_forward_backward)):
            eager_ms, fused_ms = (
                timer(unfused, inputs, grad_indices),
                timer(fused, inputs, grad_indices),
            )
            try:
                compiled_ms = timer(compiled, inputs, grad_indices)
                compiled_cells = f"{compiled_ms:.3f}", f"{compiled_ms / fused_ms:.2f}x"
            except RuntimeError as failure:  # a torch.compile failure leaves the other columns
                print(f"{name} {label} compiled: {failure}", flush=True)
                compiled_cells = "failed", "-"
            rows.append(
                f"| {name} | {label} | {eager_ms:.3f} | {compiled_cells[0]} | {fused_ms:.3f} "
                f"| {eager_ms / fused_ms:.2f}x | {compiled_cells[1]} | {error:.1e} |"
            )
            print(rows[-1], flush=True)
    return rows


def wan_block():
    """A Wan-1.3B block with random frozen weights (as under LoRA) whose attn1 runs the VSA2
    processor at sparsity 0 (dense SDPA), and that processor's context (its ``fused_kernels``
    switches the q/k path)."""
    block = WanTransformerBlock(DIM, FFN_DIM, HEADS, cross_attn_norm=True)
    block = block.to(device=DEVICE, dtype=DTYPE)
    block.scale_shift_table.data = block.scale_shift_table.data.float()  # as diffusers loads it
    context = VSA2Context((1, 2, 2))
    context.layout = TileLayout.from_grid(GRID).prepare(torch.device(DEVICE))
    attn = block.attn1
    attn.vsa2 = VSA2Attention(attn.inner_dim, HEADS, VSA2Config(), SparsityState(sparsity=0.0))
    attn.vsa2.to(device=DEVICE, dtype=DTYPE)
    attn.set_processor(WanVSA2AttnProcessor(context))
    return block.requires_grad_(False), context


def block_rows(tokens: int) -> list[str]:
    block, context = wan_block()
    hidden = torch.randn(1, tokens, DIM, device=DEVICE, dtype=DTYPE)
    text = torch.randn(1, TEXT_TOKENS, DIM, device=DEVICE, dtype=DTYPE)
    temb = torch.randn(1, 6, DIM, device=DEVICE)
    rotary = rope_tables(tokens, DIM // HEADS)

    def run(forward, fused):
        def call(hidden_states):
            context.fused_kernels = fused
            return forward(block, hidden_states, text, temb, rotary)

        return call

    unfused, fused = run(wan_block_forward, False), run(fused_wan_block_forward, True)
    with torch.no_grad():
        error = rel_rms(fused(hidden), unfused(hidden))
    rows = []
    for label, times in (
        ("forward", [time_forward(fn, [hidden]) for fn in (unfused, fused)]),
        (
            "fwd+bwd",
            [time_forward_backward(fn, [hidden], (0,), rep=500) for fn in (unfused, fused)],
        ),
    ):
        eager_ms, fused_ms = times
        rows.append(
            f"| Wan block, dense SDPA | {label} | {eager_ms:.3f} | - | {fused_ms:.3f} "
            f"| {eager_ms / fused_ms:.2f}x | - | {error:.1e} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-block", action="store_true", help="time the ops only")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_block_kernels.py needs a CUDA GPU")
    start = time.perf_counter()
    tokens = TileLayout.from_grid(GRID).num_tokens
    torch.manual_seed(0)
    lines = [
        f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"Wan-1.3B width {DIM} ({HEADS} heads of {DIM // HEADS}), batch 1 x {tokens} tokens, "
        "bf16, modulation [B, 1, C] float32; median ms (triton.testing.do_bench); speed-ups are "
        "eager / fused and compiled / fused",
        "",
        "| op | pass | eager (ms) | compiled (ms) | fused (ms) | vs eager | vs compiled "
        "| rel. RMS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    lines += op_rows(tokens)
    if not args.no_block:
        lines += block_rows(tokens)
    lines += ["", f"{time.perf_counter() - start:.0f} s in all, compiles included"]
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
