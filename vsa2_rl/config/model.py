"""Config sections of the model: ``model`` (with ``model.lora``), ``attention`` and ``sparsity``."""

from __future__ import annotations

from dataclasses import dataclass, field

from vsa2_rl.config.checks import _check, _check_choice, _doc, _expand_user

# Bounds of a video's size, checked on the numbers before anything is allocated: a side or a
# frame count beyond them is a typo, whose tensors would exhaust any machine's memory.
MAX_SIDE = 16384
MAX_VIDEO_PIXELS = 2**31 - 1
# the model.kind choices: the families of vsa2_rl.models.family (which imports this package,
# so the names are listed here; a test keeps the two equal)
MODEL_KINDS = ("toy", "wan", "hunyuan_video15", "minimax_h3", "ltx2")
# what model.path must hold for each model.kind that needs one
FOLDERS = {
    "wan": "a local diffusers Wan directory, e.g. model.path=/data/Wan2.1-T2V-1.3B-Diffusers",
    "hunyuan_video15": "a local diffusers HunyuanVideo-1.5 text-to-video directory, e.g. "
    "model.path=/data/HunyuanVideo-1.5-480p_t2v",
    "minimax_h3": "a local diffusers MiniMax-H3 directory, e.g. model.path=/data/MiniMax-H3",
    "ltx2": "a local diffusers LTX-2 directory, e.g. model.path=/data/LTX-2",
}


@dataclass
class LoraConfig:
    """LoRA adapters on the transformer (peft). Disabled = full fine-tuning."""

    enabled: bool = _doc("Train LoRA adapters instead of all weights.", default=False)
    rank: int = _doc("LoRA rank r.", default=16)
    alpha: float = _doc("LoRA scaling alpha (effective scale alpha / rank).", default=16.0)
    target_modules: list[str] = _doc(
        "Module names to adapt (peft target_modules).",
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
    )
    init_from: str | None = _doc(
        "A peft adapter folder (adapter_config.json + adapter_model.safetensors, e.g. from "
        "vsa2-rl export; for Wan2.2 A14B an export with transformer/ and transformer_2/ "
        "adapter folders) to start the adapters from, and the VSA2 routers and gates from its "
        "vsa2.safetensors where it has one (an export's); its rank, alpha and target modules "
        "must equal these. Empty = fresh adapters.",
        default=None,
    )

    def __post_init__(self) -> None:
        _expand_user(self, "init_from")
        _check(self.rank >= 1, "model.lora.rank", f"must be >= 1, got {self.rank}")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(bool(self.target_modules), "model.lora.target_modules", "must not be empty")


