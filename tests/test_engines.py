"""DeepSpeed- and FSDP2-specific parts of the training loop that run without either: the config
filled in before ``accelerator.prepare``, the options refused under ZeRO-3 and FSDP2 and the
launchers refused (vsa2_rl.rl.engines).

The loop itself under DeepSpeed ZeRO-2/3 needs GPUs (benchmarks/BENCHMARKS.md, gpu_session
parts engines and resume); under FSDP2 it runs on CPU processes in tests/test_distributed.py.
These tests use a stand-in accelerator that carries only what the functions read.
"""

import os
from types import SimpleNamespace

import pytest

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.rl import engines

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")


def _accelerator(
    stage: int | None,
    ds_config: dict | None = None,
    precision: str = "bf16",
    fsdp_version: int | None = None,
):
    plugin = None
    if stage is not None:
        plugin = SimpleNamespace(zero_stage=stage, deepspeed_config=ds_config or {})
    fsdp = SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version is not None else None
    state = SimpleNamespace(deepspeed_plugin=plugin, fsdp_plugin=fsdp)
    device = SimpleNamespace(type="cpu")
    return SimpleNamespace(state=state, mixed_precision=precision, device=device)


FSDP2 = _accelerator(None, fsdp_version=2)


def test_zero_stage_and_uses_deepspeed():
    assert engines.zero_stage(_accelerator(None)) == 0
    assert not engines.uses_deepspeed(_accelerator(None))
    assert engines.zero_stage(_accelerator(3)) == 3 and engines.uses_deepspeed(_accelerator(2))


def test_what_each_engine_shards():
    ddp, zero2, zero3 = _accelerator(None), _accelerator(2), _accelerator(3)
    assert engines.uses_fsdp2(FSDP2) and not engines.uses_fsdp2(ddp)
    assert not engines.uses_deepspeed(FSDP2) and engines.zero_stage(FSDP2) == 0
    shards = [engines.shards_parameters(acc) for acc in (ddp, zero2, zero3, FSDP2)]
    assert shards == [False, False, True, True]
    optimizer = [engines.shards_optimizer_state(acc) for acc in (ddp, zero2, zero3, FSDP2)]
    assert optimizer == [False, True, True, True]


def test_configure_fills_micro_batch_clipping_and_overflow_check():
    config = load_config(FLOW_GRPO_TOY, ["train.max_grad_norm=0.5", "rl.train_batch_size=2"])
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0}
    engines.configure(_accelerator(2, ds), config)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_clipping"] == 0.5  # train.max_grad_norm is the one key that sets it
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    # DeepSpeed itself accepts the section (its config models forbid unknown keys)
    precision_config = pytest.importorskip("deepspeed.runtime.precision_config")
    assert precision_config.DeepSpeedBF16Config(**ds["bf16"]).check_grad_overflow
    # an explicit micro-batch size in the DeepSpeed file is kept
    ds = {"train_micro_batch_size_per_gpu": 4}
    engines.configure(_accelerator(3, ds, precision="no"), config)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and "bf16" not in ds
    engines.configure(_accelerator(None), config)  # without DeepSpeed: nothing to do


@pytest.mark.parametrize("sharded", [_accelerator(3), FSDP2], ids=["zero3", "fsdp2"])
def test_sharded_parameters_refuse_ema_and_full_finetune_kl_reference(sharded):
    fine = load_config(FLOW_GRPO_TOY, ["train.ema_decay=0", "rl.kl_beta=0"])
    engines.check_options(sharded, fine)
    with pytest.raises(ConfigError, match=r"train\.ema_decay"):
        engines.check_options(sharded, load_config(FLOW_GRPO_TOY, ["train.ema_decay=0.99"]))
    kl = load_config(FLOW_GRPO_TOY, ["train.ema_decay=0", "rl.kl_beta=0.01"])
    with pytest.raises(ConfigError, match=r"rl\.kl_beta"):
        engines.check_options(sharded, kl)
    lora_kl = load_config(FLOW_GRPO_TOY, ["rl.kl_beta=0.01", "model.lora.enabled=true"])
    engines.check_options(sharded, lora_kl)  # the reference is the model with adapters off
    # ZeRO-2 keeps whole parameters on every rank: both are fine there
    engines.check_options(_accelerator(2), load_config(FLOW_GRPO_TOY, ["train.ema_decay=0.99"]))
    engines.check_options(_accelerator(2), kl)


def test_fsdp1_and_an_fsdp_launch_that_accelerate_ran_as_ddp_are_refused(monkeypatch):
    config = load_config(FLOW_GRPO_TOY)
    with pytest.raises(ConfigError, match=r"^launcher: fsdp_config\.fsdp_version is 1"):
        engines.check_options(_accelerator(None, fsdp_version=1), config)
    # accelerate launch --config_file configs/accelerate/fsdp2.yaml sets it; on CPU processes
    # accelerate then leaves the FSDP plugin out and prepares the model for DDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=r"^device: accelerate runs FSDP on GPUs only"):
        engines.check_options(_accelerator(None), config)
    engines.check_options(FSDP2, config)


