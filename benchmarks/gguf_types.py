"""The GGUF type matrix: one stream and peak memory, vlite vs llama.cpp, file by file.

For each GGUF file (``--files``, or every ``*.gguf`` in ``--dir``), runs
``single_stream.py --engines vlite llama.cpp`` on it (fresh processes, alternated rounds,
best and median, the quiet check: see ``harness.py``) and collects one row per file: the
tensor types it holds, each engine's best and median output tokens/s, the ratio, the
weights a decode step reads times the best tokens/s (GB/s: against the machine's memory
bandwidth, how much faster one stream could go at all), and each engine's peak RSS (the
trial process's maximum resident set). With ``--prefill-len N`` (512;
0 leaves it out) a second run per file times the prefill of an N-token prompt the same way
(``--prompt-len N --output-len 1``: prompt tokens / wall time of the generation, its one
output token included, as llama.cpp's ``llama-bench -p`` counts a prompt's tokens). Prints
a markdown table and writes a PNG chart (``--plot``) and every number as JSON (``--json``).

``--make-from FILE --llama-cpp DIR`` first writes the files: FILE requantized by llama.cpp's
``llama-quantize`` (``DIR/build/bin/llama-quantize``, ``--allow-requantize``) to each of
``--types`` (llama.cpp's names: the mixes Q4_K_M, Q5_K_M, Q3_K_M, and single types Q6_K,
Q2_K, IQ4_XS, IQ4_NL, Q8_0, Q5_0, Q5_1, F16, ...), into ``--dir``; an existing file is kept.
Requantizing the default model's Q4_1 weights makes files of the shapes and types users
download (their values are Q4_1's, requantized: fine for speed and memory, not for quality).

llama.cpp runs through llama-cpp-python; point it at a llama.cpp build of your own with
``LLAMA_CPP_LIB_PATH=DIR/build/bin`` (see the README's benchmark section for the build).

    python benchmarks/gguf_types.py --make-from ~/.../SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llama-cpp vendor/llama.cpp --dir /tmp/gguf-types --threads 2 --rounds 3 \\
        --plot gguf_types.png --json gguf_types.json
    python benchmarks/gguf_types.py --files model-Q4_K_M.gguf other.gguf --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: run as a script, its folder is on sys.path

HERE = Path(__file__).resolve().parent
DEFAULT_TYPES = (
    "Q4_K_M",
    "Q5_K_M",
    "Q6_K",
    "Q3_K_M",
    "Q2_K",
    "IQ4_XS",
    "IQ4_NL",
    "Q8_0",
    "Q5_0",
    "Q5_1",
    "F16",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument("--files", type=Path, nargs="*", default=[], help="GGUF files to run")
    parser.add_argument("--dir", type=Path, help="folder of GGUF files (made or read)")
    parser.add_argument("--make-from", type=Path, help="requantize this GGUF into --dir first")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp tree with build/bin")
    parser.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES), help="types to make")
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per file")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--prefill-len", type=int, default=512, help="prompt tokens of the prefill run (0: none)"
    )
    parser.add_argument("--json", type=Path, help="write every row as JSON")
    parser.add_argument("--plot", type=Path, help="write a bar chart (needs matplotlib)")
    return parser.parse_args()


def make_files(source: Path, llama_cpp: Path, types: list[str], folder: Path) -> list[Path]:
    """``source`` requantized to each of ``types`` in ``folder`` (existing files kept)."""
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    if not quantize.exists():
        raise SystemExit(f"{quantize} not found: build llama.cpp first (README, Benchmarks)")
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for type_name in types:
        target = folder / f"{source.stem}-{type_name}.gguf"
        if not target.exists():
            print(f"making {target.name}", flush=True)
            command = [str(quantize), "--allow-requantize", str(source), str(target), type_name]
            subprocess.run(command, check=True, capture_output=True)
        made.append(target)
    return made


def tensor_types(path: Path) -> tuple[str, int]:
    """The file's quantized tensor types and counts, most common first; and the bytes of
    weights one decode step reads (every tensor but an embedding table that is not also
    the output matrix: its rows are gathered, not read whole)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    counts = Counter(t.tensor_type.name for t in tensors)
    names = {t.name for t in tensors}
    read = sum(
        int(t.n_bytes)
        for t in tensors
        if not (t.name == "token_embd.weight" and "output.weight" in names)
    )
    types = ", ".join(f"{name} x{n}" for name, n in counts.most_common() if name != "F32")
    return types, read


