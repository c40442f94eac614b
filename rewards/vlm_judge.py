"""``vlm_judge``: a video-language model from transformers judges whether a video shows its prompt.

The recipe of VideoAlign (Liu et al., 2025, "Improving Video Generation with Human Feedback":
a Qwen2-VL reward model reading sampled frames and the prompt, scored from the last token) and
of flow_grpo's VLM rewards (a chat question about the sample, scored from the model's next-token
distribution). Per video, ``num_frames`` evenly spaced frames (first and last included) are
converted to 8-bit RGB and handed, with a chat question built from ``question`` (``{prompt}`` is
replaced by the prompt), to the model's own processor, which resizes and patchifies them as the
model expects. The chat template's generation prompt ends the text, so the last position is
where the model starts its answer:

- ``mode="yes_no"``: the score is log p(``yes_token``) - log p(``no_token``) of the next token,
  i.e. the difference of the two logits (the softmax normaliser cancels): positive when the model
  would rather answer yes; unbounded.
- ``mode="scalar_head"``: the score is ``weight . h + bias``, a linear head on the final
  (normalised) hidden state ``h`` of the last token, as VideoAlign's reward head; ``head_path``
  is a safetensors file with ``weight`` ([1, hidden] or [hidden]) and an optional ``bias`` ([1]).

Nothing is downloaded: ``path`` is a local folder saved with ``save_pretrained`` holding the model
(``config.json`` with ``model_type`` equal to ``architecture``, weights) and its processor
(tokenizer with a chat template, video processor), loaded with ``AutoProcessor`` and
``AutoModelForImageTextToText`` (``local_files_only=True``) once, when the reward is built. The
model moves to the videos' device on first use; videos are scored ``batch_size`` at a time,
left-padded so that every row's last position is its own last token, under ``torch.no_grad``;
weights are bf16 by default when CUDA is available, float32 otherwise (``dtype``).
"""

from __future__ import annotations

import json
import os
import threading

import torch

from .clip import KEY, required_file
from .image_quality import sample_frames
from .registry import RewardFn, register_reward

MODES = ("yes_no", "scalar_head")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_QUESTION = "Does this video show: {prompt}? Answer yes or no."


def model_folder(path: str | None, architecture: str) -> str:
    """The local model folder ``path``, checked to hold a ``config.json`` of ``architecture``."""
    if path is None:
        raise ValueError(
            f"{KEY}.path: required: a local transformers folder (saved with save_pretrained) "
            f"holding a {architecture!r} model and its processor"
        )
    folder = os.path.expanduser(str(path))
    config_file = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise ValueError(f"{KEY}.path: folder not found: {folder}")
    if not os.path.isfile(config_file):
        raise ValueError(
            f"{KEY}.path: {folder} has no config.json; point it at a folder saved with "
            f"save_pretrained (model and processor)"
        )
    with open(config_file) as handle:
        found = json.load(handle).get("model_type")
    if found != architecture:
        raise ValueError(
            f"{KEY}.architecture: expected a {architecture!r} model, but {config_file} has "
            f"model_type {found!r}; set architecture={found!r} if that model is meant, or point "
            f"{KEY}.path at a {architecture!r} checkpoint"
        )
    return folder


def single_token_id(tokenizer, text: str, key: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"{KEY}.{key}: {text!r} is {len(ids)} tokens for this tokenizer, the yes/no score "
            f"needs a single token (e.g. 'Yes' / 'No' for Qwen2-VL)"
        )
    return ids[0]


