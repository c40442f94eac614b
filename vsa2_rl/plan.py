"""Estimates of a run's per-GPU memory and seconds per RL step, from the model's shapes.

Pure functions of two frozen dataclasses (:class:`ModelShape`, :class:`StepShape`), so the
estimate needs no model in memory: ``vsa2-rl check`` builds the shapes from the weightless
transformer and the config. :func:`describe` turns the results into the plan's two lines.

**Memory** (:func:`memory_gib`), per GPU, from first principles: bf16 weights; bf16 gradients
of what trains; AdamW's two moments in the parameters' dtype (bf16) under DDP and FSDP2, or
DeepSpeed's fp32 master weights and fp32 moments (12 bytes a trained parameter) under ZeRO-2/3;
DDP's gradient buckets (one more bf16 gradient) on more than one GPU; the frozen copy that is
the KL reference of full fine-tuning (LoRA's reference is the model with its adapters off: no
copy); DiffusionNFT's old policy (a frozen copy of the model in full fine-tuning, else an fp32
copy of what trains plus a bf16 clone of it while the old policy runs, sharded under FSDP2);
an fp32 EMA of what trains. ZeRO-2 shards gradients and optimizer states over the GPUs,
ZeRO-3 and FSDP2 the weights too. Activations: a rollout forward (no gradients) holds one
block's working set; a training forward with gradient checkpointing holds each block's input
(tokens x hidden, bf16) plus one block's working set, without checkpointing every block's
working set. Classifier-free guidance doubles the videos of a forward; sequence parallelism
over P GPUs divides the tokens a GPU holds by P (the all-to-all buffers are left out). Both
activation terms carry one factor, :data:`ACTIVATION_FACTOR`, fitted to the measured peaks
:data:`MEMORY_MEASUREMENTS` (H200, 2026-12-02/03, docs/results.md). VSA2's buffers have no
term of their own: its extra memory is modelled as its router's and gates' gradients and
optimizer state, which dense attention never trains. Left out: the VAE and its decode, the text
encoder, rewards, DeepSpeed's and FSDP2's communication buffers, the CUDA context.

**Time** (:func:`seconds_per_step`): FLOPs of one denoising forward (linear layers of self- and
cross-attention and the FFN; self-attention's ``4 x tokens^2 x hidden`` per layer, scaled by the
density ``1 - sparsity`` under VSA2, plus an overhead per token for its coarse stage, router and
gates) times seconds per FLOP, and a training pass (forward + backward with checkpointing) as
a fitted number of forwards. Two sets of constants (:data:`TIME_FITS`), fitted by least squares
(``scripts/fit_plan.py``) to ``benchmarks/results/rl_scale/*.md``, bf16, one NVIDIA H100 80GB
HBM3: uncompiled blocks, the Wan-1.3B shape at 14,040-111,600 tokens, dense and VSA2 (kv_block
16, top-p 0.9) at sparsity 0.9 (2026-12-06); compiled blocks (``model.compile_blocks``), 32,760
and 75,600 tokens, dense and the recipes' router (kv_block 64, top-k) at 0.875 (2026-12-07).
Other sparsities are interpolated linearly in density; fused kernels (``model.fused_kernels``)
are timed as uncompiled blocks (an overestimate: 18-28% at 480p x 81); other GPUs are not
modelled; the VAE decode, the text encoder, rewards and communication between GPUs are left
out (a step is its transformer work divided evenly over the GPUs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vsa2_rl.config import RunConfig

GIB = 2**30
ENGINES = ("ddp", "zero2", "zero3", "fsdp2")
H100_GIB = 79.6  # 81,559 MiB, what an H100 80GB HBM3 reports
H200_GIB = 140.4  # 143,771 MiB, what an H200 reports: the largest GPU the plan knows

# Fitted by scripts/fit_plan.py to MEMORY_MEASUREMENTS below (least squares).
ACTIVATION_FACTOR = 1.01


@dataclass(frozen=True)
class TimeFit:
    """Seconds per unit of each :func:`forward_terms` entry (``vsa2 overhead``: the coarse
    stage, router and tiling gathers), a training pass with checkpointing in forwards, the
    sparsities the fit saw and the timings' setting."""

    seconds_per: dict[str, float]
    train_factor: float
    sparsities: tuple[float, ...]
    setting: str