@dataclass
class ModelConfig:
    """The video DiT to fine-tune."""

    kind: str = _doc(
        "'toy' = the library's small Wan-architecture model (pixel latents, built-in text "
        "encoder; no download), 'wan' = a local diffusers Wan2.1 or Wan2.2 directory at "
        "model.path (T2V, I2V, TI2V-5B, A14B; what it is comes from its model_index.json), "
        "'hunyuan_video15' = a local diffusers HunyuanVideo-1.5 text-to-video directory at "
        "model.path (no compiled or fused blocks, no sequence parallelism yet), 'minimax_h3' = "
        "a local diffusers MiniMax-H3 directory at model.path, trained on video (its audio rows "
        "held as noise; no compiled or fused blocks, no sequence parallelism yet), 'ltx2' = a "
        "local diffusers LTX-2 (or LTX-2.3) directory at model.path, trained on video (its audio "
        "latents held as noise; no compiled or fused blocks, no sequence parallelism yet).",
        default="toy",
    )
    path: str | None = _doc(
        "Local directory of the model. kind=wan: a diffusers Wan folder such as "
        "/data/Wan2.1-T2V-1.3B-Diffusers (transformer/, text_encoder/, tokenizer/, vae/; "
        "Wan2.2 A14B adds transformer_2/, Wan2.1 I2V image_encoder/ and image_processor/). "
        "kind=hunyuan_video15: a diffusers HunyuanVideo-1.5 text-to-video folder such as "
        "/data/HunyuanVideo-1.5-480p_t2v (transformer/, vae/, text_encoder/, tokenizer/, "
        "text_encoder_2/, tokenizer_2/). kind=minimax_h3: a diffusers MiniMax-H3 folder such as "
        "/data/MiniMax-H3 (transformer/, vae/, text_encoder/, tokenizer/). kind=ltx2: a "
        "diffusers LTX-2 folder such as /data/LTX-2 (transformer/, vae/, audio_vae/, "
        "text_encoder/, tokenizer/, connectors/). kind=toy: optional checkpoint folder; empty = "
        "the shipped toy model.",
        default=None,
    )
    train_experts: list[str] = _doc(
        "Wan2.2 A14B: the experts RL trains, of high_noise (the folder's transformer/) and "
        "low_noise (transformer_2/); the other stays frozen and holds no optimizer state. "
        "Empty = every expert (and the only choice for one-transformer models).",
        default_factory=list,
    )
    dtype: str = _doc(
        "Weights/compute dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.",
        default="auto",
    )
    allow_tf32: bool = _doc(
        "float32 on CUDA: matrix products in TF32 (10-bit mantissa, several times faster on "
        "Ampere and Hopper; diffusers' --allow_tf32). Weights stay float32; torch's default "
        "(off) is kept when false.",
        default=False,
    )
    vae_decode_dtype: str = _doc(
        "kind=wan: dtype the VAE decodes rollout and evaluation videos in: float32 or bfloat16 "
        "(a bfloat16 copy of the decoder, 147 MB more for Wan2.1's VAE; image conditions are "
        "still encoded in float32). On an H100: 1.34x faster, 48 dB PSNR against float32, "
        "but image_quality changes twice as much as 8-bit rounding does "
        "(benchmarks/bench_vae_decode.py). The toy has no VAE: float32 only.",
        default="float32",
    )
    num_frames: int = _doc("Frames per generated video (pixel space).", default=8)
    height: int = _doc("Video height in pixels.", default=32)
    width: int = _doc("Video width in pixels.", default=32)
    text_cache_dir: str | None = _doc(
        "Folder for cached prompt embeddings (one file per prompt); empty = out_dir/text_cache.",
        default=None,
    )
    gradient_checkpointing: bool = _doc(
        "Recompute transformer blocks in the backward pass to save memory.", default=False
    )
    compile_blocks: bool = _doc(
        "torch.compile every transformer block (diffusers' regional compilation): faster steps "
        "after the first ones, which compile. The VSA2 call stays eager inside each block "
        "(vsa2_rl.models.wan.compile_blocks says how).",
        default=False,
    )
    fused_kernels: bool = _doc(
        "Uncompiled VSA2 blocks run their LayerNorms, adaLN shift/scale/gate, residuals, RMS "
        "qk-norm and RoPE as fused Triton kernels (vsa2_rl.kernels.fused_block) on CUDA; CPU "
        "and float64 keep the unfused math. Not with compile_blocks=true (inductor fuses the "
        "same ops). One Wan-1.3B block at 480p x 81 on an H100: 1.29x forward, 1.17x "
        "forward+backward against unfused eager (benchmarks/bench_block_kernels.py).",
        default=False,
    )
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _expand_user(self, "path", "text_cache_dir")
        _check_choice(self.kind, "model.kind", MODEL_KINDS)
        for expert in self.train_experts:
            _check_choice(expert, "model.train_experts", ("high_noise", "low_noise"))
        _check(
            len(set(self.train_experts)) == len(self.train_experts),
            "model.train_experts",
            f"names an expert twice: {list(self.train_experts)}",
        )
        _check_choice(self.dtype, "model.dtype", ("auto", "float32", "bfloat16", "float16"))
        _check_choice(self.vae_decode_dtype, "model.vae_decode_dtype", ("float32", "bfloat16"))
        _check(
            not (self.fused_kernels and self.compile_blocks),
            "model.fused_kernels",
            "is for uncompiled blocks, and model.compile_blocks=true fuses the same work with "
            "inductor: set one of them",
        )
        for key in ("height", "width"):
            value = getattr(self, key)
            _check(value >= 1, f"model.{key}", f"must be >= 1, got {value}")
            _check(
                value <= MAX_SIDE,
                f"model.{key}",
                f"must be at most {MAX_SIDE} pixels, got {value} (Wan renders 480p and 720p)",
            )
        pixels = self.num_frames * self.height * self.width
        _check(
            pixels <= MAX_VIDEO_PIXELS,
            "model.num_frames",
            f"model.num_frames x model.height x model.width = {pixels:,} pixels a video, more "
            f"than {MAX_VIDEO_PIXELS:,} (720p x 81 frames is 74,649,600); lower one of them",
        )
        _check(
            self.num_frames >= 2,
            "model.num_frames",
            f"must be >= 2 (the rewards score motion between frames), got {self.num_frames}",
        )
        if self.kind != "toy":
            _check(
                bool(self.path), "model.path", f"model.kind={self.kind} needs {FOLDERS[self.kind]}"
            )
        _check(
            self.kind == "wan" or not self.train_experts,
            "model.train_experts",
            f"the {self.kind} model has one transformer; leave it empty",
        )
        _check(
            self.kind == "wan" or self.vae_decode_dtype == "float32",
            "model.vae_decode_dtype",
            "the toy model has no VAE (its latents are pixels); leave it at float32"
            if self.kind == "toy"
            else f"the {self.kind} model decodes in float32 only; leave it at float32",
        )
        if self.kind in ("hunyuan_video15", "minimax_h3", "ltx2"):
            for key in ("compile_blocks", "fused_kernels"):
                _check(
                    not getattr(self, key),
                    f"model.{key}",
                    f"model.kind={self.kind} has no compiled or fused blocks yet; set it false",
                )


