"""benchmarks/profile_rl_iteration.py: the kernel-name classifier on real kernel names, and the
phase table of one profiled trainer step of the toy model on the CPU (a row per phase the step
runs, figures that add up, phases within the step's wall)."""

import contextlib
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_rl_iteration as prof  # noqa: E402

# (names from the kernel outward: kernel, launching op, its parents), under autograd?, class
# fmt: off
NAMED = [
    (["_bsa_fwd_kernel", "vsa2_rl::block_sparse_attention_fwd"], False, "attention fwd"),
    (["_bsa_fwd_gluon_kernel", "vsa2_rl::block_sparse_attention_fwd"], False, "attention fwd"),
    (["_bsa_bwd_dq_kernel", "vsa2_rl::block_sparse_attention_bwd"], True, "attention bwd"),
    (["_bsa_bwd_dkv_kernel"], True, "attention bwd"),
    (["_bsa_bwd_fused_kernel"], True, "attention bwd"),
    (["_bsa_bwd_dq_gluon_kernel"], True, "attention bwd"),
    (["_pool_qkv_fwd_kernel", "_PoolQKV"], False, "attention fwd"),
    (["_pool_qkv_bwd_kernel"], True, "attention bwd"),
    (["_topk_log_softmax_kernel", "_TopLogProbs"], False, "attention fwd"),
    (["_dense_score_grad_kernel", "_TopLogProbsBackward"], True, "attention bwd"),
    (["_fusion_fwd_kernel", "_GatedFusion"], False, "attention fwd"),
    (["_fusion_bwd_kernel"], True, "attention bwd"),
    (["flash_fwd_kernel", "aten::_flash_attention_forward"], False, "attention fwd"),
    (["flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"], True, "attention bwd"),
    (["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"], False, "attention fwd"),
    (["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"], False,
     "attention fwd"),
    (["aten::_scaled_dot_product_flash_attention_for_cpu"], False, "attention fwd"),
    # a copy inside the attention op is the op's cost; its backward under the engine
    (["elementwise_kernel", "aten::copy_", "aten::scaled_dot_product_attention"], False,
     "attention fwd"),
    (["elementwise_kernel", "autograd::engine::evaluate_function: "
      "ScaledDotProductCudnnAttentionBackward0"], True, "attention bwd"),
    (["nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "aten::addmm"], False, "matrix products"),
    (["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "aten::mm"], True,
     "matrix products"),
    (["cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8"], False,
     "matrix products"),
    (["void cublasLt::splitKreduce_kernel<32, 16, int, float>", "aten::mm"], False,
     "matrix products"),
    (["aten::addmm"], False, "matrix products"),
    (["sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc",
      "aten::cudnn_convolution"], False, "convolutions"),
    (["void cudnn::ops::nchwToNhwcKernel", "aten::cudnn_convolution"], False, "convolutions"),
    (["aten::slow_conv3d_forward"], False, "convolutions"),
    (["void at::native::(anonymous namespace)::vectorized_layer_norm_kernel"], False,
     "norms, elementwise"),
    (["aten::native_layer_norm"], False, "norms, elementwise"),
    (["void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"],
     False, "norms, elementwise"),
    (["triton_poi_fused_add_mul_0"], False, "norms, elementwise"),
    (["aten::gelu"], False, "norms, elementwise"),
    (["void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "aten::_fused_adamw_"],
     False, "optimizer"),
    (["aten::_foreach_lerp_"], False, "optimizer"),
    (["Memcpy HtoD (Pageable -> Device)"], False, "other"),
    (["ncclDevKernel_AllReduce_Sum_f32_RING_LL"], False, "other"),
]
# fmt: on


@pytest.mark.parametrize(("names", "backward", "expected"), NAMED)
def test_classify_kernel_names(names, backward, expected):
    assert prof.classify(names, backward) == expected


def test_classes_cover_every_match():
    named = {kind for kind, _ in prof.KERNEL_CLASSES} - {prof.ATTENTION}
    assert named | {"attention fwd", "attention bwd", "other"} == set(prof.CLASSES)


TOY = [
    "model.num_frames=4",
    "sampler.num_steps=3",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.train_batch_size=2",
    "train.sample_every=0",
    "eval.every=0",
    "attention.backend=torch",
    "logging.progress=false",
]
PHASES = [
    "rollout/text_encode",
    "rollout/sample",
    "rollout/decode",
    "score/rewards",
    "score/advantages",
    "update/forward_backward",
    "update/optimizer",
    "checkpoint",
    prof.OUTSIDE,
]


def _table_rows(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return {row[0]: row[1:] for row in rows[1:]}  # rows[0]: the column names


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One toy run of 2 steps, the last profiled; the step's wall from outside the profiler."""
    folder = tmp_path_factory.mktemp("profile")
    walls = {}
    scope = prof.ProfiledTrainer.step_scope

    @contextlib.contextmanager
    def timed(self, step):
        start = time.perf_counter()
        with scope(self, step):
            yield
        walls[step] = time.perf_counter() - start

    argv = [
        "--config",
        str(ROOT / "configs" / "default.yaml"),
        "--steps",
        "2",
        "--out",
        str(folder / "profile.md"),
        "--trace",
        str(folder / "trace.json"),
        f"model.path={ROOT / 'assets' / 'toy'}",
        f"out_dir={folder / 'run'}",
        *TOY,
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prof.ProfiledTrainer, "step_scope", timed)
        assert prof.main(argv) == 0
    return (folder / "profile.md").read_text(), walls[2], folder


@pytest.mark.slow
def test_table_has_each_phase_of_the_step(profiled):
    text, _, _ = profiled
    rows = _table_rows(text)
    assert text.startswith("Profile of RL step 2 (of 2): CPU, torch")
    for phase in PHASES:
        assert phase in rows, phase
        assert int(rows[phase][0] or 0) >= (phase != prof.OUTSIDE)  # calls
    assert rows["update/forward_backward"][-1] == "n/a"  # host gap: CPU


@pytest.mark.slow
def test_figures_are_non_negative_and_add_up(profiled):
    text, _, _ = profiled
    rows = _table_rows(text)
    for name, cells in rows.items():
        if name.startswith("share"):
            continue
        figures = [float(cell) for cell in cells[1:-1]]  # wall .. self total (not calls, gap)
        assert min(figures) >= 0, name
        classes, total = figures[2:-1], figures[-1]
        assert len(classes) == len(prof.CLASSES)
        assert sum(classes) == pytest.approx(total, abs=0.05 * len(classes)), name
    attention = float(rows["**step**"][3]) + float(rows["**step**"][4])
    assert attention > 0  # the toy's VSA2 router and layout count as attention


@pytest.mark.slow
def test_phases_fit_in_the_step_wall(profiled):
    text, step_wall_s, folder = profiled
    rows = _table_rows(text)
    walls = [
        float(cells[1])
        for name, cells in rows.items()
        if name not in ("**step**",) and not name.startswith("share")
    ]
    assert sum(walls) <= step_wall_s * 1e3 + 0.05 * len(walls)
    assert float(rows["**step**"][1]) <= step_wall_s * 1e3 + 0.05
    assert json.loads((folder / "trace.json").read_text())["traceEvents"]


def test_refuses_num_steps_override():
    with pytest.raises(SystemExit, match=r"train\.num_steps: give the number of steps as --steps"):
        prof.run_profiled(None, ["train.num_steps=3"], 2)


def test_attention_bound_is_amdahls_law_on_the_step_wall():
    # 10 s step, attention 2 s forward + 4 s backward: free attention leaves 4 s, 2.5x at most
    totals = prof.Counter({"attention fwd": 2e6, "attention bwd": 4e6, "matrix products": 3e6})
    line = prof.attention_bound(totals, 10e6, "device")
    assert line == (
        "Attention: 6000.0 ms device time, 60.0% of the step's wall; were it free, the step "
        "would be at most 2.50x faster."
    )
    over = prof.attention_bound(prof.Counter({"attention fwd": 11e6}), 10e6, "CPU op self")
    assert over.endswith("not less than the step's wall: no bound.")