# Fitted by scripts/fit_plan.py to benchmarks/results/rl_scale/*.md (H100), keyed by whether
# the blocks are compiled (model.compile_blocks)
TIME_FITS = {
    False: TimeFit(
        {
            "linear": 4.216e-15,
            "dense attention": 1.701e-15,
            "vsa2 attention": 2.385e-15,
            "vsa2 overhead": 2.658e-11,
        },
        train_factor=4.09,
        sparsities=(0.0, 0.9),
        setting="uncompiled, VSA2 kv16 top-p",
    ),
    True: TimeFit(
        {
            "linear": 2.406e-15,
            "dense attention": 1.730e-15,
            "vsa2 attention": 2.506e-15,  # with VSA2's overhead (scripts/fit_plan.py)
            "vsa2 overhead": 0.0,
        },
        train_factor=4.21,
        sparsities=(0.0, 0.875),
        setting="compiled, VSA2 kv64 top-k",
    ),
}


@dataclass(frozen=True)
class ModelShape:
    """A transformer's shapes. ``params`` counts every expert (Wan2.2 A14B: both), VSA2's router
    and gates included; ``trained_params`` what takes gradients (LoRA adapters and VSA2's
    parameters, or every weight of the trained experts); the rest are one expert's."""

    params: int
    trained_params: int
    layers: int
    hidden: int
    ffn: int
    text_tokens: int = 512


@dataclass(frozen=True)
class StepShape:
    """One RL step: ``videos`` over all GPUs, ``trained_steps`` denoising steps recomputed with
    gradients per video, ``train_batch_size`` videos per forward (rollout and training), ``kl``
    a reference forward per trained step, ``sparsity`` 0 for dense attention,
    ``sequence_parallel`` the GPUs that share one video's tokens (``parallel.
    sequence_parallel_size``; ``gpus`` counts them all), ``compiled`` the blocks under
    torch.compile (``model.compile_blocks``), ``guided_update`` whether the update's passes run
    guidance's two branches too (Flow-GRPO) or the conditional one alone (DiffusionNFT),
    ``old_policy_forwards`` DiffusionNFT's forwards of its old policy per trained step (0 for
    Flow-GRPO, 1 for its conditional velocity, 2 for its guided one: ``nft.guidance=anchor``)."""

    tokens: int
    videos: int
    sampler_steps: int
    trained_steps: int
    train_batch_size: int = 1
    guidance: bool = False
    kl: bool = False
    ema: bool = False
    lora: bool = True
    checkpointing: bool = True
    sparsity: float = 0.0
    engine: str = "ddp"
    gpus: int = 1
    sequence_parallel: int = 1
    compiled: bool = False
    guided_update: bool = True
    old_policy_forwards: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.sequence_parallel < 1 or self.gpus % self.sequence_parallel:
            raise ValueError(
                f"sequence_parallel must divide gpus ({self.gpus}), got {self.sequence_parallel}"
            )

    @property
    def batch(self) -> int:
        """Videos in one rollout forward: guidance runs the unconditional branch in the same
        batch."""
        return self.train_batch_size * (2 if self.guidance else 1)

    @property
    def update_batch(self) -> int:
        """Videos in one training pass."""
        return self.batch if self.guided_update else self.train_batch_size


# ---- memory ----------------------------------------------------------------------------------


