"""FusedMoE's Triton grouped GEMM against its torch reference (a loop over experts), on CUDA.

One random layer (``--experts`` experts of ``--hidden`` x ``--inner``, ``--top-k`` per
token) in ``--dtype``; for each batch size in ``--tokens`` it times one forward of each
implementation (routing included, ``triton.testing.do_bench``: median of repeated runs
after warm-up) and prints milliseconds, the ratio and the largest difference between them.

    python benchmarks/moe_kernel.py
    python benchmarks/moe_kernel.py --tokens 1 16 256 2048 --dtype float32
"""

from __future__ import annotations

import argparse
import functools

import torch

from vlite.models.fused_moe import FusedMoE


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inner", type=int, default=2816)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    return parser.parse_args()


def random_layer(args: argparse.Namespace, dtype: torch.dtype) -> FusedMoE:
    moe = FusedMoE(args.experts, args.top_k, args.hidden, args.inner, renormalize=True)
    with torch.no_grad():
        torch.nn.init.normal_(moe.w13, std=args.hidden**-0.5)
        torch.nn.init.normal_(moe.w2, std=args.inner**-0.5)
    return moe.to(device="cuda", dtype=dtype)


def time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/moe_kernel.py needs a CUDA device: without one the Triton kernel runs "
            "under the Triton interpreter, which measures Python, not the kernel"
        )
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides exact in float32
    dtype = getattr(torch, args.dtype)
    moe = random_layer(args, dtype)
    print(
        f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, inner {args.inner}, "
        f"{args.dtype}, {torch.cuda.get_device_name()}"
    )
    print(f"{'tokens':>7} {'torch ms':>9} {'triton ms':>10} {'speedup':>8} {'max diff':>9}")
    for num_tokens in args.tokens:
        states = torch.randn(num_tokens, args.hidden, device="cuda", dtype=dtype)
        logits = torch.randn(num_tokens, args.experts, device="cuda")
        timings, outputs = {}, {}
        with torch.no_grad():
            for impl in ("torch", "triton"):
                moe.impl = impl
                outputs[impl] = moe(states, logits)
                timings[impl] = time_ms(functools.partial(moe, states, logits))
        difference = (outputs["torch"].float() - outputs["triton"].float()).abs().max().item()
        print(
            f"{num_tokens:>7} {timings['torch']:>9.3f} {timings['triton']:>10.3f} "
            f"{timings['torch'] / timings['triton']:>7.2f}x {difference:>9.2e}"
        )


if __name__ == "__main__":
    main()
