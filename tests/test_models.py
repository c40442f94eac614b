"""VSA2 inside diffusers' WanTransformer3DModel and the Wan bundle loader."""

import copy

import pytest
import torch
from diffusers import WanTransformer3DModel

from vsa2_rl.attention import SparsityState, TileLayout, VSA2Attention
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.wan import WanVSA2AttnProcessor, enable_vsa2, vsa2_parameters
from vsa2_rl.models.wan_bundle import VideoDiTBundle, load_wan_bundle

TINY_WAN = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}


def _tiny_wan(dtype=torch.float64, **overrides):
    return WanTransformer3DModel(**{**TINY_WAN, **overrides}).to(dtype)


def _inputs(latent_thw=(5, 6, 10), batch=2, dtype=torch.float64, channels=4):
    latents = torch.randn(batch, channels, *latent_thw, dtype=dtype)
    timestep = torch.tensor([700.0, 30.0][:batch], dtype=dtype)
    text = torch.randn(batch, 7, TINY_WAN["text_dim"], dtype=dtype)
    return latents, timestep, text


def _run(model, inputs):
    latents, timestep, text = inputs
    return model(latents, timestep, text, return_dict=False)[0]


# --------------------------------------------------------------------------------------------
# Processor


@pytest.mark.parametrize("latent_thw", [(5, 6, 10), (4, 8, 8), (1, 2, 2)])
def test_vsa2_matches_stock_dense_attention_at_density_1(latent_thw):
    dense = _tiny_wan()
    inputs = _inputs(latent_thw)
    reference = _run(dense, inputs)

    # Density 0.995 >= dense_threshold 0.99: VSA2 with its exact-dense fine stage; fresh
    # (zero-init) gates make it the dense model.
    state = SparsityState(sparsity=0.005)
    model = enable_vsa2(copy.deepcopy(dense), VSA2Config(backend="torch"), state)
    assert isinstance(model.blocks[0].attn1.processor, WanVSA2AttnProcessor)
    assert not isinstance(model.blocks[0].attn2.processor, WanVSA2AttnProcessor)
    torch.testing.assert_close(_run(model, inputs), reference, rtol=1e-10, atol=1e-10)
    assert state.pop_density() == 1.0  # dense fallback, one record per layer

    # The sparse path selecting every segment (topk, budget = all) is dense attention too.
    sparse_cfg = VSA2Config(backend="torch", mode="topk", dense_threshold=1.0)
    enable_vsa2(model, sparse_cfg, state)
    state.sparsity = 1e-6  # below the dense threshold, budget ceil((1 - 1e-6) * n) = n
    torch.testing.assert_close(_run(model, inputs), reference, rtol=1e-10, atol=1e-10)
    assert state.pop_density() == pytest.approx(1.0)

    # Sparsity exactly 0 is the stock dense model whatever the (here trained) VSA2 parameters.
    with torch.no_grad():
        for param in vsa2_parameters(model):
            param.normal_(0.0, 0.1)
    state.sparsity = 0.0
    torch.testing.assert_close(_run(model, inputs), reference, rtol=1e-10, atol=1e-10)
    state.sparsity = 0.005
    assert not torch.allclose(_run(model, inputs), reference)


def test_vsa2_follows_the_grid_of_each_call_and_sparsity_changes_output():
    model = _tiny_wan()
    state = SparsityState(sparsity=0.005)  # dense fallback
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk"), state)
    small, large = _inputs((2, 4, 4)), _inputs((8, 8, 16))
    _run(model, small)
    _run(model, large)
    assert model._vsa2_context.layout.grid == (8, 4, 8)
    dense_out = _run(model, large)
    state.sparsity = 0.75
    sparse_out = _run(model, large)
    density = state.pop_density()
    # 256 tokens -> 16 segments of 16; topk budget ceil(0.25 * 16) = 4 -> density 0.25.
    assert density == pytest.approx((1.0 * 3 + 0.25) / 4)  # 3 dense records, then 0.25
    assert not torch.allclose(dense_out, sparse_out)


