"""``videoalign``: VideoAlign's VideoReward model (Liu et al., 2025, "Improving Video Generation
with Human Feedback", arXiv 2501.13918) as a reward, the video reward of DanceGRPO and UniRL.

VideoReward is Qwen2-VL-2B-Instruct fine-tuned with LoRA on its language model (vision tower,
merger, the embeddings of three added tokens and the LoRA-wrapped base weights trained in full)
plus a bias-free linear head ``hidden -> 3``. The question presents the video and the caption and
holds three special tokens, ``<|VQ_reward|>`` (visual quality), ``<|MQ_reward|>`` (motion
quality) and ``<|TA_reward|>`` (text alignment); the score of a dimension is the head's row for
that dimension applied to the final (normalised) hidden state at that dimension's token. The
published scores are standardised with means and standard deviations stored in the checkpoint
(``(s - mean) / std``); their "Overall" is the sum of the three.

How this module reproduces the training-time input (read from the authors' public training
code; the implementation here is this repository's own):

- Frames: with the checkpoint's ``fps`` (2 frames per second of video, ``video_fps`` giving the
  generated video's rate) or a fixed ``num_frames``, rounded to an even count (Qwen2-VL patches
  two frames at a time; at least 4 frames with ``fps``), chosen at evenly spaced indices, first
  and last included. Each frame is resized, bicubic with antialiasing on the 0..255 scale and
  rounded to 8-bit levels as a decoded video would be, to the size nearest the original aspect
  whose sides are multiples of 28 and whose area lies in [``min_pixels``, ``max_pixels``]
  (``max_pixels`` from the checkpoint), then scaled to [0, 1], standardised with the CLIP
  mean/std and cut into Qwen2-VL's 2x14x14 patches in its merge order (done here with torch).
- Text: Qwen2-VL's chat format (default system turn, one user turn holding the video then the
  question, the assistant turn opened), the video placeholder repeated once per merged patch.
  The question is the checkpoint's ``detailed_special`` template, kept verbatim below because
  the model scores correctly only on the exact text it was trained on.
- Positions: the reward model ran the language model on embeddings it built itself, so its
  rotary positions were the plain sequence index on all three M-RoPE axes (not Qwen2-VL's
  spatial video positions); the text model here is called the same way. Batches are padded on
  the right, as in training.

Weights load from local folders only (``local_files_only=True``), when the reward is built:

- ``model_path``: the VideoReward folder: ``model_config.json`` (data, model, LoRA and inference
  configs) and ``checkpoint-<step>/`` holding ``adapter_model.safetensors`` (LoRA) and
  ``non_lora_state_dict.pth`` (the fully trained weights and the head ``rm_head.weight``); the
  latest step unless ``checkpoint_step`` is given.
- ``base_model_path``: the Qwen2-VL-2B-Instruct folder (config, weights, tokenizer): the
  checkpoint stores only what training changed.

The three tokens are added to the base tokenizer and the embeddings resized to it, as training
did; the stored weights (named as transformers 4.45 named Qwen2-VL's modules, mapped here onto
transformers 5's) replace the base ones and the LoRA update ``(alpha / r) B A`` is merged into
them, so scoring runs the plain transformers model (no peft wrapper). The model runs on the
videos' device (``device`` pins it instead), in bf16 on CUDA and float32 otherwise (``dtype``).
"""

from __future__ import annotations

import glob
import json
import math
import os
import threading

import torch
import torch.nn.functional as F

from .clip import KEY
from .registry import RewardFn, register_reward

HEADS = ("VQ", "MQ", "TA")
REWARD_TOKENS = {"VQ": "<|VQ_reward|>", "MQ": "<|MQ_reward|>", "TA": "<|TA_reward|>"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIZE_FACTOR = 28  # patch 14 x spatial merge 2
VIDEO_MIN_PIXELS = 128 * 28 * 28
FPS_MIN_FRAMES, FPS_MAX_FRAMES = 4, 768
LAYOUT = (
    "model_config.json and checkpoint-<step>/{adapter_model.safetensors, "
    "non_lora_state_dict.pth} (huggingface-cli download KwaiVGI/VideoReward --local-dir DIR)"
)

CHAT_PREFIX = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
)
CHAT_SUFFIX = "<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
VIDEO_TOKEN = "<|video_pad|>"

# VideoAlign's "detailed_special" question (prompt_template.py, MIT licence, Kling Team,
# Kuaishou): model input, reproduced character for character, trailing spaces included.
TEMPLATE = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""  # noqa: E501, W291