@dataclass
class AttentionConfig:
    """VSA2 sparse attention (docs/concepts.md, "VSA2 attention")."""

    enabled: bool = _doc("Use VSA2 in self-attention; false = dense attention.", default=True)
    q_tile: int = _doc("Query tile size in tokens (one 4x4x4 cube).", default=64)
    kv_block: int = _doc("Key segment size chosen by the router: 16, 32 or 64.", default=16)
    mode: str = _doc(
        "Router selection: 'topp' (variable count: smallest set with router mass >= top_p) or "
        "'topk' (fixed count, VSA-compatible).",
        default="topp",
    )
    top_p: float = _doc("Router mass each query tile must cover in topp mode.", default=0.9)
    min_kv: int = _doc("Fewest key segments per query tile.", default=1)
    dense_threshold: float = _doc(
        "While the scheduled density (1 - sparsity) is >= this, the fine stage is exact dense "
        "attention (sparse rebasing warm-up).",
        default=0.99,
    )
    backend: str = _doc(
        "Kernel backend: auto (Triton on CUDA, torch reference on CPU), triton, torch.",
        default="auto",
    )

    def __post_init__(self) -> None:
        _check(self.q_tile == 64, "attention.q_tile", f"only 64 is supported, got {self.q_tile}")
        _check(
            self.kv_block in (16, 32, 64),
            "attention.kv_block",
            f"must be 16, 32 or 64, got {self.kv_block}",
        )
        _check_choice(self.mode, "attention.mode", ("topp", "topk"))
        _check(0.0 < self.top_p <= 1.0, "attention.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.min_kv >= 1, "attention.min_kv", f"must be >= 1, got {self.min_kv}")
        _check(
            0.0 < self.dense_threshold <= 1.0,
            "attention.dense_threshold",
            f"must be in (0, 1], got {self.dense_threshold}",
        )
        _check_choice(self.backend, "attention.backend", ("auto", "triton", "torch"))


# The kernels and models take the attention settings under this name (docs/kernels.md).
VSA2Config = AttentionConfig


@dataclass
class SparsityConfig:
    """Hard-to-easy sparsity schedule: rollout and training share one value, evaluation is lower."""

    train: float = _doc("Sparsity of rollouts and training forwards (after warm-up).", default=0.9)
    train_end: float | None = _doc(
        "If set, the train/rollout sparsity moves linearly from `train` to this value over the "
        "run (a curriculum); empty = constant.",
        default=None,
    )
    eval: float = _doc("Sparsity used for evaluation (lower = easier).", default=0.75)
    warmup_steps: int = _doc(
        "Sparse-rebasing warm-up: density anneals from dense to the target over these steps.",
        default=0,
    )
    warmup_shape: str = _doc("Warm-up curve: linear or cosine.", default="cosine")
    max_rollout_velocity_error: float | None = _doc(
        "Warn once, at step 0's evaluation, when eval/rollout_velocity_rel_error (the "
        "velocity's relative error against dense attention at the rollout sparsity) exceeds "
        "this; empty = never warn. Needs eval.every > 0 and eval.agreement_prompts > 0. "
        "0.11: on both toy testbeds RL kept dense rollouts' gain at errors up to 0.106 and "
        "lost it from 0.141 (docs/results.md).",
        default=0.11,
    )

    def __post_init__(self) -> None:
        for key in ("train", "eval"):
            value = getattr(self, key)
            _check(0.0 <= value < 1.0, f"sparsity.{key}", f"must be in [0, 1), got {value}")
        if self.train_end is not None:
            _check(
                0.0 <= self.train_end < 1.0,
                "sparsity.train_end",
                f"must be in [0, 1), got {self.train_end}",
            )
        _check(
            self.eval <= self.train,
            "sparsity.eval",
            f"hard-to-easy: evaluation sparsity ({self.eval}) must not exceed the train "
            f"sparsity ({self.train}); lower sparsity.eval or raise sparsity.train",
        )
        _check(
            self.train_end is None or self.eval <= self.train_end,
            "sparsity.train_end",
            f"hard-to-easy: the curriculum ends at sparsity {self.train_end}, below the "
            f"evaluation sparsity ({self.eval}); raise sparsity.train_end or lower sparsity.eval",
        )
        _check(
            self.warmup_steps >= 0,
            "sparsity.warmup_steps",
            f"must be >= 0, got {self.warmup_steps}",
        )
        _check_choice(self.warmup_shape, "sparsity.warmup_shape", ("linear", "cosine"))
        _check(
            self.max_rollout_velocity_error is None or self.max_rollout_velocity_error >= 0,
            "sparsity.max_rollout_velocity_error",
            f"must be >= 0 (empty = never warn), got {self.max_rollout_velocity_error}",
        )