def test_gradients_reach_alpha_gates_and_qk_projections():
    torch.manual_seed(1)
    model = _tiny_wan()
    state = SparsityState(sparsity=0.5)
    enable_vsa2(model, VSA2Config(backend="torch", mode="topk"), state)
    inputs = _inputs((4, 8, 16))  # grid 4x4x8: 2 tiles, 8 segments, 4 selected per tile
    target = torch.randn_like(inputs[0])
    loss = (_run(model, inputs) - target).pow(2).mean()
    loss.backward()
    attn = model.blocks[0].attn1
    for name, param in [
        ("alpha", attn.vsa2.alpha),
        ("to_gate_coarse", attn.vsa2.to_gate_coarse.weight),
        ("to_gate_fine", attn.vsa2.to_gate_fine.weight),
        ("to_q", attn.to_q.weight),
        ("to_k", attn.to_k.weight),
    ]:
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), name

    assert len(vsa2_parameters(model)) == 2 * 5  # alpha + 2 weights + 2 biases per layer


def test_alpha_gradient_matches_finite_differences():
    # At the module level in float64: diffusers' Wan blocks compute norms in float32, whose
    # rounding would swamp a finite difference through the whole model.
    layout = TileLayout.from_grid((4, 4, 8))  # 2 tiles, 8 segments of 16
    state = SparsityState(sparsity=0.5)
    module = VSA2Attention(64, 2, VSA2Config(backend="torch", mode="topk"), state).double()
    q, k, v = (torch.randn(1, 128, 2, 32, dtype=torch.float64) for _ in range(3))
    hidden = torch.randn(1, 128, 64, dtype=torch.float64)
    weight = torch.randn(1, 128, 2, 32, dtype=torch.float64)
    with torch.no_grad():
        module.to_gate_coarse.bias.fill_(0.1)

    def loss():
        return (module(q, k, v, hidden, layout) * weight).sum()

    loss().backward()
    eps = 1e-4
    for head in range(2):
        with torch.no_grad():
            module.alpha[head] += eps
            plus = loss()
            module.alpha[head] -= 2 * eps
            minus = loss()
            module.alpha[head] += eps
        numeric = float((plus - minus) / (2 * eps))
        # At alpha = 0 the float32 router bias (alpha * float32 log-probs) rounds relative to
        # its tiny perturbed values; at alpha != 0 that rounding would swamp the difference.
        assert float(module.alpha.grad[head]) == pytest.approx(numeric, rel=1e-4, abs=1e-6)
    assert state.pop_density() == pytest.approx(0.5)


def test_forward_backward_at_sparsity_075_topp():
    model = _tiny_wan(dtype=torch.float32)
    state = SparsityState(sparsity=0.75)
    enable_vsa2(model, VSA2Config(backend="torch", mode="topp", top_p=0.5), state)
    inputs = _inputs((4, 8, 16), dtype=torch.float32)
    out = _run(model, inputs)
    out.square().mean().backward()
    assert torch.isfinite(out).all()
    density = state.pop_density()
    assert 1 / 8 <= density <= 2 / 8  # min_kv 1 .. budget ceil(0.25 * 8) = 2 of 8 segments
    for param in vsa2_parameters(model):
        assert param.grad is not None and torch.isfinite(param.grad).all()


def test_triton_backend_matches_torch_backend_on_a_small_grid():
    # on CPU the Triton kernels run under the interpreter (tests/conftest.py sets TRITON_INTERPRET)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _tiny_wan(dtype=torch.float32, num_layers=1).to(device)
    with torch.no_grad():  # nonzero gates and alpha so every term of the fusion is exercised
        for param in vsa2_parameters(enable_vsa2(model, VSA2Config(), SparsityState())):
            param.normal_(0.0, 0.05)
    state = SparsityState(sparsity=0.5)
    inputs = [x.to(device) for x in _inputs((4, 8, 8), batch=1, dtype=torch.float32)]  # 2 tiles
    outs = []
    with torch.no_grad():
        for backend in ("torch", "triton"):
            enable_vsa2(model, VSA2Config(backend=backend, mode="topk"), state)
            outs.append(_run(model, inputs))
    assert float((outs[1] - outs[0]).abs().max()) < 1e-4


