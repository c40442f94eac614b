"""``vlm_judge`` on a tiny randomly initialised Qwen2-VL, built offline into a temporary folder.

The tokenizer is a byte-level BPE trained here with the ``tokenizers`` library on a few
sentences (so "Yes" and "No" are single tokens and any prompt tokenizes), wrapped as a
``PreTrainedTokenizerFast`` with Qwen2-VL's special tokens; the processor is Qwen2-VL's own with
small sizes (4-pixel patches, 2x2 merge, at most 32x32 frames) and a minimal chat template in
Qwen's format. References are written out in the tests: the chat text literally, frames picked
by index and handed to the processor as numpy HWC arrays, one video per forward.
"""

import numpy as np
import pytest
import torch

from vsa2_rl.rewards import RewardMixer, get_reward

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = ["a red square", "a small blue circle moving slowly to the left", "zebra"]


def _chat_text(prompt):
    return (
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>"
        f"Does this video show: {prompt}? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory):
    """(folder, model, processor) of a random 2-layer Qwen2-VL with a 1-block vision tower."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_chat_text("a red square"), "Yes", "No"] * 3, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    sizes = {
        "size": {"shortest_edge": 8 * 8, "longest_edge": 32 * 32},
        "patch_size": 4,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen2VLVideoProcessor(**sizes, cap_pixels_per_frame=False),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    token_id = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": bpe.get_vocab_size(),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            # multimodal RoPE: head_dim 16 = 2 x (2 + 3 + 3) temporal, height, width frequencies
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
            "pad_token_id": token_id("<|endoftext|>"),
            "bos_token_id": token_id("<|im_start|>"),
            "eos_token_id": token_id("<|im_end|>"),
        },
        vision_config={
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the 0.02 init, so that prompts and pixels move the score
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.2)
    folder = tmp_path_factory.mktemp("tiny_qwen2_vl")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder), model, processor


def _single_inputs(processor, video, frame_index, prompt):
    """Processor inputs of one video: the chosen frames as uint8 HWC arrays, the literal chat."""
    frames = (video[frame_index].permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    return processor(text=[_chat_text(prompt)], videos=[list(frames)], return_tensors="pt")


def test_yes_no_scores_are_next_token_log_odds_of_each_video_alone(tiny_qwen2_vl):
    folder, model, processor = tiny_qwen2_vl
    lengths = {len(processor.tokenizer(prompt).input_ids) for prompt in PROMPTS}
    assert len(lengths) == len(PROMPTS)  # the batch is padded
    videos = torch.rand(3, 7, 3, 20, 36)  # not multiples of the 8-pixel patch grid: resized
    reward = get_reward("vlm_judge", path=folder, num_frames=4, batch_size=2, dtype="float32")
    values = reward(videos, PROMPTS, [{}, {}, {}])
    yes, no = processor.tokenizer.convert_tokens_to_ids(["Yes", "No"])
    expected = []
    for video, prompt in zip(videos, PROMPTS, strict=True):
        with torch.no_grad():  # frames 0, 2, 4, 6: 4 evenly spaced of 7
            logits = model(**_single_inputs(processor, video, [0, 2, 4, 6], prompt)).logits
        log_probs = logits[0, -1].double().log_softmax(dim=-1)
        expected.append(log_probs[yes] - log_probs[no])
    torch.testing.assert_close(values.double(), torch.stack(expected), rtol=1e-4, atol=1e-5)
    assert values.std() > 1e-3  # the videos and prompts are told apart
    one_by_one = get_reward("vlm_judge", path=folder, num_frames=4, batch_size=1, dtype="float32")
    torch.testing.assert_close(one_by_one(videos, PROMPTS), values, rtol=1e-4, atol=1e-5)
    grey = videos.mean(dim=2, keepdim=True)  # one channel: scored as grey RGB
    rgb = grey.expand(-1, -1, 3, -1, -1)
    torch.testing.assert_close(reward(grey, PROMPTS), reward(rgb, PROMPTS))


def test_scalar_head_is_a_linear_map_of_the_last_final_hidden_state(tiny_qwen2_vl, tmp_path):
    from safetensors.torch import save_file

    folder, model, processor = tiny_qwen2_vl
    weight, bias = torch.randn(1, 32), torch.randn(1)
    save_file({"weight": weight, "bias": bias}, str(tmp_path / "head.safetensors"))
    reward = get_reward(
        "vlm_judge",
        path=folder,
        mode="scalar_head",
        head_path=str(tmp_path / "head.safetensors"),
        question="Rate: {prompt}",
        num_frames=2,
        dtype="float32",
    )
    videos = torch.rand(2, 5, 3, 32, 32)
    values = reward(videos, PROMPTS[:2])
    expected = []
    for video, prompt in zip(videos, PROMPTS[:2], strict=True):
        question = f"Does this video show: {prompt}? Answer yes or no."
        chat = _chat_text(prompt).replace(question, f"Rate: {prompt}")
        frames = (video[[0, 4]].permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
        inputs = processor(text=[chat], videos=[list(frames)], return_tensors="pt")
        with torch.no_grad():
            hidden = model(**inputs, output_hidden_states=True).hidden_states[-1][0, -1]
        expected.append(hidden.double() @ weight[0].double() + bias.double()[0])
    torch.testing.assert_close(values.double(), torch.stack(expected), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": None}, r"kwargs\.path: required"),
        ({"path": "{tmp}/nowhere"}, r"kwargs\.path: folder not found: .*nowhere"),
        ({"path": "{tmp}"}, r"kwargs\.path: .* has no config\.json"),
        ({"architecture": "llava"}, r"kwargs\.architecture: expected a 'llava' model.*'qwen2_vl'"),
        ({"mode": "scalar_head"}, r"kwargs\.head_path: required"),
        ({"mode": "scalar_head", "head_path": "{tmp}/h.pt"}, r"kwargs\.head_path: file not found"),
        ({"mode": "scalar_head", "head_path": "{tmp}/wide.safetensors"}, r"'weight' \[1, 32\]"),
        ({"head_path": "{tmp}/wide.safetensors"}, r"kwargs\.head_path: only read with mode="),
        ({"mode": "score"}, r"kwargs\.mode: got 'score'"),
        ({"question": "Is it good?"}, r"kwargs\.question: must contain '\{prompt\}'"),
        ({"yes_token": "Yes indeed"}, r"kwargs\.yes_token: 'Yes indeed' is \d+ tokens"),
        ({"dtype": "fp8"}, r"kwargs\.dtype: got 'fp8'"),
    ],
)
def test_bad_configuration_names_the_key(tiny_qwen2_vl, tmp_path, kwargs, message):
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1, 64)}, str(tmp_path / "wide.safetensors"))
    kwargs = {"path": tiny_qwen2_vl[0]} | kwargs
    kwargs = {
        key: value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value
        for key, value in kwargs.items()
    }
    with pytest.raises(ValueError, match=message):
        get_reward("vlm_judge", **kwargs)


def test_config_errors_name_the_reward_and_its_config_key(tmp_path):
    entry = {"name": "vlm_judge", "kwargs": {"path": str(tmp_path / "missing")}}
    with pytest.raises(ValueError, match=r"rewards\.functions\[0\] \(vlm_judge\): kwargs\.path"):
        RewardMixer([entry])


def test_weights_are_bfloat16_by_default_only_where_cuda_is(tiny_qwen2_vl):
    reward = get_reward("vlm_judge", path=tiny_qwen2_vl[0])
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert reward.fn.model.dtype == expected


@pytest.mark.gpu
def test_on_cuda_the_model_moves_to_the_videos_device_in_bfloat16(tiny_qwen2_vl):
    folder = tiny_qwen2_vl[0]
    videos = torch.rand(3, 4, 3, 32, 32)
    in_float32 = get_reward("vlm_judge", path=folder, dtype="float32")(videos, PROMPTS)
    reward = get_reward("vlm_judge", path=folder)
    values = reward(videos.cuda(), PROMPTS)
    assert reward.fn.model.dtype == torch.bfloat16
    assert reward.fn.model.device.type == "cuda" and values.device.type == "cuda"
    torch.testing.assert_close(values.cpu(), in_float32, rtol=0.05, atol=0.05)
