"""Attention kernels on CUDA: vlite's Triton paged attention vs flash-attn (or PyTorch SDPA).

For each batch size x context length, times

* decode: one query token per sequence over a paged KV cache of ``context`` tokens each
  (shuffled block tables), vlite's ``paged_attention`` (split-K as its heuristic picks);
* mixed: the same decodes plus ``--num-prefills`` fresh prompts of ``--prefill-len``
  tokens in the same launch;

against a peer measured in the same run on contiguous (unpaged) keys and values:
flash-attn (``flash_attn_with_kvcache`` for decode, ``flash_attn_varlen_func`` for mixed)
when installed, else PyTorch's ``scaled_dot_product_attention``. It prints, per row, the
KV bytes read per second as a fraction of the device's peak memory bandwidth (target on an
H100: >= 70% for decode at context >= 2k and batch >= 16) and vlite's time relative to the
peer's (< 1: vlite is faster). Not a test: run it on a GPU machine and paste the table.

    python benchmarks/attention.py
    python benchmarks/attention.py --batch-sizes 1 16 --context-lens 2048 8192 --dtype float16
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: Peak memory bandwidth (GB/s) by device-name fragment, when the device does not report
#: its memory clock and bus width.
PEAK_GBS_BY_NAME = {
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument(
        "--context-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192]
    )
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--num-prefills", type=int, default=2, help="prompts in mixed batches")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--peak-gbs", type=float, help="peak memory bandwidth; default: probed")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def peak_bandwidth_gbs(device: torch.device) -> float | None:
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    for fragment, gbs in PEAK_GBS_BY_NAME.items():
        if fragment in props.name:
            return gbs
    return None


@dataclass
class Batch:
    """A paged batch: ``query_lens`` new tokens after ``seq_lens - query_lens`` cached."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the batch must read once."""
        _, _, num_kv_heads, head_dim = self.key_cache.shape
        per_token = 2 * num_kv_heads * head_dim * self.key_cache.element_size()
        return sum(self.seq_lens_cpu) * per_token


def make_batch(args, query_lens: list[int], seq_lens: list[int], gen: random.Random) -> Batch:
    device, dtype, bs = torch.device("cuda"), DTYPES[args.dtype], args.block_size
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    pool = list(range(num_blocks))
    gen.shuffle(pool)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor([pool.pop() for _ in range(count)])
    shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return Batch(
        query=torch.randn(sum(query_lens), args.num_heads, args.head_dim, device=device).to(dtype),
        key_cache=torch.randn(shape, device=device).to(dtype),
        value_cache=torch.randn(shape, device=device).to(dtype),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def vlite_fn(kernels, batch: Batch, scale: float):
    workspace = kernels.new_workspace()
    return lambda: kernels.paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        max_query_len=max(batch.query_lens_cpu),
        max_seq_len=max(batch.seq_lens_cpu),
        scale=scale,
        workspace=workspace,
    )


