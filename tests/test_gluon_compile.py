"""CPU check of the Hopper Gluon kernels (no GPU needed): they compile for sm_90 with the
installed Triton, keep the FlashAttention-3 overlap (a wgmma wait that leaves one group in
flight) and fit the register file without spills (ptxas -v). The GPU tests in
test_block_sparse_gluon.py check their results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PTXAS_RELATIVE = Path("backends") / "nvidia" / "bin" / "ptxas"


def _compile_sm90(kernel: str, constants: dict, out_dir: Path) -> tuple[str, str]:
    """(PTX, ptxas -v report) of ``block_sparse_gluon.<kernel>`` for sm_90a. Run in a child
    process: the test session imported Triton in interpreter mode, which cannot compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from vsa2_rl.kernels import block_sparse_gluon as bsg

    D = constants["HEAD_DIM"]
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, 64, D], gl.bfloat16)
    desc = f"tensordesc<bf16[1, 1, 64, {D}],{layout!r}>"
    # K / V are copied one segment at a time into the rows of a 64-row stage
    kv_desc = f"tensordesc<bf16[1, 1, {constants['KV_BLOCK']}, {D}],{layout!r}>"
    fn = getattr(bsg, kernel)
    # pointers by name (bf16 tensors, int32 indices, float32 otherwise), then the scalars
    types = dict.fromkeys(("O", "DQ"), "*bf16")
    types |= dict.fromkeys(("KV_IDX", "KV_CNT", "KV_LEN"), "*i32")
    types |= dict.fromkeys(("H", "S", "NQ", "KMAX"), "i32")
    types |= dict(qk_scale="fp32", scale="fp32")
    signature = {
        name: "constexpr"
        if name in constants
        else kv_desc
        if name in ("k_desc", "v_desc")
        else desc
        if name.endswith("_desc")
        else types.get(name, "*fp32")
        for name in fn.arg_names
    }
    # what the launcher's specialisation proves at run time: 16-aligned pointers
    aligned = [(i,) for i, name in enumerate(fn.arg_names) if signature[name].startswith("*")]
    src = GluonASTSource(
        fn,
        signature,
        {(fn.arg_names.index(n),): v for n, v in constants.items()},
        {key: [["tt.divisibility", 16]] for key in aligned},
    )
    target = GPUTarget("cuda", 90, 32)
    ptx = triton.compile(src, target=target, options=dict(num_warps=4)).asm["ptx"]
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
    import importlib.util

    import triton

    has_gluon = importlib.util.find_spec("triton.experimental.gluon") is not None
    return has_gluon and (Path(triton.__file__).parent / PTXAS_RELATIVE).exists()


@pytest.mark.slow
@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no Gluon or ships no ptxas")
@pytest.mark.parametrize(
    "kernel,constants",
    [
        ("_bsa_fwd_gluon_kernel", dict(HEAD_DIM=128, KV_BLOCK=64, HAS_LEN=False)),
        ("_bsa_fwd_gluon_kernel", dict(HEAD_DIM=128, KV_BLOCK=64, HAS_LEN=True)),
        ("_bsa_fwd_gluon_kernel", dict(HEAD_DIM=64, KV_BLOCK=64, HAS_LEN=True)),
        ("_bsa_fwd_gluon_kernel", dict(HEAD_DIM=128, KV_BLOCK=32, HAS_LEN=True)),
        ("_bsa_fwd_gluon_kernel", dict(HEAD_DIM=128, KV_BLOCK=16, HAS_LEN=True)),
        ("_bsa_bwd_dq_gluon_kernel", dict(HEAD_DIM=128, KV_BLOCK=64, HAS_LEN=True, HAS_DLSE=True)),
        ("_bsa_bwd_dq_gluon_kernel", dict(HEAD_DIM=64, KV_BLOCK=64, HAS_LEN=True, HAS_DLSE=True)),
        ("_bsa_bwd_dq_gluon_kernel", dict(HEAD_DIM=128, KV_BLOCK=32, HAS_LEN=True, HAS_DLSE=True)),
        ("_bsa_bwd_dq_gluon_kernel", dict(HEAD_DIM=128, KV_BLOCK=16, HAS_LEN=True, HAS_DLSE=True)),
    ],
)
def test_gluon_kernel_compiles_for_hopper_with_overlap_in_register_budget(
    kernel, constants, tmp_path
):
    """The settings the wrappers launch (``bsa_forward_gluon``, ``bsa_backward_dq_gluon``)."""
    forward = kernel == "_bsa_fwd_gluon_kernel"
    stages = dict(K_STAGES=1, V_STAGES=2) if forward else dict(K_STAGES=3, V_STAGES=1)
    constants = dict(HAS_BIAS=True, BLOCK=64, **stages, **constants)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [sys.executable, __file__, kernel, json.dumps(constants), str(tmp_path)],
        env=env,
        check=True,
    )
    ptx, report = (tmp_path / "kernel.ptx").read_text(), (tmp_path / "report.txt").read_text()
    assert "wgmma.mma_async" in ptx
    # the softmax of one slot overlaps the previous slot's product: a wait leaves one in flight
    assert re.search(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)
    # every copy is a TMA copy: Q (and dO), and one per slot of a group of K / V
    assert "cp.async.bulk.tensor" in ptx and "cp.async.cg" not in ptx
    if forward:
        # copy sites: Q, then each slot of a group at each K / V stage fill and refill (K: one
        # stage, a refill before and one in the loop; V: two stages, one refill in the loop)
        assert ptx.count("cp.async.bulk.tensor") == 1 + 6 * (64 // constants["KV_BLOCK"])
    # the grouped dQ pass (kv_block 16 / 32) sits at the 255-register cap: ptxas spills a few
    # words there, how many depends on the Triton version (3.6: 0 at kv32 and 132 bytes at kv16
    # with lengths; 3.8: 16 and 0); it still ran 1.5-1.9x faster than the Triton pass on an H200
    budget = 160 if not forward and constants["KV_BLOCK"] < 64 else 0
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) <= budget, report


if __name__ == "__main__":
    out = Path(sys.argv[3])
    (out / "report.txt").write_text(_compile_sm90(sys.argv[1], json.loads(sys.argv[2]), out)[1])


@pytest.mark.parametrize(
    "version,new_enough",
    [("3.5.1", False), ("2.3.0", False), ("3.6.0", True), ("3.8.0+git1a2b3c4", True)],
)
def test_gluon_path_needs_triton_3_6_and_an_importable_module(monkeypatch, version, new_enough):
    """An older Triton (or a broken Gluon import) keeps the Triton kernels instead of failing
    at the first Hopper call."""
    import importlib.util

    import triton

    from vsa2_rl.kernels import block_sparse

    has_gluon = importlib.util.find_spec("triton.experimental.gluon") is not None
    monkeypatch.setattr(triton, "__version__", version)
    block_sparse._gluon_available.cache_clear()
    try:
        assert block_sparse._gluon_available() is (new_enough and has_gluon)
        # the module cannot be imported: the Triton kernels, whatever the version
        monkeypatch.setitem(sys.modules, "vsa2_rl.kernels.block_sparse_gluon", None)
        block_sparse._gluon_available.cache_clear()
        assert block_sparse._gluon_available() is False
    finally:
        block_sparse._gluon_available.cache_clear()
