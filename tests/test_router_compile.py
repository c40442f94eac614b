"""CPU check of the router's Triton kernels (no GPU needed): every variant the router launches at
the Wan shapes compiles for sm_90 with the installed Triton and ptxas, which the interpreter
tests cannot show (they never compile). The GPU tests in test_router.py check the results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PTXAS_RELATIVE = Path("backends") / "nvidia" / "bin" / "ptxas"
# pointer and scalar types of the kernels' arguments, by name
ARG_TYPES = dict.fromkeys(("SCORES", "MASK_BIAS", "TOP_LOGP", "LSE", "GRAD_SUM"), "*fp32")
ARG_TYPES |= {"TOP_IDX": "*i64", "COUNTS": "*i32", "OUT": "*bf16", "SCALE": "fp32"}
ARG_TYPES |= dict.fromkeys(("NSEG", "KMAX", "MIN_KV"), "i32") | {"TOP_P": "fp32"}


def _compile_sm90(kernel: str, constants: dict, out_dir: Path) -> str:
    """The ptxas -v report of ``topk.<kernel>`` compiled for sm_90a. Run in a child process:
    the test session imported Triton in interpreter mode, which cannot compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vsa2_rl.kernels import topk

    fn = getattr(topk, kernel)
    signature = {n: "constexpr" if n in constants else ARG_TYPES[n] for n in fn.arg_names}
    src = ASTSource(fn, signature, {(fn.arg_names.index(n),): v for n, v in constants.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    path = out_dir / "kernel.ptx"
    path.write_text(ptx.asm["ptx"])
    ptxas = Path(triton.__file__).parent / PTXAS_RELATIVE
    return subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", str(out_dir / "kernel.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stderr


def _has_ptxas() -> bool:
    import triton

    return (Path(triton.__file__).parent / PTXAS_RELATIVE).exists()


def _topk_variant(nseg: int, kmax: int, top_p: bool) -> dict:
    """The constants ``topk_log_softmax`` launches with for rows of ``nseg`` and ``kmax``."""
    from vsa2_rl.kernels.topk import SORTED_NUCLEUS_MAX

    nseg_pad, kmax_pad = 1 << (nseg - 1).bit_length(), 1 << (kmax - 1).bit_length()
    return dict(
        NSEG_PAD=nseg_pad, KMAX_PAD=kmax_pad, TOPP=top_p, HAS_MASK=True,
        SORT_NUCLEUS=kmax_pad <= SORTED_NUCLEUS_MAX,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not _has_ptxas(), reason="this Triton ships no ptxas")
@pytest.mark.parametrize(
    "nseg,kmax,nucleus",
    [
        (1176, 59, "sort"),  # Wan 720p kv_block 64 at 0.95
        (4704, 236, None),  # kv_block 16 at 0.95, top-k
        (4704, 236, "sort"),  # kv_block 16 at 0.95, top-p
        (4704, 588, "search"),  # kv_block 16 at 0.875
        (4704, 1176, "search"),  # kv_block 16 at 0.75, the recipes' eval sparsity
    ],
)
def test_router_topk_kernel_compiles_for_hopper(nseg, kmax, nucleus, tmp_path):
    constants = _topk_variant(nseg, kmax, top_p=nucleus is not None)
    if nucleus is not None:
        assert constants["SORT_NUCLEUS"] is (nucleus == "sort")
    _compile_in_child("_topk_log_softmax_kernel", constants, tmp_path)
    assert (tmp_path / "kernel.cubin").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(not _has_ptxas(), reason="this Triton ships no ptxas")
def test_router_backward_row_pass_compiles_for_hopper(tmp_path):
    report = _compile_in_child("_dense_score_grad_kernel", dict(BLOCK=1024), tmp_path)
    assert (tmp_path / "kernel.cubin").stat().st_size > 0
    assert "0 bytes spill stores" in report, report


def _compile_in_child(kernel: str, constants: dict, out_dir: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [sys.executable, __file__, kernel, json.dumps(constants), str(out_dir)],
        env=env,
        check=True,
    )
    return (out_dir / "report.txt").read_text()


if __name__ == "__main__":
    out = Path(sys.argv[3])
    (out / "report.txt").write_text(_compile_sm90(sys.argv[1], json.loads(sys.argv[2]), out))
