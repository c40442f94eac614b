"""``videoalign`` against independent references on a tiny random Qwen2-VL.

The test writes, without downloads, a tiny Qwen2-VL base folder (save_pretrained, byte-level
tokenizer with Qwen2-VL's chat tokens) and a VideoReward folder in the published layout: trained
weights, LoRA from peft and the reward head under transformers 4.45's Qwen2-VL names, stats in
model_config.json. The reference score runs the *unmerged* peft model through transformers'
own Qwen2-VL video processor and composite forward, with the frames resized by torchvision.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
tokenizers = pytest.importorskip("tokenizers")
torchvision = pytest.importorskip("torchvision")

from vsa2_rl.rewards import get_reward  # noqa: E402
from vsa2_rl.rewards.videoalign import REWARD_TOKENS, question  # noqa: E402

CHAT_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
STATS = {
    "VQ_mean": 0.3,
    "VQ_std": 2.0,
    "MQ_mean": -0.5,
    "MQ_std": 0.5,
    "TA_mean": 1.5,
    "TA_std": 4.0,
}
VIDEO_FPS = 4.0  # 9 frames at 4 fps, 2 fps sampled: 4 frames
FRAMES = [0, 3, 5, 8]  # linspace(0, 8, 4).round()
SIZE = (56, 84)  # 40 x 60 grown to min_pixels 56 * 56 on multiples of 28
PROMPTS = ["a red ball rolls left", "{braces} stay", "a cat"]
# transformers 4.45 named Qwen2-VL's text model ``model.*`` and its vision tower ``visual.*``
PUBLISHED = {"model.language_model.": "model.", "model.visual.": "visual."}


def published(name: str) -> str:
    for new, old in PUBLISHED.items():
        name = name.replace(new, old)
    return name


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: index for index, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_tokens(CHAT_TOKENS, special_tokens=True)
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def tiny_model(tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer) + 5,  # larger than the tokenizer, as Qwen2-VL-2B's
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "rope_theta": 10000.0,
            },
        ),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


def trained_copy(base, tokenizer):
    """The base after "training": new tokens, every weight moved, LoRA with non-zero B."""
    model = copy.deepcopy(base)
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|up_proj|down_proj)",
    )
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return model.eval()


def write_checkpoint(folder, model, head, max_pixels):
    from safetensors.torch import save_file

    step = os.path.join(folder, "checkpoint-7")
    os.makedirs(step)
    adapter = peft.get_peft_model_state_dict(model)
    save_file(
        {published(k): v.contiguous() for k, v in adapter.items()},
        os.path.join(step, "adapter_model.safetensors"),
    )
    trained = {published(k): v for k, v in model.named_parameters() if "lora_" not in k}
    trained["base_model.model.rm_head.weight"] = head
    torch.save(trained, os.path.join(step, "non_lora_state_dict.pth"))
    config = {
        "data_config": {
            "fps": 2.0,
            "num_frames": None,
            "max_frame_pixels": max_pixels,
            "eval_dim": ["VQ", "MQ", "TA"],
            "prompt_template_type": "detailed_special",
            "sample_type": "uniform",
        },
        "model_config": {
            "model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct",
            "output_dim": 3,
            "use_special_tokens": True,
            "reward_token": "special",
        },
        "peft_lora_config": {"lora_enable": True, "lora_r": 4, "lora_alpha": 8},
        "inference_config": STATS,
    }
    with open(os.path.join(folder, "model_config.json"), "w") as handle:
        json.dump(config, handle)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("videoalign")
    tokenizer = tiny_tokenizer()
    base = tiny_model(tokenizer)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    tokenizer.add_tokens(list(REWARD_TOKENS.values()), special_tokens=True)
    model = trained_copy(base, tokenizer)
    head = torch.randn(3, 32)
    write_checkpoint(root / "reward", model, head, max_pixels=6000)
    videos = (torch.rand(3, 9, 3, 40, 60) * 255).round() / 255  # 8-bit levels, as decoded
    return {"root": root, "tokenizer": tokenizer, "model": model, "head": head, "videos": videos}


def reward(setup, **kwargs):
    kwargs.setdefault("model_path", str(setup["root"] / "reward"))
    kwargs.setdefault("base_model_path", str(setup["root"] / "base"))
    return get_reward("videoalign", video_fps=VIDEO_FPS, min_pixels=56 * 56, **kwargs)


@torch.no_grad()
def reference_raw(setup, videos, prompts):
    """Raw [B, 3] scores: torchvision resize, transformers' processor and forward, peft LoRA."""
    from torchvision.transforms.functional import InterpolationMode, resize
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer, model = setup["tokenizer"], setup["model"]
    frames = [
        resize(
            (video[FRAMES] * 255).round().to(torch.uint8),
            list(SIZE),
            interpolation=InterpolationMode.BICUBIC,
            antialias=True,
        )
        for video in videos
    ]
    processor = Qwen2VLVideoProcessor(do_resize=False, do_sample_frames=False)
    pixels = processor(videos=frames, return_tensors="pt")
    grids = pixels["video_grid_thw"]
    ids = []
    for prompt, grid in zip(prompts, grids, strict=True):
        text = (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "<|vision_start|>"
            + "<|video_pad|>" * (int(grid.prod()) // 4)
            + "<|vision_end|>"
            + question(prompt)
            + "<|im_end|>\n<|im_start|>assistant\n"
        )
        ids.append(tokenizer(text).input_ids)
    length = max(map(len, ids))
    input_ids = torch.tensor([row + [0] * (length - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in ids])
    positions = torch.arange(length).expand(3, len(ids), length)  # VideoReward's positions
    hidden = model.base_model.model.model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        pixel_values_videos=pixels["pixel_values_videos"],
        video_grid_thw=grids,
    ).last_hidden_state
    rows = []
    for row, states in zip(input_ids, hidden, strict=True):
        tokens = tokenizer.convert_tokens_to_ids(list(REWARD_TOKENS.values()))
        at = [states[row == token][0] for token in tokens]
        rows.append(torch.stack([setup["head"][k] @ at[k] for k in range(3)]))
    return torch.stack(rows)


def standardised(raw):
    mean = torch.tensor([STATS[f"{name}_mean"] for name in REWARD_TOKENS])
    std = torch.tensor([STATS[f"{name}_std"] for name in REWARD_TOKENS])
    return (raw - mean) / std


def test_reward_matches_the_reference_computation(setup):
    weights = {"VQ": 0.5, "MQ": 1.0, "TA": 2.0}
    scores = reward(setup, heads=weights, batch_size=3)(setup["videos"], PROMPTS)
    expected = standardised(reference_raw(setup, setup["videos"], PROMPTS))
    expected = expected @ torch.tensor(list(weights.values()))
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)