def question(prompt: str) -> str:
    """The training question for ``prompt`` (``str.replace``: prompts may hold braces)."""
    return TEMPLATE.replace("{text_prompt}", prompt)


# -- checkpoint files ------------------------------------------------------------------------


def checkpoint_files(model_path: str | None, step: int | None) -> tuple[dict, str, str]:
    """(model_config.json contents, LoRA file, non-LoRA file) of the VideoReward folder."""
    if model_path is None:
        raise ValueError(f"{KEY}.model_path: required: the local VideoReward folder ({LAYOUT})")
    folder = os.path.expanduser(str(model_path))
    config_file = os.path.join(folder, "model_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{KEY}.model_path: {config_file} not found; expected {LAYOUT}")
    steps = sorted(
        int(path.rsplit("-", 1)[1])
        for path in glob.glob(os.path.join(folder, "checkpoint-*"))
        if path.rsplit("-", 1)[1].isdigit()
    )
    if not steps:
        raise ValueError(
            f"{KEY}.model_path: no checkpoint-<step>/ folder in {folder}; expected {LAYOUT}"
        )
    if step is not None and step not in steps:
        raise ValueError(f"{KEY}.checkpoint_step: {step} not in {folder} (found {steps})")
    checkpoint = os.path.join(folder, f"checkpoint-{steps[-1] if step is None else step}")
    files = [
        os.path.join(checkpoint, name)
        for name in ("adapter_model.safetensors", "non_lora_state_dict.pth")
    ]
    for path in files:
        if not os.path.isfile(path):
            raise ValueError(f"{KEY}.model_path: {path} not found; expected {LAYOUT}")
    return read_model_config(config_file), files[0], files[1]


def read_model_config(path: str) -> dict:
    """``model_config.json``'s object; a damaged or foreign file is a ValueError naming it."""
    try:
        with open(path) as handle:
            config = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{KEY}.model_path: {path} is not valid JSON ({error})") from None
    sections = ("data_config", "model_config", "peft_lora_config")
    if not isinstance(config, dict) or not all(isinstance(config.get(k), dict) for k in sections):
        raise ValueError(
            f"{KEY}.model_path: {path} must be a JSON object with the objects {sections}, "
            f"got {type(config).__name__}"
        )
    return config