def test_enable_vsa2_disabled_and_repeated():
    model = _tiny_wan()
    enable_vsa2(model, VSA2Config(enabled=False), SparsityState())
    assert not hasattr(model.blocks[0].attn1, "vsa2")
    state = SparsityState()
    enable_vsa2(model, VSA2Config(), state)
    alpha = model.blocks[0].attn1.vsa2.alpha
    enable_vsa2(model, VSA2Config(kv_block=32), state)
    assert model.blocks[0].attn1.vsa2.alpha is alpha
    assert model.blocks[0].attn1.vsa2.config.kv_block == 32
    with pytest.raises(ValueError, match="WanTransformer3DModel"):
        enable_vsa2(torch.nn.Linear(2, 2), VSA2Config(), state)
    # A deep copy (frozen reference policy) keeps following the same sparsity state.
    twin = copy.deepcopy(model)
    assert twin.blocks[0].attn1.vsa2.state is state
    assert twin.blocks[0].attn1.processor.context is twin._vsa2_context


# --------------------------------------------------------------------------------------------
# Wan bundle


def test_load_wan_bundle_missing_path_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"model\.path=.*does not exist"):
        load_wan_bundle(str(tmp_path / "nowhere"), VSA2Config())
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ValueError, match=r"model\.path=.*text_encoder/"):
        load_wan_bundle(str(tmp_path), VSA2Config())


def _save_tiny_wan_folder(root):
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    WanTransformer3DModel(**{**TINY_WAN, "in_channels": 16, "out_channels": 16}).save_pretrained(
        root / "transformer"
    )
    words = ["<pad>", "</s>", "<unk>", "a", "red", "square", "moving", "right"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(root / "tokenizer")
    config = UMT5Config(
        vocab_size=len(words), d_model=TINY_WAN["text_dim"], d_kv=8, d_ff=32, num_layers=1,
        num_heads=2, relative_attention_num_buckets=8,
    )  # fmt: skip
    UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).save_pretrained(
        root / "vae"
    )


def test_load_tiny_wan_directory(tmp_path):
    _save_tiny_wan_folder(tmp_path / "wan")
    bundle = load_wan_bundle(
        str(tmp_path / "wan"), VSA2Config(backend="torch"), text_cache_dir=str(tmp_path / "cache")
    )
    assert isinstance(bundle, VideoDiTBundle)
    assert isinstance(bundle.transformer.blocks[0].attn1.processor, WanVSA2AttnProcessor)
    shape = bundle.latent_shape(num_frames=5, height=32, width=48)
    assert shape == (16, 2, 4, 6)
    with pytest.raises(ValueError, match="num_frames"):
        bundle.latent_shape(num_frames=6, height=32, width=48)

    emb = bundle.encode_prompts(["a red square moving right", "a red square"])
    assert emb.shape == (2, 512, TINY_WAN["text_dim"])
    assert bool((emb[0, 5:] == 0).all()) and bool((emb[1, 3:] == 0).all())  # 5 and 3 tokens + eos
    assert len(list((tmp_path / "cache").iterdir())) == 2
    again = bundle.encode_prompts(["a red square"])  # now served from the cache
    torch.testing.assert_close(again[0], emb[1])
    for damage in (b"\x80\x04garbage", b""):  # a file cut short or overwritten: encoded anew
        for cached in (tmp_path / "cache").iterdir():
            cached.write_bytes(damage)
        fresh = load_wan_bundle(  # a new run: nothing in memory, the damaged files on disk
            str(tmp_path / "wan"),
            VSA2Config(backend="torch"),
            text_cache_dir=str(tmp_path / "cache"),
        )
        with pytest.warns(UserWarning, match=r"model.text_cache_dir: .*\.pt cannot be loaded"):
            again = fresh.encode_prompts(["a red square"])
        torch.testing.assert_close(again[0], emb[1])

    latents = torch.randn(2, *shape)
    velocity = bundle.velocity(latents, torch.tensor([0.9, 0.2]), emb)
    assert velocity.shape == latents.shape and velocity.dtype == torch.float32
    video = bundle.decode(latents)
    assert video.shape == (2, 5, 3, 32, 48) and video.dtype == torch.float32
    assert float(video.min()) >= 0.0 and float(video.max()) <= 1.0

    # a bf16 load keeps diffusers' float32 modules (scale_shift_table, time embedder) in float32;
    # the inputs must still go in the patch embedding's bf16
    half = load_wan_bundle(
        str(tmp_path / "wan"), VSA2Config(backend="torch"), dtype="bfloat16",
        components=("transformer",),
    )  # fmt: skip
    assert half.transformer.scale_shift_table.dtype == torch.float32
    assert half.dtype == torch.bfloat16
    velocity = half.velocity(latents, torch.tensor([0.9, 0.2]), emb)
    assert velocity.dtype == torch.float32 and torch.isfinite(velocity).all()

    only = load_wan_bundle(str(tmp_path / "wan"), VSA2Config(), components=("transformer",))
    with pytest.raises(ValueError, match="text_encoder"):
        only.encode_prompts(["a"])


