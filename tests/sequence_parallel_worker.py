"""Run by tests/test_sequence_parallel.py under torchrun (gloo, CPU): one VSA2 layer (``layer``)
or the whole toy Wan model with VSA2 (``model``) on an odd token grid, once whole on every rank
(the reference) and once with Ulysses sequence parallelism over the ranks; rank 0 writes every
rank's relative RMS errors of the output and of every gradient."""

import json
import sys

import torch
import torch.distributed as dist

from vsa2_rl.attention import SparsityState, TileLayout, VSA2Attention
from vsa2_rl.config import VSA2Config
from vsa2_rl.parallel import SequenceParallel


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def layer_errors(sparsity: float) -> dict:
    torch.manual_seed(0)
    heads, head_dim = 4, 16
    config = VSA2Config(kv_block=16, mode="topp", top_p=0.9, backend="torch")
    layer = VSA2Attention(heads * head_dim, heads, config, SparsityState(sparsity))
    with torch.no_grad():  # non-zero gates and router-bias scale, so that they all count
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.2)
    layout = TileLayout.from_grid((3, 7, 9))  # 189 tokens: no multiple of 2 or 4 ranks
    tokens = layout.num_tokens
    inputs = [torch.randn(1, tokens, heads, head_dim) for _ in range(3)]
    inputs.append(torch.randn(1, tokens, heads * head_dim))  # hidden states
    grad_out = torch.randn(1, tokens, heads, head_dim)

    whole = [x.clone().requires_grad_() for x in inputs]
    out = layer(*whole, layout)
    (out * grad_out).sum().backward()
    # the dense path (sparsity 0) uses neither the hidden states nor a VSA2 parameter
    ref_params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()

    sp = SequenceParallel()
    layer.sequence_parallel = sp
    mine = sp.token_slice(tokens)
    parts = [x[:, mine].clone().requires_grad_() for x in inputs]
    out_sp = layer(*parts, layout)
    (out_sp * grad_out[:, mine]).sum().backward()
    errors = {"out": rel_rms(out_sp, out[:, mine])}
    for name, part, ref in zip(("dq", "dk", "dv", "dhidden"), parts, whole, strict=True):
        if ref.grad is not None:
            errors[name] = rel_rms(part.grad, ref.grad[:, mine])
    for name, parameter in layer.named_parameters():
        if name not in ref_params:
            continue
        total = parameter.grad.clone()
        dist.all_reduce(total)  # each rank holds its tokens' (and heads') share
        errors[name] = rel_rms(total, ref_params[name])
    return errors


def model_errors(sparsity: float) -> dict:
    """The toy model (4 blocks, 4 heads) on a 3 x 6 x 10 latent: 3 x 3 x 5 = 45 tokens."""
    from vsa2_rl.models.wan import enable_sequence_parallel
    from vsa2_rl.toy.model import load_toy_bundle

    config = VSA2Config(kv_block=16, mode="topp", top_p=0.9, backend="torch")
    bundle = load_toy_bundle(config, "cpu", torch.float32)
    bundle.sparsity_state.sparsity = sparsity
    model = bundle.transformer
    torch.manual_seed(0)
    latents = torch.randn(2, 3, 3, 6, 10)
    sigma = torch.tensor([0.8, 0.3])
    text = bundle.encode_prompts(["a red square moving left fast", "a blue circle"])
    grad_out = torch.randn(2, 3, 3, 6, 10)

    (bundle.velocity(latents, sigma, text) * grad_out).sum().backward()
    out = bundle.velocity(latents, sigma, text).detach()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    enable_sequence_parallel(model, SequenceParallel())
    out_sp = bundle.velocity(latents, sigma, text)
    (out_sp * grad_out).sum().backward()
    errors = {"out": rel_rms(out_sp, out)}
    for name, parameter in model.named_parameters():
        if name in ref:  # the mean over the ranks, as DDP's all-reduce takes it
            mean = parameter.grad.clone()
            dist.all_reduce(mean)
            errors[name] = rel_rms(mean / dist.get_world_size(), ref[name])
    return errors


def main(out_path: str, what: str, sparsity: float) -> None:
    dist.init_process_group("gloo")
    errors = (layer_errors if what == "layer" else model_errors)(sparsity)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    if dist.get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