def _states_gib(model: ModelShape, step: StepShape) -> dict[str, float]:
    """Weights, gradients, optimizer, DDP buckets, reference and EMA, GiB per GPU."""
    n, t, gpus = model.params, model.trained_params, step.gpus
    sharded_weights = step.engine in ("zero3", "fsdp2")
    deepspeed = step.engine in ("zero2", "zero3")
    optimizer_bytes = 12 if deepspeed else 4  # fp32 master + 2 fp32 moments | 2 bf16 moments
    return {
        "weights": 2 * n / (gpus if sharded_weights else 1) / GIB,
        "gradients": 2 * t / (1 if step.engine == "ddp" else gpus) / GIB,
        "optimizer": optimizer_bytes * t / (1 if step.engine == "ddp" else gpus) / GIB,
        "buckets": 2 * t / GIB if step.engine == "ddp" and gpus > 1 else 0.0,
        "reference": 2 * t / GIB if step.kl and not step.lora else 0.0,
        "old policy": _old_policy_bytes(model, step) / GIB,
        "ema": 4 * t / GIB if step.ema else 0.0,
    }


def _old_policy_bytes(model: ModelShape, step: StepShape) -> float:
    """DiffusionNFT's old policy per GPU: full fine-tuning's frozen bf16 copy of the model, or
    (LoRA, ZeRO-3's partitions and FSDP2's shards) an fp32 copy of the trained tensors and their
    bf16 clone kept while the old policy's weights are swapped in."""
    if not step.old_policy_forwards:
        return 0.0
    sharded = step.engine in ("zero3", "fsdp2")
    if not step.lora and not sharded:
        return 2.0 * model.params
    return 6.0 * model.trained_params / (step.gpus if sharded else 1)


def block_bytes(model: ModelShape, tokens: float, batch: int) -> float:
    """One block's working set: q, k, v, attention output, the residual stream and norms
    (6 x hidden) and the FFN's hidden layer, bf16, for ``batch`` videos."""
    return 2 * batch * tokens * (6 * model.hidden + model.ffn)


def boundary_bytes(model: ModelShape, tokens: float, batch: int) -> float:
    """Every block's input, what gradient checkpointing keeps for the backward (bf16)."""
    return 2 * batch * tokens * model.hidden * model.layers


def activation_bytes(model: ModelShape, step: StepShape) -> dict[str, float]:
    """Activation bytes before calibration: ``rollout`` (one block's working set), ``training``
    (checkpoint boundaries + one block, or every block without checkpointing)."""
    tokens = step.tokens / step.sequence_parallel  # this GPU's share of each video
    block = block_bytes(model, tokens, step.batch)
    trained = block_bytes(model, tokens, step.update_batch)
    boundaries = boundary_bytes(model, tokens, step.update_batch)
    return {
        "rollout": block,
        "training": boundaries + trained if step.checkpointing else model.layers * trained,
    }


def states_update_gib(model: ModelShape, step: StepShape) -> float:
    """GiB per GPU the update holds besides activations."""
    return sum(_states_gib(model, step).values())


def memory_gib(model: ModelShape, step: StepShape) -> dict[str, float]:
    """Per-GPU GiB of each part, and the peaks ``rollout`` (no gradients held) and ``update``."""
    raw = activation_bytes(model, step)
    parts = {
        **_states_gib(model, step),
        "rollout activations": ACTIVATION_FACTOR * raw["rollout"] / GIB,
        "training activations": ACTIVATION_FACTOR * raw["training"] / GIB,
    }
    held = sum(parts[name] for name in ("weights", "optimizer", "reference", "old policy", "ema"))
    rollout = held + parts["rollout activations"]
    update = held + parts["gradients"] + parts["buckets"] + parts["training activations"]
    return {**parts, "rollout": rollout, "update": update, "peak": max(rollout, update)}


# ---- time ------------------------------------------------------------------------------------