def test_whole_model_loading_suspends_transformers_zero3_sharding():
    """Under ZeRO-3, transformers would shard the frozen text encoder at from_pretrained."""
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    plugin = DeepSpeedPlugin(zero_stage=3)
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
    plugin.set_deepspeed_weakref()
    try:
        assert is_deepspeed_zero3_enabled()
        with engines.whole_model_loading(acc):
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()  # restored for accelerate.prepare
    finally:
        unset_hf_deepspeed_config()


def test_the_14b_recipe_runs_under_zero3(tmp_path):
    """configs/wan2_1_14b_vsa2_grpo.yaml says to launch it with configs/accelerate/zero3.yaml:
    what it promises for that (LoRA, so the KL reference is the model with adapters off; no
    EMA), ZeRO-3's checks passing, the DeepSpeed config filled for it, and its header's full
    fine-tuning variant refused under ZeRO-3 unless rl.kl_beta=0."""
    import os

    import yaml

    configs = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
    recipe = os.path.join(configs, "wan2_1_14b_vsa2_grpo.yaml")
    (tmp_path / "model_index.json").write_text("{}")  # a model folder is not empty
    model = f"model.path={tmp_path}"
    config = load_config(recipe, [model])
    assert config.model.lora.enabled and config.model.lora.rank == 32
    assert config.rl.kl_beta == 0.004 and config.train.ema_decay == 0.0
    assert (config.model.num_frames, config.model.height, config.model.width) == (81, 720, 1280)
    assert (config.attention.kv_block, config.attention.mode) == (64, "topk")
    assert config.sparsity.train == 0.875

    with open(os.path.join(configs, "accelerate", "zero3.yaml"), encoding="utf-8") as handle:
        launcher = yaml.safe_load(handle)
    assert launcher["deepspeed_config"]["zero_stage"] == 3
    # the DeepSpeed config accelerate builds from that file, before engines.configure fills it
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": launcher["deepspeed_config"]["gradient_clipping"],
    }
    zero3 = _accelerator(3, ds, precision=launcher["mixed_precision"])
    engines.check_options(zero3, config)
    engines.configure(zero3, config)
    assert ds["train_micro_batch_size_per_gpu"] == config.rl.train_batch_size == 1
    assert ds["gradient_clipping"] == config.train.max_grad_norm
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}

    full = ["model.lora.enabled=false", "train.learning_rate=1e-5"]
    with pytest.raises(ConfigError, match=r"^rl\.kl_beta: "):
        engines.check_options(zero3, load_config(recipe, [model, *full]))
    engines.check_options(zero3, load_config(recipe, [model, *full, "rl.kl_beta=0"]))


def test_the_14b_nft_recipe_runs_under_fsdp2_and_zero3(tmp_path):
    """configs/wan2_1_14b_vsa2_nft.yaml says to launch it with configs/accelerate/fsdp2.yaml:
    FSDP2's checks pass for it (LoRA, the KL on the base, no EMA), and so do ZeRO-3's, with
    configs/accelerate/zero3.yaml's DeepSpeed settings; ZeRO-3 variants that keep the weights
    outside the partitions are refused with an error naming the algorithm and the setting."""
    import os

    import yaml

    configs = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
    recipe = os.path.join(configs, "wan2_1_14b_vsa2_nft.yaml")
    (tmp_path / "model_index.json").write_text("{}")  # a model folder is not empty
    config = load_config(recipe, [f"model.path={tmp_path}"])
    assert config.rl.algorithm == "nft" and config.model.lora.enabled
    assert config.rl.kl_beta > 0 and config.rl.kl_reference == "base"
    assert config.train.ema_decay == 0.0
    with open(os.path.join(configs, "accelerate", "fsdp2.yaml"), encoding="utf-8") as handle:
        assert yaml.safe_load(handle)["fsdp_config"]["fsdp_version"] == 2
    engines.check_options(FSDP2, config)
    with open(os.path.join(configs, "accelerate", "zero3.yaml"), encoding="utf-8") as handle:
        launcher = yaml.safe_load(handle)
    offload = launcher["deepspeed_config"]["offload_param_device"]
    zero = {"stage": 3, "offload_param": {"device": offload}}
    engines.check_options(_accelerator(3, {"zero_optimization": zero}), config)
    variants = {
        "offload_param": {"offload_param": {"device": "nvme"}},
        "zero_hpz_partition_size": {"zero_hpz_partition_size": 8},
        "zero_quantized_weights": {"zero_quantized_weights": True},
    }
    for key, variant in variants.items():
        zero3 = _accelerator(3, {"zero_optimization": {**zero, **variant}})
        with pytest.raises(ConfigError, match=rf"^rl\.algorithm: nft .*{key}"):
            engines.check_options(zero3, config)


def test_zero3_takes_nft_with_an_ema_kl_reference_in_full_fine_tuning():
    """As FSDP2 does: the EMA reference is swapped in partition by partition."""
    nft = ["rl.algorithm=nft", "rl.kl_beta=0.1"]
    full = load_config(FLOW_GRPO_TOY, [*nft, "rl.kl_reference=ema"])
    assert not full.model.lora.enabled
    engines.check_options(_accelerator(3), full)
    with pytest.raises(ConfigError, match=r"^rl\.kl_beta: the KL reference of full fine-tuning"):
        engines.check_options(_accelerator(3), load_config(FLOW_GRPO_TOY, nft))