@pytest.mark.slow
def test_compiled_vsa2_model_follows_the_sparsity_state_without_recompiling():
    """Compiled blocks must follow the shared state as it switches between rollout and eval
    sparsities (the router turns the sparsity into a shape, which torch.compile must not make
    symbolic) and must not recompile as layers record their densities."""
    from vsa2_rl.toy.model import ASSET_DIR, load_toy_bundle

    bundle = load_toy_bundle(VSA2Config(backend="torch"), path=ASSET_DIR)
    state = bundle.sparsity_state
    x = torch.randn(1, *bundle.latent_shape(num_frames=8, height=32, width=32))
    text = bundle.encode_prompts(["a red square moving right fast"])
    sigma = torch.tensor([0.5])
    eager = {}
    for sparsity in (0.75, 0.9):
        state.sparsity = sparsity
        eager[sparsity] = bundle.velocity(x, sigma, text)
    state.pop_density()
    torch._dynamo.reset()
    bundle.transformer = torch.compile(bundle.transformer, backend="aot_eager")
    with torch.no_grad():
        for sparsity in (0.75, 0.9):  # compiles, and once more when the value first changes
            state.sparsity = sparsity
            bundle.velocity(x, sigma, text)
        state.pop_density()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for sparsity in (0.75, 0.9, 0.75):
                state.sparsity = sparsity
                torch.testing.assert_close(bundle.velocity(x, sigma, text), eager[sparsity])
    # every layer of every call recorded its density, none lost to the compiled region
    assert state._density_count == 3 * len(bundle.transformer.blocks)
    assert state.pop_density() == pytest.approx((0.25 + 0.1 + 0.25) / 3, abs=0.02)