def linear_flops(model: ModelShape, tokens: int) -> float:
    """FLOPs of one video's forward through the linear layers: self-attention's q, k, v, o,
    cross-attention's q, o (its k, v over the text tokens) and the two FFN matrices."""
    h = model.hidden
    per_layer = tokens * (8 * h * h + 4 * h * h + 4 * h * model.ffn) + 4 * h * h * model.text_tokens
    cross_scores = 4 * tokens * model.text_tokens * h
    return model.layers * (per_layer + cross_scores)


def attention_flops(model: ModelShape, tokens: int) -> float:
    """FLOPs of one video's dense self-attention forward: QK^T and PV, 4 x tokens^2 x hidden."""
    return model.layers * 4 * tokens * tokens * model.hidden


def forward_terms(model: ModelShape, tokens: int, sparsity: float) -> dict[str, float]:
    """What one video's forward costs, each in the unit its constant prices: linear FLOPs (with
    VSA2 its two gate projections too), dense attention FLOPs, VSA2 attention FLOPs (at the
    density ``1 - sparsity``) and VSA2's other overhead (tokens x hidden x layers)."""
    attention = attention_flops(model, tokens)
    vsa2 = sparsity > 0
    gates = 4 * tokens * model.hidden * model.hidden * model.layers if vsa2 else 0.0
    return {
        "linear": linear_flops(model, tokens) + gates,
        "dense attention": 0.0 if vsa2 else attention,
        "vsa2 attention": attention * (1 - sparsity) if vsa2 else 0.0,
        "vsa2 overhead": tokens * model.hidden * model.layers if vsa2 else 0.0,
    }


def forward_seconds(
    model: ModelShape, tokens: int, sparsity: float, compiled: bool = False
) -> float:
    """One video's denoising forward on an H100, its blocks compiled or not (see the module
    for what the fit covers)."""
    terms = forward_terms(model, tokens, sparsity)
    seconds_per = TIME_FITS[compiled].seconds_per
    return sum(seconds_per[name] * value for name, value in terms.items())


def seconds_per_step(model: ModelShape, step: StepShape) -> dict[str, float]:
    """Seconds of the ``rollout`` (every sampler step of every video, guided), the ``update``
    (each trained step: a training pass, with ``kl`` a reference forward, and DiffusionNFT's
    forwards of its old policy) and ``total``,
    the videos spread evenly over ``gpus``; ``interpolated`` is 1.0 where the sparsity is
    not one the constants were fitted at."""
    fit = TIME_FITS[step.compiled]
    forward = forward_seconds(model, step.tokens, step.sparsity, step.compiled)
    branches = 2 if step.guidance else 1
    videos = step.videos / step.gpus
    rollout = videos * step.sampler_steps * branches * forward
    no_grad_forwards = step.kl + step.old_policy_forwards
    per_trained = (fit.train_factor + no_grad_forwards) * forward
    update_branches = branches if step.guided_update else 1
    update = videos * step.trained_steps * update_branches * per_trained
    interpolated = float(min(abs(step.sparsity - s) for s in fit.sparsities) > 1e-9)
    return {
        "rollout": rollout,
        "update": update,
        "total": rollout + update,
        "interpolated": interpolated,
    }


# ---- printout --------------------------------------------------------------------------------


def step_shape(config: RunConfig, tokens: int) -> StepShape:
    """The :class:`StepShape` of a run's config with videos of ``tokens`` tokens, on one GPU
    under DDP (several with sequence parallelism: one group)."""
    rl, sampler = config.rl, config.sampler
    return StepShape(
        tokens=tokens,
        videos=rl.prompts_per_step * rl.group_size,
        sampler_steps=sampler.num_steps,
        trained_steps=trained_steps(config),
        train_batch_size=rl.train_batch_size,
        guidance=sampler.guidance_scale != 1 or (sampler.guidance_scale_2 or 1) != 1,
        kl=rl.kl_beta > 0,
        ema=config.train.ema_decay > 0,
        lora=config.model.lora.enabled,
        checkpointing=config.model.gradient_checkpointing,
        sparsity=config.sparsity.train if config.attention.enabled else 0.0,
        sequence_parallel=config.parallel.sequence_parallel_size,
        gpus=config.parallel.sequence_parallel_size,
        compiled=config.model.compile_blocks,
        guided_update=rl.algorithm != "nft",  # nft trains the conditional velocity alone
        old_policy_forwards=old_policy_forwards(config),
    )