def _first_line(error: BaseException) -> str:
    """An exception's first line (torch's weights-only refusal runs to a page)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def read_state(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``.pth`` state dict (weights only: a pickle planting code is refused) or
    a ``.safetensors`` file; a truncated, damaged or foreign file is a ValueError naming it."""
    from safetensors.torch import load_file

    try:
        if path.endswith(".safetensors"):
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip, safetensors and EOF errors of a damaged file
        raise ValueError(
            f"{KEY}.model_path: {path} cannot be read ({_first_line(error)}); download it again"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(
            f"{KEY}.model_path: {path} holds a {type(state).__name__}, not a state dict of "
            "named tensors"
        )
    return state


def checked_config(config: dict) -> dict:
    """The data config, after checking the checkpoint is one this module reproduces."""
    data, model = config.get("data_config", {}), config.get("model_config", {})
    lora = config.get("peft_lora_config", {})
    found = (
        data.get("prompt_template_type"),
        data.get("sample_type", "uniform"),
        model.get("reward_token"),
        model.get("output_dim"),
        lora.get("lora_enable"),
    )
    if found != ("detailed_special", "uniform", "special", 3, True):
        raise ValueError(
            f"{KEY}.model_path: model_config.json describes (prompt_template_type, sample_type, "
            f"reward_token, output_dim, lora_enable) = {found}; this reward reproduces the "
            f"published VideoReward: ('detailed_special', 'uniform', 'special', 3, True)"
        )
    return data


def base_folder(base_model_path: str | None, config: dict) -> str:
    """The local Qwen2-VL folder the checkpoint was trained from."""
    trained_from = config.get("model_config", {}).get("model_name_or_path")
    if base_model_path is None:
        raise ValueError(
            f"{KEY}.base_model_path: required: the local folder of {trained_from!r} (config, "
            f"weights, tokenizer), e.g. huggingface-cli download {trained_from} --local-dir DIR"
        )
    folder = os.path.expanduser(str(base_model_path))
    for name in ("config.json", "tokenizer_config.json"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise ValueError(
                f"{KEY}.base_model_path: {os.path.join(folder, name)} not found; expected the "
                f"save_pretrained folder of {trained_from!r} with its tokenizer"
            )
    return folder


def module_name(stored: str) -> str:
    """transformers 5 name of a parameter stored by VideoAlign's peft / transformers 4.45 model."""
    name = stored.removeprefix("base_model.model.").replace(".base_layer.", ".")
    if name.startswith(("model.language_model.", "model.visual.")):
        return name
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name.removeprefix("model.")
    return name


def lora_updates(lora_state: dict, scale: float) -> dict[str, torch.Tensor]:
    """Weight name -> ``scale * B @ A`` (float32) of every LoRA pair in the adapter file."""
    updates = {}
    for key, down in lora_state.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise ValueError(f"{KEY}.model_path: unexpected adapter entry {key!r}")
            continue
        up = lora_state.get(key.replace(".lora_A.", ".lora_B."))
        if up is None:
            raise ValueError(f"{KEY}.model_path: adapter entry {key!r} has no lora_B partner")
        name = module_name(key.replace(".lora_A.", ".").replace(".default.", "."))
        updates[name] = scale * (up.float() @ down.float())
    return updates


def load_weights(model, non_lora_file: str, lora_file: str, lora_config: dict) -> torch.Tensor:
    """Stored weights into ``model`` with LoRA merged; returns the reward head [3, hidden]."""
    stored = read_state(non_lora_file)
    state = {module_name(key): value for key, value in stored.items()}
    head = state.pop("rm_head.weight", None)
    if head is None or head.shape[0] != len(HEADS):
        raise ValueError(f"{KEY}.model_path: {non_lora_file} holds no rm_head.weight [3, hidden]")
    state.pop("lm_head.weight", None)  # tied to the embeddings, unused for scoring
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(
            f"{KEY}.model_path: {non_lora_file} holds weights the Qwen2-VL base "
            f"does not have: {unknown[:4]}"
        )
    model.load_state_dict(state, strict=False)
    rank, alpha = lora_config.get("lora_r"), lora_config.get("lora_alpha")
    if not all(isinstance(v, (int, float)) and v > 0 for v in (rank, alpha)):
        raise ValueError(
            f"{KEY}.model_path: model_config.json's peft_lora_config needs positive lora_r and "
            f"lora_alpha, got {rank!r} and {alpha!r}"
        )
    scale = alpha / (math.sqrt(rank) if lora_config.get("use_rslora") else rank)
    with torch.no_grad():
        for name, update in lora_updates(read_state(lora_file), scale).items():
            if name not in own:
                raise ValueError(
                    f"{KEY}.model_path: {lora_file} adapts {name!r}, which the "
                    f"Qwen2-VL base does not have"
                )
            weight = own[name]
            weight.copy_((weight.float() + update).to(weight.dtype))
    return head.float()


# -- video input -------------------------------------------------------------------------------


def round_even(value: float) -> int:
    return round(value / 2) * 2


def frame_indices(total: int, video_fps: float, fps: float | None, num_frames: int | None):
    """Evenly spaced frame indices (first and last included), an even count when possible."""
    if num_frames is not None:
        count = round_even(num_frames)
    else:
        most = math.floor(min(FPS_MAX_FRAMES, total) / 2) * 2
        count = round_even(min(max(total / video_fps * fps, FPS_MIN_FRAMES), most))
    count = min(count, total)
    return torch.linspace(0, total - 1, max(count, 2)).round().long()


def resized_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of 28, nearest the aspect, area within [min, max] pixels."""
    factor = SIZE_FACTOR
    new_h = max(factor, round(height / factor) * factor)
    new_w = max(factor, round(width / factor) * factor)
    if new_h * new_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_h = math.floor(height / shrink / factor) * factor
        new_w = math.floor(width / shrink / factor) * factor
    elif new_h * new_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * grow / factor) * factor
        new_w = math.ceil(width * grow / factor) * factor
    return new_h, new_w


def patchify(frames: torch.Tensor, patch: int, temporal: int, merge: int):
    """Qwen2-VL patch rows of standardised frames [K, 3, H, W]: ([N, 3*t*p*p], grid (t, h, w)).

    Rows follow Qwen2-VL's order: time, then merge windows of ``merge x merge`` patches in
    raster order, then the patches inside a window.
    """
    if frames.shape[0] % temporal:  # pad with the last frame, as Qwen2-VL's processor does
        pad = temporal - frames.shape[0] % temporal
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    count, channels, height, width = frames.shape
    grid = (count // temporal, height // patch, width // patch)
    x = frames.reshape(
        grid[0], temporal, channels, grid[1] // merge, merge, patch, grid[2] // merge, merge, patch
    )
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, C, temporal, p, p)
    return x.reshape(grid[0] * grid[1] * grid[2], -1), grid


def video_patches(video: torch.Tensor, indices, size, patch, temporal, merge):
    """Patch rows and grid of one video [T, C, H, W] in [0, 1] (C = 1 or 3)."""
    frames = video.index_select(0, indices.to(video.device)).float().expand(-1, 3, -1, -1)
    frames = F.interpolate(frames * 255, size=size, mode="bicubic", antialias=True)
    frames = frames.round().clamp(0, 255) / 255  # 8-bit levels, as the decoded training videos
    mean = frames.new_tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = frames.new_tensor(CLIP_STD).view(1, 3, 1, 1)
    return patchify((frames - mean) / std, patch, temporal, merge)


# -- the reward --------------------------------------------------------------------------------


def checked_heads(heads: dict | None) -> dict[str, float]:
    heads = {name: 1.0 for name in HEADS} if heads is None else dict(heads)
    unknown = sorted(set(heads) - set(HEADS))
    if unknown or not heads:
        raise ValueError(
            f"{KEY}.heads: expected a non-empty mapping of {HEADS} to weights, got {heads}"
        )
    return {name: float(weight) for name, weight in heads.items()}


def head_stats(config: dict, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head (mean [3], std [3]) from the checkpoint's inference config, or (0, 1)."""
    if not normalize:
        return torch.zeros(len(HEADS)), torch.ones(len(HEADS))
    stats = config.get("inference_config") or {}
    keys = [f"{name}_{stat}" for stat in ("mean", "std") for name in HEADS]
    missing = [key for key in keys if key not in stats]
    if missing:
        raise ValueError(
            f"{KEY}.normalize: model_config.json's inference_config lacks "
            f"{missing}; set normalize=False to score without the stored stats"
        )
    values = torch.tensor([float(stats[key]) for key in keys])
    return values[: len(HEADS)], values[len(HEADS) :]


class VideoAlignReward:
    """VideoReward's weighted, standardised VQ / MQ / TA scores of (video, prompt) pairs."""

    def __init__(
        self,
        *,
        model_path,
        base_model_path,
        heads,
        normalize,
        video_fps,
        num_frames,
        max_pixels,
        min_pixels,
        checkpoint_step,
        batch_size,
        device,
        dtype,
    ) -> None:
        weights = checked_heads(heads)
        if batch_size < 1:
            raise ValueError(f"{KEY}.batch_size: must be >= 1, got {batch_size}")
        if num_frames is not None and num_frames < 2:
            raise ValueError(f"{KEY}.num_frames: must be None or >= 2, got {num_frames}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"{KEY}.dtype: got {dtype!r}, expected None or one of {list(DTYPES)}")
        config, lora_file, non_lora_file = checkpoint_files(model_path, checkpoint_step)
        data = checked_config(config)
        base = base_folder(base_model_path, config)
        self.fps = None if num_frames is not None else data.get("fps") or 2.0
        self.num_frames = num_frames if num_frames is not None else data.get("num_frames")
        self.max_pixels = max_pixels or data.get("max_frame_pixels")
        if not self.max_pixels:
            raise ValueError(
                f"{KEY}.max_pixels: required: model_config.json has no max_frame_pixels"
            )
        self.min_pixels, self.video_fps, self.batch_size = min_pixels, video_fps, batch_size
        self.mean, self.std = head_stats(config, normalize)
        self.weights = torch.tensor([weights.get(name, 0.0) for name in HEADS])
        self.dtype = DTYPES[dtype or ("bfloat16" if torch.cuda.is_available() else "float32")]
        self._load(base, lora_file, non_lora_file, config["peft_lora_config"])
        self.device = torch.device("cpu")
        self.fixed_device = None if device is None else torch.device(device)
        self._lock = threading.Lock()
        if self.fixed_device is not None:
            self.to(self.fixed_device)

    def _load(self, base: str, lora_file: str, non_lora_file: str, lora_config: dict) -> None:
        from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

        self.tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
        self.tokenizer.add_tokens(list(REWARD_TOKENS.values()), special_tokens=True)
        full = Qwen2VLForConditionalGeneration.from_pretrained(
            base, local_files_only=True, dtype=self.dtype
        )
        full.resize_token_embeddings(len(self.tokenizer))
        self.head = load_weights(full, non_lora_file, lora_file, lora_config)
        self.model = full.model.eval().requires_grad_(False)  # lm_head is not used
        vision = full.config.vision_config
        self.patching = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        self.video_id = full.config.video_token_id
        self.token_ids = self.tokenizer.convert_tokens_to_ids(list(REWARD_TOKENS.values()))
        if self.tokenizer.convert_tokens_to_ids(VIDEO_TOKEN) != self.video_id:
            raise ValueError(
                f"{KEY}.base_model_path: the tokenizer's {VIDEO_TOKEN} is not the "
                f"model's video_token_id {self.video_id}"
            )
        self.prefix_ids = self.tokenizer(CHAT_PREFIX, add_special_tokens=False).input_ids
        self.pad_id = self.tokenizer.pad_token_id or 0

    def to(self, device: torch.device) -> None:
        with self._lock:
            if self.device != device:
                self.model.to(device)
                self.head = self.head.to(device)
                self.device = device

    def input_ids(self, prompt: str, video_tokens: int) -> list[int]:
        suffix = CHAT_SUFFIX.format(question=question(prompt))
        suffix_ids = self.tokenizer(suffix, add_special_tokens=False).input_ids
        return self.prefix_ids + [self.video_id] * video_tokens + suffix_ids

    def patches(self, videos: torch.Tensor):
        """Patch rows [N, D] of the batch and its grids [B, 3]."""
        indices = frame_indices(videos.shape[1], self.video_fps, self.fps, self.num_frames)
        size = resized_size(*videos.shape[-2:], self.min_pixels, self.max_pixels)
        parts = [video_patches(video, indices, size, *self.patching) for video in videos]
        rows = torch.cat([part[0] for part in parts])
        return rows, torch.tensor([part[1] for part in parts], device=rows.device)

    def head_scores(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Raw VQ, MQ, TA scores [b, 3] of a batch."""
        rows, grids = self.patches(videos)
        tokens = (grids.prod(-1) // self.patching[2] ** 2).tolist()
        ids = [self.input_ids(prompt, count) for prompt, count in zip(prompts, tokens, strict=True)]
        length = max(map(len, ids))
        input_ids = torch.tensor(
            [row + [self.pad_id] * (length - len(row)) for row in ids], device=self.device
        )
        mask = torch.tensor(
            [[1] * len(row) + [0] * (length - len(row)) for row in ids], device=self.device
        )
        embeds = self.model.get_input_embeddings()(input_ids)
        video = self.model.get_video_features(rows.to(self.dtype), grids).pooler_output
        embeds[input_ids == self.video_id] = torch.cat(video).to(embeds.dtype)
        # no position_ids: the text model then uses the plain index on every M-RoPE axis
        hidden = self.model.language_model(inputs_embeds=embeds, attention_mask=mask)[0]
        found = torch.stack([(input_ids == token).int().argmax(1) for token in self.token_ids], 1)
        at_tokens = hidden.gather(1, found[..., None].expand(-1, -1, hidden.shape[-1]))
        return (at_tokens.float() * self.head).sum(-1)  # head row k at the token of head k

    @torch.no_grad()
    def scores(self, videos: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Standardised per-head scores ``{VQ, MQ, TA}`` (float32 [B] each) of a batch."""
        if videos.shape[2] not in (1, 3):
            raise ValueError(f"videos: expected 1 or 3 channels, got {videos.shape[2]}")
        self.to(self.fixed_device or videos.device)  # the videos' device unless `device` is set
        videos = videos.to(self.device)
        raw = torch.cat(
            [
                self.head_scores(
                    videos[start : start + self.batch_size],
                    prompts[start : start + self.batch_size],
                )
                for start in range(0, len(prompts), self.batch_size)
            ]
        )
        values = (raw - self.mean.to(raw.device)) / self.std.to(raw.device)
        return dict(zip(HEADS, values.unbind(-1), strict=True))

    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]):
        values = torch.stack(list(self.scores(videos, prompts).values()), -1)
        return (values @ self.weights.to(values.device)).float().to(videos.device)


@register_reward("videoalign")
def videoalign(
    *,
    model_path: str | None = None,
    base_model_path: str | None = None,
    heads: dict | None = None,
    normalize: bool = True,
    video_fps: float = 16.0,
    num_frames: int | None = None,
    max_pixels: int | None = None,
    min_pixels: int = VIDEO_MIN_PIXELS,
    checkpoint_step: int | None = None,
    batch_size: int = 2,
    device: str | None = None,
    dtype: str | None = None,
) -> RewardFn:
    """VideoReward's weighted VQ / MQ / TA scores (default: their sum, the "Overall")."""
    return VideoAlignReward(
        model_path=model_path,
        base_model_path=base_model_path,
        heads=heads,
        normalize=normalize,
        video_fps=video_fps,
        num_frames=num_frames,
        max_pixels=max_pixels,
        min_pixels=min_pixels,
        checkpoint_step=checkpoint_step,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
    )
