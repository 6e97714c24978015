"""The Triton kernels compile for an H100 (sm_90), without a GPU.

The interpreter runs a kernel's Python, not Triton's compiler, so type, layout and
loop-carried-value errors that only the compiler sees would pass every CPU test. Here
``triton.compile`` takes each kernel through TTIR, TTGIR, LLVM, PTX and ``ptxas`` (shipped
in the triton wheel) for ``GPUTarget("cuda", 90, 32)``, with the specialisations the JIT
makes at launch (pointers and strides divisible by 16), and ``cuobjdump`` reports register
use: the bfloat16 decode and prefill configurations must not spill.

It runs in a subprocess: this process may have the kernels defined for the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vlite.plugins.attention.triton_kernels import paged_attention, write_kv
    from vlite.plugins.attention.triton_kernels.config import choose_tiles, next_power_of_2

    TARGET = GPUTarget("cuda", 90, 32)
    CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")

    def compile_kernel(fn, types, constexprs, num_warps):
        names = fn.arg_names
        signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(names)
            if n not in constexprs and (types[n].startswith("*") or n.startswith("stride"))
        }
        source = ASTSource(
            fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
            attrs=attrs,
        )
        kernel = triton.compile(
            source, target=TARGET, options={"num_warps": num_warps, "num_stages": 2}
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        line = next(line for line in usage.splitlines() if "REG:" in line)
        fields = dict(item.split(":") for item in line.split() if ":" in item)
        return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}

    def attention(dtype, head_dim, group, max_query_len, num_splits):
        itemsize = 4 if dtype == "fp32" else 2
        tiles = choose_tiles(group, head_dim, max_query_len, itemsize, False)
        types = {n: "i32" for n in paged_attention._paged_attention_kernel.arg_names}
        types.update(out_ptr=f"*{dtype}", q_ptr=f"*{dtype}", k_cache_ptr=f"*{dtype}",
                     v_cache_ptr=f"*{dtype}", part_acc_ptr="*fp32", part_max_ptr="*fp32",
                     part_sum_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                     query_start_loc_ptr="*i32", qk_scale="fp32")
        constexprs = dict(
            BLOCK_SIZE=16, NUM_QUERIES_PER_KV=group, GROUP_P2=tiles.group_p2,
            BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n,
            HEAD_DIM=head_dim, HEAD_DIM_P2=next_power_of_2(head_dim), NUM_SPLITS=num_splits,
            ALL_DECODE=max_query_len == 1, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
            UPCAST_DOT=False,
        )
        return compile_kernel(
            paged_attention._paged_attention_kernel, types, constexprs, tiles.num_warps
        )

    def reduce(head_dim, num_splits):
        types = {n: "i32" for n in paged_attention._reduce_splits_kernel.arg_names}
        types.update(out_ptr="*bf16", part_acc_ptr="*fp32", part_max_ptr="*fp32",
                     part_sum_ptr="*fp32")
        constexprs = dict(NUM_SPLITS=num_splits, SPLITS_P2=next_power_of_2(num_splits),
                          HEADS_PER_PROGRAM=1, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim)
        return compile_kernel(paged_attention._reduce_splits_kernel, types, constexprs, 4)

    def write(num_kv_heads, head_dim):
        types = {n: "i32" for n in write_kv._write_kv_kernel.arg_names}
        types.update(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*bf16",
                     v_cache_ptr="*bf16", slot_mapping_ptr="*i64")
        columns = next_power_of_2(num_kv_heads) * head_dim
        constexprs = dict(BLOCK_SIZE=16, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                          HEAD_DIM_P2=head_dim, COLUMNS=columns, BLOCK_T=4096 // columns)
        return compile_kernel(write_kv._write_kv_kernel, types, constexprs, 4)

    print(json.dumps({
        "decode-bf16-hd128-gqa4": attention("bf16", 128, 4, 1, 1),
        "decode-split8-bf16-hd128-gqa4": attention("bf16", 128, 4, 1, 8),
        "prefill-bf16-hd128-gqa4": attention("bf16", 128, 4, 2048, 1),
        "prefill-bf16-hd64-gqa3": attention("bf16", 64, 3, 100, 1),
        "prefill-fp32-hd64-gqa1": attention("fp32", 64, 1, 100, 1),
        "reduce-hd128-split8": reduce(128, 8),
        "write-kv-8x128": write(8, 128),
    }))
    """
)


def _nvidia_toolchain_missing() -> bool:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return not ((bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists())


@pytest.fixture(scope="module")
def resources() -> dict[str, dict[str, int]]:
    if _nvidia_toolchain_missing():
        pytest.skip("this triton install has no NVIDIA backend toolchain (ptxas, cuobjdump)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(resources):
    assert len(resources) == 7
    for name, usage in resources.items():
        assert 0 < usage["regs"] <= 255, name


@pytest.mark.parametrize(
    "name",
    ["decode-bf16-hd128-gqa4", "decode-split8-bf16-hd128-gqa4", "prefill-bf16-hd128-gqa4"],
)
def test_bfloat16_attention_does_not_spill_registers(resources, name):
    assert resources[name]["stack"] == 0, resources[name]