@pytest.mark.slow
def test_a_compiled_vsa2_model_builds_its_tile_layout_outside_the_graph():
    """torch.compile of the whole transformer traces its forward pre-hook too; building the
    tile order there would put it in the graph, to run on every call."""
    model = _perturbed_vsa2_wan(torch.float32)
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend)
    inputs = _inputs((4, 8, 8), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(_run(compiled, inputs), _run(model, inputs))
    traces = [node.meta.get("stack_trace") or "" for g in graphs for node in g.graph.nodes]
    assert any("attention" in trace for trace in traces)  # the blocks are in the graphs
    assert not any("layout.py" in trace and "_build" in trace for trace in traces)


def _perturbed_vsa2_wan(dtype, device="cpu", sparsity=0.5, backend="torch"):
    torch.manual_seed(0)
    model = enable_vsa2(
        _tiny_wan(dtype).to(device), VSA2Config(backend=backend, mode="topk"),
        SparsityState(sparsity=sparsity),
    )  # fmt: skip
    with torch.no_grad():  # non-zero gates and alpha: the VSA2 parameters matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _outputs_and_grads(model, inputs):
    out = _run(model, inputs)
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("per_token_temb", [False, True])
def test_wan_block_forward_equals_diffusers_block_forward(per_token_temb):
    """The block forward compile_blocks uses for VSA2 is diffusers' forward, rearranged: same
    output for a Wan2.1 temb [B, 6, C] and a Wan2.2-TI2V per-token temb [B, N, 6, C]."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from vsa2_rl.models.wan import wan_block_forward

    dim, heads, tokens = 32, 2, 12
    block = WanTransformerBlock(dim, 64, heads, cross_attn_norm=True).double()
    with torch.no_grad():
        for p in block.parameters():  # affine norms and biases away from their 1 / 0 init
            p.add_(0.1 * torch.randn_like(p))
    hidden = torch.randn(2, tokens, dim, dtype=torch.float64)
    text = torch.randn(2, 5, dim, dtype=torch.float64)
    temb = torch.randn(2, *((tokens,) if per_token_temb else ()), 6, dim, dtype=torch.float64)
    angles = torch.randn(1, tokens, 1, dim // heads, dtype=torch.float64)
    rotary = (angles.cos(), angles.sin())
    want = block(hidden, text, temb, rotary)
    got = wan_block_forward(block, hidden, text, temb, rotary)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_compile_blocks_compiles_vsa2_blocks_whole():
    """compile_blocks: a dense model's blocks compile whole (diffusers); a VSA2 model's blocks
    run the compiled wan_block_forward with and without autograd, with the eager model's
    outputs and gradients, and so does a deep copy (full fine-tuning's frozen reference)."""
    from vsa2_rl.models.wan import compile_blocks

    dense = compile_blocks(_tiny_wan(torch.float32))
    assert all(block._compiled_call_impl is not None for block in dense.blocks)

    eager = _perturbed_vsa2_wan(torch.float32)
    model = compile_blocks(copy.deepcopy(eager))
    inputs = _inputs(dtype=torch.float32, latent_thw=(4, 8, 8), batch=1)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        torch.testing.assert_close(_run(model, inputs), _run(eager, inputs), rtol=1e-4, atol=1e-4)
    got, want = _outputs_and_grads(model, inputs), _outputs_and_grads(eager, inputs)
    assert counters["stats"]["unique_graphs"] > 0, "the blocks did not run compiled"
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-3, atol=1e-5)
    frozen = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
        torch.testing.assert_close(_run(frozen, inputs), _run(eager, inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_vsa2_blocks_with_lora_adapters_match_eager_and_switch_them_off():
    """The recipes' LoRA runs: compiled VSA2 blocks with peft adapters give the eager model's
    outputs and gradients, and with the adapters disabled (the KL reference policy) its
    adapter-free outputs."""
    from peft import LoraConfig

    from vsa2_rl.models.wan import compile_blocks

    eager = _perturbed_vsa2_wan(torch.float32)
    eager.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
    with torch.no_grad():  # non-zero adapters (peft starts lora_B at 0)
        for name, p in eager.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model = compile_blocks(copy.deepcopy(eager))
    inputs = _inputs(dtype=torch.float32, latent_thw=(4, 8, 8), batch=1)
    torch._dynamo.reset()
    got, want = _outputs_and_grads(model, inputs), _outputs_and_grads(eager, inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        for m in (model, eager):
            m.disable_adapters()
        adapters_off = _run(model, inputs)
        torch.testing.assert_close(adapters_off, _run(eager, inputs), rtol=1e-5, atol=1e-5)
        assert (adapters_off - want[0]).abs().max() > 1e-2, "the adapters must matter here"


@pytest.mark.slow
def test_compiled_vsa2_blocks_compile_once_for_a_new_grid():
    """The pre-hook puts a new grid's tile/untile indices on the device before the compiled
    blocks run. Made inside the first block's compiled call instead, they were found cached by
    the next block (or call), which recompiled; under gradient checkpointing that recompile
    came at the first block's recompute, whose graph then saved its tensors in another order
    (CheckpointError on an H200 in float32)."""
    from vsa2_rl.models.wan import compile_blocks

    model = compile_blocks(_perturbed_vsa2_wan(torch.float32))
    inputs = _inputs(dtype=torch.float32, latent_thw=(3, 10, 6), batch=1)  # a grid of its own
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = _run(model, inputs)
        first.square().mean().backward()
        torch.testing.assert_close(_run(model, inputs), first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_vsa2_blocks_train_on_cuda_like_eager_ones(dtype, checkpointing):
    """compile_blocks on CUDA (Triton kernels), also with gradient checkpointing as the
    trainer's full fine-tuning runs it: the compiled wan_block_forward trains with the eager
    model's gradients. (float32 with checkpointing raised a CheckpointError before the layout's
    indices were made outside the compiled blocks.)"""
    from vsa2_rl.models.wan import compile_blocks

    eager = _perturbed_vsa2_wan(dtype, device="cuda", backend="auto")
    model = compile_blocks(copy.deepcopy(eager))
    inputs = [x.cuda() for x in _inputs(dtype=dtype, latent_thw=(4, 8, 8), batch=1)]
    torch._dynamo.reset()
    if checkpointing:
        for m in (model, eager):
            m.enable_gradient_checkpointing()
    got, want = _outputs_and_grads(model, inputs), _outputs_and_grads(eager, inputs)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        scale = float(want_grad.abs().max())
        torch.testing.assert_close(got_grad, want_grad, rtol=tol, atol=tol * scale)