def load_linear_head(head_path: str | None, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [hidden], bias []) of the scalar head in the safetensors file ``head_path``."""
    from safetensors.torch import load_file

    head_file = required_file(
        head_path,
        "head_path",
        f"a safetensors file with the scalar head's 'weight' [1, {hidden_size}] and optional "
        f"'bias' [1]",
    )
    state = load_file(head_file)
    weight = state.get("weight")
    bias = state.get("bias", torch.zeros(1))
    if weight is None or weight.numel() != hidden_size or bias.numel() != 1:
        shapes = {name: tuple(value.shape) for name, value in state.items()}
        raise ValueError(
            f"{KEY}.head_path: {head_file} must hold 'weight' [1, {hidden_size}] (the model's "
            f"hidden size) and optionally 'bias' [1], got {shapes}"
        )
    return weight.reshape(hidden_size).float(), bias.reshape(()).float()


class VlmJudge:
    """A local image-text-to-text model and its processor scoring (video, prompt) pairs."""

    def __init__(
        self,
        *,
        path: str | None,
        mode: str,
        question: str,
        num_frames: int,
        batch_size: int,
        dtype: str | None,
        architecture: str,
        head_path: str | None,
        yes_token: str,
        no_token: str,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"{KEY}.mode: got {mode!r}, expected one of {MODES}")
        if "{prompt}" not in question:
            raise ValueError(f"{KEY}.question: must contain '{{prompt}}', got {question!r}")
        if num_frames < 1:
            raise ValueError(f"{KEY}.num_frames: must be >= 1, got {num_frames}")
        if batch_size < 1:
            raise ValueError(f"{KEY}.batch_size: must be >= 1, got {batch_size}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"{KEY}.dtype: got {dtype!r}, expected None or one of {list(DTYPES)}")
        if mode == "yes_no" and head_path is not None:
            raise ValueError(
                f"{KEY}.head_path: only read with mode='scalar_head' (mode is 'yes_no'); set "
                f"mode='scalar_head' or drop head_path"
            )
        folder = model_folder(path, architecture)
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
        if not getattr(self.processor, "chat_template", None):
            raise ValueError(
                f"{KEY}.path: the processor in {folder} has no chat template; save one with the "
                f"processor (chat_template.jinja)"
            )
        tokenizer = self.processor.tokenizer
        tokenizer.padding_side = "left"  # the last position is then every row's last token
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if dtype is None:
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        self.dtype = DTYPES[dtype]
        self.model = AutoModelForImageTextToText.from_pretrained(
            folder, local_files_only=True, dtype=self.dtype
        )
        self.model.eval().requires_grad_(False)
        self.mode, self.question = mode, question
        self.num_frames, self.batch_size = num_frames, batch_size
        if mode == "yes_no":
            self.answer_ids = torch.tensor(
                [
                    single_token_id(tokenizer, yes_token, "yes_token"),
                    single_token_id(tokenizer, no_token, "no_token"),
                ]
            )
        else:
            hidden_size = self.model.get_output_embeddings().in_features
            self.head_weight, self.head_bias = load_linear_head(head_path, hidden_size)
        self.device = torch.device("cpu")
        self._lock = threading.Lock()

    def to(self, device: torch.device) -> None:
        with self._lock:
            if self.device != device:
                self.model.to(device)
                if self.mode == "yes_no":
                    self.answer_ids = self.answer_ids.to(device)
                else:
                    self.head_weight = self.head_weight.to(device)
                    self.head_bias = self.head_bias.to(device)
                self.device = device

    def chat_text(self, prompt: str) -> str:
        question = self.question.replace("{prompt}", prompt)
        messages = [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}
        ]
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def score_batch(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Scores [b] of uint8 frames [b, K, 3, H, W] (CPU) and their prompts."""
        inputs = self.processor(
            text=[self.chat_text(prompt) for prompt in prompts],
            videos=list(frames),
            padding=True,
            do_sample_frames=False,  # the frames are already the sampled ones
            return_tensors="pt",
        ).to(device=self.device, dtype=self.dtype)  # dtype casts the pixels only
        if self.mode == "yes_no":
            logits = self.model(**inputs, logits_to_keep=1).logits[:, -1].float()
            yes, no = logits[:, self.answer_ids].unbind(dim=-1)
            return yes - no
        hidden = self.model.base_model(**inputs).last_hidden_state[:, -1].float()
        return hidden @ self.head_weight + self.head_bias

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        if videos.shape[2] not in (1, 3):
            raise ValueError(f"videos: expected 1 or 3 channels, got {videos.shape[2]}")
        self.to(videos.device)
        frames = sample_frames(videos, self.num_frames)
        frames = frames.expand(-1, -1, 3, -1, -1).mul(255).round().to(torch.uint8).cpu()
        scores = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            scores.append(self.score_batch(frames[start:end], prompts[start:end]))
        return torch.cat(scores).float()


@register_reward("vlm_judge")
def vlm_judge(
    *,
    path: str | None = None,
    mode: str = "yes_no",
    question: str = DEFAULT_QUESTION,
    num_frames: int = 8,
    batch_size: int = 4,
    dtype: str | None = None,
    architecture: str = "qwen2_vl",
    head_path: str | None = None,
    yes_token: str = "Yes",
    no_token: str = "No",
) -> RewardFn:
    """A local video-language model's judgement of the prompt: yes/no log-odds or a scalar head."""
    return VlmJudge(
        path=path,
        mode=mode,
        question=question,
        num_frames=num_frames,
        batch_size=batch_size,
        dtype=dtype,
        architecture=architecture,
        head_path=head_path,
        yes_token=yes_token,
        no_token=no_token,
    )
