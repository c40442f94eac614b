"""The model-family registry (vsa2_rl.models.family): lookup by model.kind, and the Wan family
being the functions of vsa2_rl.models.wan."""

import copy

import pytest
import torch
from test_models import TINY_WAN, _inputs, _run, _tiny_wan  # tests folder is on sys.path

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import ConfigError, VSA2Config, load_config
from vsa2_rl.models import wan
from vsa2_rl.models.family import FAMILIES, TOY, WAN, family_of
from vsa2_rl.toy.model import ToyBundle

TRANSFORMER_FUNCTIONS = (
    "enable_vsa2",
    "vsa2_parameters",
    "compile_blocks",
    "fuse_block_kernels",
    "enable_sequence_parallel",
)


def test_registry_maps_each_model_kind_to_its_family():
    assert family_of("wan") is WAN and family_of("toy") is TOY
    assert sorted(FAMILIES) == ["hunyuan_video15", "ltx2", "minimax_h3", "toy", "wan"]
    assert all(family.kind == kind for kind, family in FAMILIES.items())


def test_every_model_kind_the_config_accepts_has_a_family():
    from vsa2_rl.config.model import MODEL_KINDS

    assert sorted(MODEL_KINDS) == sorted(FAMILIES)


def test_unknown_kind_names_the_key_and_the_known_kinds():
    with pytest.raises(
        ConfigError,
        match=r"^model\.kind: .*'cogvideox'.*known kinds: hunyuan_video15, ltx2, minimax_h3, "
        r"toy, wan$",
    ):
        family_of("cogvideox")


@pytest.mark.parametrize("name", TRANSFORMER_FUNCTIONS)
def test_wan_and_toy_families_run_wans_transformer_functions(name):
    # the toy's transformer is a WanTransformer3DModel: only its loading differs
    assert getattr(WAN, name) is getattr(wan, name)
    assert getattr(TOY, name) is getattr(wan, name)
    assert TOY.load_bundle is not WAN.load_bundle


def test_enable_vsa2_through_the_family_equals_the_wan_function():
    dense = _tiny_wan()
    state = SparsityState(sparsity=0.5)
    vsa2_config = VSA2Config(backend="torch")
    direct = wan.enable_vsa2(copy.deepcopy(dense), vsa2_config, state)
    through = family_of("wan").enable_vsa2(copy.deepcopy(dense), vsa2_config, state)
    for a, b in zip(direct.blocks, through.blocks, strict=True):
        assert type(a.attn1.processor) is type(b.attn1.processor) is wan.WanVSA2AttnProcessor
        assert type(a.attn2.processor) is type(b.attn2.processor)
    names = [n for n, _ in through.named_parameters() if ".vsa2." in f".{n}"]
    assert names == [n for n, _ in direct.named_parameters() if ".vsa2." in f".{n}"]
    params = WAN.vsa2_parameters(through)
    assert len(params) == TINY_WAN["num_layers"] * 5  # alpha + 2 weights + 2 biases per layer
    assert [p.shape for p in params] == [p.shape for p in wan.vsa2_parameters(direct)]
    with torch.no_grad():  # trained VSA2 parameters, copied across: the same model
        for mine, theirs in zip(params, wan.vsa2_parameters(direct), strict=True):
            theirs.normal_(0.0, 0.1)
            mine.copy_(theirs)
    inputs = _inputs()
    torch.testing.assert_close(_run(through, inputs), _run(direct, inputs), rtol=0, atol=0)


def test_toy_family_loads_the_toy_bundle():
    config = load_config(None, [])
    assert config.model.kind == "toy"
    bundle = family_of(config.model.kind).load_bundle(
        config, torch.device("cpu"), torch.float32, None
    )
    assert isinstance(bundle, ToyBundle)
    assert TOY.vsa2_parameters(bundle.transformer)  # VSA2 on, per config.attention
