"""CPU check of the fused backward kernel (``block_sparse_fused``, no GPU needed): it compiles for
sm_90 with the installed Triton at the 8-warp, 64-key config its autotuner leads with, keeps its
float32 accumulators in registers without spills (ptxas -v), and adds dK/dV with relaxed atomics
(no acquire/release fences per add). The interpreter tests check its results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PTXAS_RELATIVE = Path("backends") / "nvidia" / "bin" / "ptxas"


def _compile_sm90(constants: dict, num_warps: int, out_dir: Path) -> tuple[str, str]:
    """(PTX, ptxas -v report) of ``_bsa_bwd_fused_kernel`` for sm_90a with bf16 inputs. Run in a
    child process: the test session imported Triton in interpreter mode, which cannot compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vsa2_rl.kernels import block_sparse_fused

    fn = block_sparse_fused._bsa_bwd_fused_kernel.fn
    bf16 = ("Q", "K", "V", "O", "DO", "DESC_K", "DESC_V")  # TMA off: descriptors are pointers
    types = dict.fromkeys(bf16, "*bf16") | dict.fromkeys(("KV_IDX", "BOUNDS", "KV_LEN"), "*i32")
    types |= dict(DQ="*fp32" if constants["DQ_ATOMIC"] else "*bf16", qk_scale="fp32", scale="fp32")
    ints = ("H", "S", "NQ", "KMAX")

    def kind(name):
        if name in constants:
            return "constexpr"
        if name.startswith("s_") or name in ints:
            return "i32"
        return types.get(name, "*fp32")

    signature = {name: kind(name) for name in fn.arg_names}
    # what the launcher's specialisation proves at run time: 16-aligned pointers and strides
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or name.startswith("s_") or name == "S"
    }
    constexprs = {(fn.arg_names.index(n),): v for n, v in constants.items()}
    src = ASTSource(fn, signature, constexprs, aligned)
    options = dict(num_warps=num_warps, num_stages=2)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    path = out_dir / "kernel.ptx"
    path.write_text(ptx)
    ptxas = Path(triton.__file__).parent / PTXAS_RELATIVE
    report = subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", str(out_dir / "kernel.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    return ptx, report


def _has_ptxas() -> bool:
    import triton

    return (Path(triton.__file__).parent / PTXAS_RELATIVE).exists()


@pytest.mark.slow
@pytest.mark.skipif(not _has_ptxas(), reason="this Triton ships no ptxas")
@pytest.mark.parametrize("kv_block,dq_atomic", [(16, True), (16, False), (64, False)])
def test_fused_backward_compiles_for_hopper_without_spills(kv_block, dq_atomic, tmp_path):
    constants = dict(
        Q_TILE=64, KV_BLOCK=kv_block, HEAD_DIM=128, HAS_BIAS=True, HAS_LEN=True,
        HAS_DLSE=True, DQ_ATOMIC=dq_atomic, DOT_PREC="tf32", TMA=False, BLOCK_N=64,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [sys.executable, __file__, json.dumps(constants), "8", str(tmp_path)], env=env, check=True
    )
    ptx, report = (tmp_path / "kernel.ptx").read_text(), (tmp_path / "report.txt").read_text()
    assert "wgmma.mma_async" in ptx
    adds = re.findall(r"\b(?:atom|red)\.global\.[\w.]*add[\w.]*f32", ptx)
    assert adds and all(".relaxed." in a for a in adds), adds
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


if __name__ == "__main__":
    out = Path(sys.argv[3])
    _, ptxas_report = _compile_sm90(json.loads(sys.argv[1]), int(sys.argv[2]), out)
    (out / "report.txt").write_text(ptxas_report)