def peer_fn(batch: Batch, args, scale: float, use_flash_attn: bool):
    """The peer on contiguous K/V: ``[num_seqs]`` of ``[context, kv_heads, dim]`` each."""
    dtype = DTYPES[args.dtype]
    decode_rows = [i for i, n in enumerate(batch.query_lens_cpu) if n == 1]
    prefill_rows = [i for i, n in enumerate(batch.query_lens_cpu) if n > 1]
    context = batch.seq_lens_cpu[decode_rows[0]] if decode_rows else 0
    kv_shape = (len(decode_rows), context, args.num_kv_heads, args.head_dim)
    k = torch.randn(kv_shape, device="cuda").to(dtype)
    v = torch.randn(kv_shape, device="cuda").to(dtype)
    q_decode = torch.randn(len(decode_rows), 1, args.num_heads, args.head_dim, device="cuda")
    q_decode = q_decode.to(dtype)
    prefill_len = batch.query_lens_cpu[prefill_rows[0]] if prefill_rows else 0
    p_shape = (len(prefill_rows), prefill_len)
    q_prefill = torch.randn(*p_shape, args.num_heads, args.head_dim, device="cuda").to(dtype)
    kv_prefill = torch.randn(*p_shape, args.num_kv_heads, args.head_dim, device="cuda").to(dtype)

    if use_flash_attn:
        from flash_attn import flash_attn_func, flash_attn_with_kvcache

        lens = torch.full((len(decode_rows),), context, dtype=torch.int32, device="cuda")

        def run() -> None:
            if decode_rows:
                flash_attn_with_kvcache(
                    q_decode, k, v, cache_seqlens=lens, softmax_scale=scale, causal=True
                )
            if prefill_rows:
                flash_attn_func(q_prefill, kv_prefill, kv_prefill, softmax_scale=scale, causal=True)

        return run

    # PyTorch SDPA, [batch, heads, tokens, dim], grouped-query attention.
    k_t, v_t, q_t = k.transpose(1, 2), v.transpose(1, 2), q_decode.transpose(1, 2)
    qp_t, kvp_t = q_prefill.transpose(1, 2), kv_prefill.transpose(1, 2)

    def run() -> None:
        if decode_rows:
            F.scaled_dot_product_attention(q_t, k_t, v_t, scale=scale, enable_gqa=True)
        if prefill_rows:
            F.scaled_dot_product_attention(
                qp_t, kvp_t, kvp_t, is_causal=True, scale=scale, enable_gqa=True
            )

    return run


def time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/attention.py needs a CUDA device: without one vlite's Triton kernels "
            "run under the Triton interpreter, which measures Python, not the kernels"
        )
    args = parse_args()
    from vlite.plugins.attention.flash import flash_attn_import_error
    from vlite.plugins.attention.triton_kernels import load_kernels
    from vlite.plugins.attention.triton_kernels.config import choose_num_splits

    kernels = load_kernels()
    device = torch.device("cuda")
    peak = args.peak_gbs or peak_bandwidth_gbs(device)
    use_flash_attn = flash_attn_import_error() is None
    peer = "flash-attn" if use_flash_attn else "torch SDPA"
    scale = args.head_dim**-0.5
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(
        f"# {torch.cuda.get_device_name(device)}, {args.dtype}, {args.num_heads} query / "
        f"{args.num_kv_heads} KV heads, head dim {args.head_dim}, block size "
        f"{args.block_size}; peak {peak or '?'} GB/s; peer: {peer} (contiguous KV)\n"
    )
    print(
        "| kind | batch | context | splits | vlite us | KV GB/s | % of peak | "
        f"{peer} us | vlite / peer |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    gen = random.Random(args.seed)
    for batch_size in args.batch_sizes:
        for context in args.context_lens:
            for kind in ("decode", "mixed"):
                num_prefills = args.num_prefills if kind == "mixed" else 0
                query_lens = [1] * batch_size + [args.prefill_len] * num_prefills
                seq_lens = [context] * batch_size + [args.prefill_len] * num_prefills
                try:
                    batch = make_batch(args, query_lens, seq_lens, gen)
                except torch.OutOfMemoryError:
                    print(f"| {kind} | {batch_size} | {context} | out of memory |")
                    continue
                ours = time_ms(vlite_fn(kernels, batch, scale))
                theirs = time_ms(peer_fn(batch, args, scale, use_flash_attn))
                splits, gbs, share = "-", "-", "-"
                if kind == "decode":  # bandwidth-bound: report the KV read rate
                    splits = choose_num_splits(batch_size * args.num_kv_heads, context, num_sms)
                    rate = batch.kv_bytes / (ours * 1e-3) / 1e9
                    gbs = f"{rate:.0f}"
                    share = f"{100 * rate / peak:.0f}%" if peak else "?"
                print(
                    f"| {kind} | {batch_size} | {context} | {splits} | {ours * 1e3:.1f} | "
                    f"{gbs} | {share} | {theirs * 1e3:.1f} | {ours / theirs:.2f} |"
                )
                del batch
                torch.cuda.empty_cache()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