def old_policy_forwards(config: RunConfig) -> int:
    """DiffusionNFT's forwards of its old policy per trained step: its conditional velocity, or
    with ``nft.guidance=anchor`` its guided one (both branches); none for Flow-GRPO."""
    if config.rl.algorithm != "nft":
        return 0
    return 2 if config.nft.guidance == "anchor" else 1


def trained_steps(config: RunConfig) -> int:
    """Denoising steps trained per video and update: Flow-GRPO's share of the stochastic
    steps, DiffusionNFT's noise levels; times the inner epochs."""
    rl, sampler = config.rl, config.sampler
    if rl.algorithm == "nft":
        per_video = config.nft.timesteps_per_sample(sampler.num_steps)
    else:
        window = sampler.sde_window or [0, sampler.num_steps]
        stochastic = sampler.sde_window_size or window[1] - window[0]
        per_video = max(1, math.floor(rl.timestep_fraction * stochastic))
    return per_video * rl.num_inner_epochs


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def describe(memory: dict[str, float], seconds: dict[str, float], step: StepShape) -> list[str]:
    """The plan's memory and time lines."""
    gpus = f"{step.gpus} GPU{'s' * (step.gpus > 1)}"
    fits = "yes" if memory["peak"] <= H100_GIB else "no"
    how = "interpolated in sparsity from" if seconds["interpolated"] else "fitted to"
    per = "one H100" if step.gpus == 1 else f"each of {step.gpus} H100s"
    return [
        f"rollout {memory['rollout']:.1f} GiB, update {memory['update']:.1f} GiB per GPU "
        f"({step.engine}, {gpus}; the transformer's share: VAE, text encoder, rewards not "
        f"counted); fits one H100 ({H100_GIB} GiB): {fits}",
        f"about {_duration(seconds['total'])} a step on {per} (rollout "
        f"{_duration(seconds['rollout'])}, update {_duration(seconds['update'])}); {how} "
        f"the Wan-1.3B shape's timings, {TIME_FITS[step.compiled].setting} (other GPUs, "
        "communication not modelled)",
    ]


