"""The GPU-only paths of the kernels compiled for an H100/H200 (sm_90) on any machine, GPU or not: programmatic
dependent launch (every kernel of the decode step that takes part in it), the L2 prefetches and decode attention's
fused merge exist only in compiled kernels (Triton's interpreter skips them), so without this a mistake in them
would wait for the next GPU session to show. Triton
compiles to PTX and runs its bundled ptxas without a driver; the test reads the PTX for the instructions each path
must produce (a child process: this one's kernels were decorated for the interpreter)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Compiles each kernel with explicit argument types (pointers, int32 sizes and strides, constexprs) for sm_90 and
# prints {name: ptx} as JSON.
_COMPILE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import activation, decode_attention, gemv, kv_store, l2_prefetch, norm, rotary

def ptx(fn, pointers, floats, constexprs, warps, stages):
    sig = {n: pointers.get(n) or ("fp32" if n in floats else "constexpr" if n in constexprs else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm["ptx"]

attn = dict(Q="*bf16", K="*bf16", V="*bf16", ReqToToken="*i32", ReqPoolIdx="*i64", SeqLens="*i64", Out="*bf16",
            PartialO="*fp32", PartialLse="*fp32", Done="*i32")
stage1 = dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, NUM_SPLITS=64, PRECISION="tf32",
              UPCAST=False, PDL=True, PREFETCH_LINES=2, LINE_ELEMS=64, BLOCK_S=16, CG=True)
out = {
    "stage1_merge": ptx(decode_attention._decode_stage1, attn, {"scale_log2"}, {**stage1, "MERGE": True}, 4, 2),
    "stage1": ptx(decode_attention._decode_stage1, attn, {"scale_log2"}, {**stage1, "MERGE": False}, 4, 2),
    "gemv": ptx(gemv._gemv_kernel, dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16"), set(),
                dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, PREFETCH_LINES=16, LINE_ELEMS=64, PDL=True, UPCAST=False,
                     PRECISION="tf32", HAS_BIAS=False), 4, 4),
}
# kernels that begin with runtime.pdl_enter: the wait comes before any load
bf16 = "*bf16"
out["stage2"] = ptx(decode_attention._decode_stage2, dict(PartialO="*fp32", PartialLse="*fp32", Out=bf16,
                                                           SeqLens="*i64"), set(),
                    dict(HEAD_DIM=128, NUM_SPLITS=64, BLOCK_N=64, BLOCK_S=16, BLOCK_D=128, PDL=True), 4, 1)
out["silu_and_mul"] = ptx(activation._silu_and_mul_kernel, dict(x_ptr=bf16, out_ptr=bf16), set(),
                          dict(BLOCK=1024, PDL=True), 4, 1)
out["rmsnorm"] = ptx(norm._rmsnorm_kernel, dict(x_ptr=bf16, res_ptr=bf16, w_ptr=bf16, out_ptr=bf16,
                                                res_out_ptr=bf16), {"eps"},
                     dict(HAS_RESIDUAL=True, ROWS=1, BLOCK=4096, PDL=True), 8, 1)
out["store_kv"] = ptx(kv_store._store_kv_kernel, dict(k_ptr=bf16, v_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16,
                                                      loc_ptr="*i64"), set(),
                      dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, PDL=True), 4, 1)
out["rotary"] = ptx(rotary._rotary_kernel, dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, q_out_ptr=bf16, k_dst_ptr=bf16,
                                                v_dst_ptr=bf16, cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64",
                                                loc_ptr="*i64"), set(),
                    dict(HALF=64, BLOCK_H=8, BLOCK_HALF=64, STORE=True, PDL=True), 4, 1)
out["l2_prefetch"] = ptx(l2_prefetch._prefetch_kernel, dict(Base="*bf16"), set(),
                         dict(CHUNK=l2_prefetch.CHUNK_BYTES, PER_PROGRAM=l2_prefetch.PER_PROGRAM, PDL=True), 1, 1)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compiled here, not found in a cache
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _lines(ptx: str, pattern: str) -> list[int]:
    return [i for i, line in enumerate(ptx.splitlines()) if re.search(pattern, line)]


@pytest.mark.parametrize("kernel", ["stage1_merge", "stage1", "gemv"])
def test_pdl_and_prefetch_are_compiled_in(ptx, kernel):
    """Under PDL each kernel lets its dependents launch, prefetches into L2, and then waits, in that order."""
    code = ptx[kernel]
    launch, prefetch, wait = (_lines(code, p) for p in
                              (r"griddepcontrol\.launch_dependents", r"prefetch\.global\.L2", r"griddepcontrol\.wait"))
    assert launch and prefetch and wait, (len(launch), len(prefetch), len(wait))
    assert launch[0] < prefetch[0] < wait[0]


@pytest.mark.parametrize("kernel,early_loads", [("stage2", 1), ("silu_and_mul", 0), ("rmsnorm", 0), ("store_kv", 0),
                                                 ("rotary", 0)])
def test_pdl_enter_waits_before_reading_what_the_kernel_before_wrote(ptx, kernel, early_loads):
    """A kernel that calls runtime.pdl_enter lets its dependents launch, then waits for the kernel before, and reads
    global memory only after that (what it reads may be that kernel's output). Stage 2 alone reads one value before
    its wait: the request's length, an input of the step (one 64-bit load)."""
    code = ptx[kernel]
    launch, wait, loads = (_lines(code, p) for p in
                           (r"griddepcontrol\.launch_dependents", r"griddepcontrol\.wait", r"ld\.global"))
    assert launch and wait and loads, (len(launch), len(wait), len(loads))
    assert launch[0] < wait[0]
    assert len([i for i in loads if i < wait[0]]) == early_loads


def test_the_fused_merge_counts_once_per_program_after_a_barrier(ptx):
    """Stage 1's merge: the counter's add is one acquire-release atomic at GPU scope, done by a single thread
    (predicated), after a barrier that orders the program's partial stores before it; its result reaches every
    thread through shared memory behind another barrier; the merge reads the partials from L2 (ld.global.cg).
    Without the merge there is no atomic at all."""
    code = ptx["stage1_merge"].splitlines()
    atoms = [i for i, line in enumerate(code) if "atom." in line]
    assert len(atoms) == 1, [code[i] for i in atoms]
    line = code[atoms[0]].strip()
    assert re.match(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add\.u32 ", line), line
    before = [i for i, ln in enumerate(code[:atoms[0]]) if "bar.sync" in ln]
    after = [i for i, ln in enumerate(code[atoms[0]:], atoms[0]) if "bar.sync" in ln]
    assert before and atoms[0] - before[-1] < 10, "no barrier just before the atomic"
    assert after and after[0] - atoms[0] < 10, "no barrier before the atomic's result is read"
    assert _lines(ptx["stage1_merge"], r"ld\.global\.cg\.")
    assert not _lines(ptx["stage1"], r"atom\.")


def test_the_weight_prefetch_is_bulk_and_waits_last(ptx):
    """kernels.l2_prefetch: one bulk L2 prefetch per thread (the copy engine fetches, the threads go on), after the
    kernel lets its dependents launch and before it waits for the kernel before (so the kernel after it, which waits
    for it, still comes after that one); it reads nothing itself."""
    code = ptx["l2_prefetch"]
    launch, bulk, wait = (_lines(code, p) for p in (r"griddepcontrol\.launch_dependents",
                                                     r"cp\.async\.bulk\.prefetch\.L2\.global", r"griddepcontrol\.wait"))
    assert len(bulk) == 1 and launch and wait, (len(launch), len(bulk), len(wait))
    assert launch[0] < bulk[0] < wait[0]
    assert not _lines(code, r"ld\.global")