def test_heads_combine_linearly_and_normalise_with_the_stored_stats(setup):
    videos, prompts = setup["videos"][:2], PROMPTS[:2]
    vq = reward(setup, heads={"VQ": 1.0})(videos, prompts)
    mq = reward(setup, heads={"MQ": 1.0})(videos, prompts)
    both = reward(setup, heads={"VQ": 1.0, "MQ": 2.0})(videos, prompts)
    torch.testing.assert_close(both, vq + 2 * mq, rtol=1e-5, atol=1e-5)
    raw_mq = reward(setup, heads={"MQ": 1.0}, normalize=False)(videos, prompts)
    torch.testing.assert_close(mq, (raw_mq - STATS["MQ_mean"]) / STATS["MQ_std"])
    assert not torch.allclose(mq, raw_mq)


def test_batch_order_does_not_change_scores(setup):
    fn = reward(setup, heads={"TA": 1.0, "MQ": -1.0}, batch_size=3)
    videos = setup["videos"]
    together = fn(videos, PROMPTS)
    alone = torch.cat([fn(videos[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)
    order = [2, 0, 1]
    torch.testing.assert_close(
        fn(videos[order], [PROMPTS[i] for i in order]), together[order], rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    ("missing", "kwarg"),
    [
        ("model_config.json", "model_path"),
        ("checkpoint-7/non_lora_state_dict.pth", "model_path"),
        ("checkpoint-7/adapter_model.safetensors", "model_path"),
        ("base/tokenizer_config.json", "base_model_path"),
    ],
)
def test_missing_files_name_the_kwarg_and_the_file(setup, tmp_path, missing, kwarg):
    shutil.copytree(setup["root"] / "reward", tmp_path / "reward")
    shutil.copytree(setup["root"] / "base", tmp_path / "base")
    target = tmp_path / missing if missing.startswith("base/") else tmp_path / "reward" / missing
    target.unlink()
    with pytest.raises(ValueError, match=rf"{kwarg}.*{os.path.basename(missing)}"):
        reward(setup, model_path=str(tmp_path / "reward"), base_model_path=str(tmp_path / "base"))


def test_bad_kwargs_are_named(setup):
    with pytest.raises(ValueError, match="heads"):
        reward(setup, heads={"overall": 1.0})
    with pytest.raises(ValueError, match="base_model_path"):
        reward(setup, base_model_path=None)