def run_file(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One stream (and a prefill run, unless ``--prefill-len 0``) on one file."""
    types, bytes_per_token = tensor_types(path)
    row = {"file": path.name, "types": types, "bytes_per_token": bytes_per_token}
    row["engines"] = single_stream(path, args, args.prompt_len, args.output_len)
    if args.prefill_len:
        prefill = single_stream(path, args, args.prefill_len, 1)
        row["prefill"] = {
            engine: {key: summary[key] * args.prefill_len for key in ("best", "median")}
            for engine, summary in prefill.items()
            if summary.get("best")
        }
    return row


def single_stream(
    path: Path, args: argparse.Namespace, prompt_len: int, output_len: int
) -> dict[str, dict[str, Any]]:
    """``single_stream.py`` on one file: each engine's summary (output tokens/s, RSS)."""
    with tempfile.TemporaryDirectory() as scratch:
        result_file = Path(scratch) / "result.json"
        command = [
            sys.executable,
            str(HERE / "single_stream.py"),
            "--engines",
            "vlite",
            "llama.cpp",
            "--model",
            str(path),
            "--threads",
            str(args.threads),
            "--rounds",
            str(args.rounds),
            "--prompt-len",
            str(prompt_len),
            "--output-len",
            str(output_len),
            "--json",
            str(result_file),
        ]
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True)
        result = json.loads(result_file.read_text())
    return {row["engine"]: row for row in result["summary"]}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| file | types | vlite best / median tok/s | llama.cpp best / median | vlite/llama.cpp "
        "(best, median) | weights GB/s vlite / llama.cpp (best) | prefill tok/s vlite / "
        "llama.cpp (best) | prefill ratio (best, median) | peak RSS MiB vlite / llama.cpp |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        v, p = row["engines"].get("vlite", {}), row["engines"].get("llama.cpp", {})
        pv, pp = (
            row.get("prefill", {}).get("vlite", {}),
            row.get("prefill", {}).get("llama.cpp", {}),
        )
        print(
            f"| {row['file']} | {row['types']} | {_rate(v, 'best')} / {_rate(v, 'median')} | "
            f"{_rate(p, 'best')} / {_rate(p, 'median')} | {_ratio(v, p)} | "
            f"{_streamed(row, v)} / {_streamed(row, p)} | "
            f"{_rate(pv, 'best', 0)} / {_rate(pp, 'best', 0)} | {_ratio(pv, pp)} | "
            f"{_rate(v, 'peak_rss_mib', 0)} / {_rate(p, 'peak_rss_mib', 0)} |"
        )


def _streamed(row: dict[str, Any], engine: dict[str, Any]) -> str:
    """The weights one decode step reads times the best tokens/s, in GB/s: how close an
    engine runs to the machine's memory bandwidth."""
    if not engine.get("best"):
        return "n/a"
    return f"{row['bytes_per_token'] * engine['best'] / 1e9:.1f}"


def _ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    if not (ours.get("best") and theirs.get("best")):
        return "n/a"
    return f"{ours['best'] / theirs['best']:.2f}x, {ours['median'] / theirs['median']:.2f}x"


def _rate(row: dict[str, Any], key: str, digits: int = 1) -> str:
    value = row.get(key)
    return "n/a" if value is None else f"{value:.{digits}f}"


def save_plot(path: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    plt = harness.import_pyplot()
    names = [row["file"].removesuffix(".gguf") for row in rows]
    panels = [
        ("best output tok/s", lambda row, engine: row["engines"].get(engine, {}).get("best")),
        ("peak RSS (MiB)", lambda row, engine: row["engines"].get(engine, {}).get("peak_rss_mib")),
    ]
    if any("prefill" in row for row in rows):
        panels.insert(
            1,
            (
                f"prefill of {args.prefill_len} tokens, best prompt tok/s",
                lambda row, engine: row.get("prefill", {}).get(engine, {}).get("best"),
            ),
        )
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, len(rows) * 0.9), 4 * len(panels)))
    width = 0.4
    for axis, (label, value) in zip(axes, panels):
        for offset, engine in ((-width / 2, "vlite"), (width / 2, "llama.cpp")):
            xs = [i + offset for i in range(len(rows))]
            axis.bar(xs, [value(row, engine) or 0 for row in rows], width, label=engine)
        axis.set_ylabel(label)
        axis.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        axis.legend()
    axes[0].set_title(
        f"one stream, {args.prompt_len}+{args.output_len} tokens, {args.threads} threads, "
        f"{harness.cpu_model()}"
    )
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    args = parse_args()
    files = list(args.files)
    if args.make_from:
        if not (args.llama_cpp and args.dir):
            raise SystemExit("--make-from needs --llama-cpp DIR and --dir DIR")
        files += make_files(args.make_from, args.llama_cpp, args.types, args.dir)
    elif args.dir:
        files += sorted(args.dir.glob("*.gguf"))
    if not files:
        raise SystemExit("no GGUF files: give --files, --dir, or --make-from")
    print(f"CPU: {harness.cpu_model()}, {harness.available_cores()} cores", flush=True)
    rows = []
    for path in files:
        rows.append(run_file(path, args))
        if args.json:  # after every file: an interrupted run keeps what it measured
            args.json.write_text(json.dumps(rows, indent=2))
    print_table(rows)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        save_plot(args.plot, rows, args)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