def gpu_counts(step: StepShape, counts=(2, 4, 8)) -> tuple[int, ...]:
    """``counts`` rounded up to multiples of the sequence-parallel group (a group's GPUs share
    each video, so a run has whole groups): 2 / 4 / 8, or 4 / 8 with groups of 4, 8 with 8."""
    group = step.sequence_parallel
    return tuple(sorted({-(-n // group) * group for n in counts}))


def engine_peaks(model: ModelShape, step: StepShape, counts=(2, 4, 8)) -> dict:
    """Peak GiB per GPU of ``step`` under each engine on each of :func:`gpu_counts`."""
    return {
        engine: {
            n: memory_gib(model, dataclasses.replace(step, engine=engine, gpus=n))["peak"]
            for n in gpu_counts(step, counts)
        }
        for engine in ENGINES
    }


def smallest_peak(model: ModelShape, step: StepShape) -> float:
    """The least peak GiB per GPU ``step`` needs on up to 8 GPUs under any engine, with
    gradient checkpointing (what :func:`describe_engines` offers at best)."""
    checkpointed = dataclasses.replace(step, checkpointing=True)
    peaks = engine_peaks(model, checkpointed)
    return min(min(by_count.values()) for by_count in peaks.values())


def describe_engines(model: ModelShape, step: StepShape, counts=(2, 4, 8)) -> list[str]:
    """Peak GiB per GPU of ``step`` under each engine on ``counts`` GPUs (whole
    sequence-parallel groups, :func:`gpu_counts`), and on the step's own GPUs with gradient
    checkpointing switched the other way: the plan's lines for choosing a set-up."""
    peaks = engine_peaks(model, step, counts)
    engines = "; ".join(
        f"{engine} {' / '.join(f'{peak:.1f}' for peak in by_count.values())}"
        for engine, by_count in peaks.items()
    )
    other = "without" if step.checkpointing else "with"
    switched = dataclasses.replace(step, checkpointing=not step.checkpointing)
    gpus = "one GPU" if step.gpus == 1 else f"{step.gpus} GPUs"
    return [
        f"peak GiB per GPU on {' / '.join(map(str, gpu_counts(step, counts)))} GPUs: {engines}",
        f"{other} gradient checkpointing: {memory_gib(model, switched)['peak']:.1f} GiB on {gpus}",
    ]


# ---- the measured peaks the memory factors are fitted to -----------------------------------

_WAN_1_3B = dict(layers=30, hidden=1536, ffn=8960)  # base 1,418,996,800 + VSA2 141,650,280
_WAN_5B = dict(layers=30, hidden=3072, ffn=14336)  # base 4,999,787,712 + VSA2 566,416,080
_WAN_A14B = dict(layers=40, hidden=5120, ffn=13824)  # an expert: 14,288,901,184 + 2,097,563,200


def _lora(layers: int, hidden: int, rank: int = 32) -> int:
    """LoRA rank ``rank`` on to_q, to_k, to_v, to_out.0 of both attentions of every block."""
    return layers * 8 * rank * 2 * hidden


def _measured(name, shape, base, vsa2, trained, tokens, sparsity, gib, **step):
    """(name, ModelShape, StepShape, measured peak GiB). At sparsity 0 VSA2's parameters exist
    but take no gradient (the dense fallback skips them), so AdamW keeps no state for them."""
    model = ModelShape(base + vsa2, trained + (vsa2 if sparsity else 0), **shape)
    return name, model, StepShape(tokens, sparsity=sparsity, **step), gib


_A14B_LORA = 2 * _lora(40, 5120)
# docs/results.md: "One RL iteration" (bench_rl_step.py, compiled, full fine-tuning, H200) and
# "Wan2.2 RL iterations" (bench_wan22.py, uncompiled, LoRA rank 32, H200); no guidance, VAE or
# encoders. The trainer's peaks ("Two GPUs") also hold a VAE and its decode, not modelled here:
# scripts/fit_plan.py prints them beside the estimates, unfitted.
MEMORY_MEASUREMENTS = (
    *(
        _measured(f"1.3B full 480p x 33, {label}", _WAN_1_3B, 1_418_996_800, 141_650_280,
                  1_418_996_800, 14040, sparsity, gib, videos=2, sampler_steps=8, trained_steps=4,
                  lora=False)
        for label, sparsity, gib in (("dense", 0.0, 13.5), ("VSA2 0.9", 0.9, 14.8))
    ),
    *(
        _measured(f"TI2V-5B LoRA 704x1280 x 121, {label}", _WAN_5B, 4_999_787_712, 566_416_080,
                  _lora(30, 3072), 27280, sparsity, gib, videos=1, sampler_steps=8, trained_steps=2)
        for label, sparsity, gib in (("dense", 0.0, 24.0), ("VSA2 0.9", 0.9, 25.6))
    ),
    *(
        _measured(f"A14B LoRA both experts {label}", _WAN_A14B, 2 * 14_288_901_184,
                  2 * 2_097_563_200, _A14B_LORA, tokens, sparsity, gib, videos=1,
                  sampler_steps=steps, trained_steps=2)
        for label, tokens, sparsity, steps, gib in (
            ("480p x 81, dense", 32760, 0.0, 8, 83.8),
            ("480p x 81, VSA2 0.9", 32760, 0.9, 8, 94.6),
            ("720p x 81, VSA2 0.9", 75600, 0.9, 4, 118.7),
        )
    ),
)  # fmt: skip
