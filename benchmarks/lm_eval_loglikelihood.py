"""lm-evaluation-harness against ``vlite serve``: loglikelihood scores equal transformers'.

lm-evaluation-harness' ``local-completions`` model scores a multiple-choice row by asking
``/v1/completions`` for ``echo: true, logprobs: 1, max_tokens: 1`` on each context plus
choice (token ids) and summing the prompt logprobs of the choice's tokens. This script runs
the same task (``benchmarks/lm_eval_task/vlite_mc.yaml``: 36 general-knowledge questions
shipped in the repository, or ``--task-file``) twice on the same float32 weights:

* ``vlite``: ``lm_eval --model local-completions`` against ``vlite serve`` (started here on
  ``--model``, a Hugging Face folder, or the default model's GGUF file exported as one);
* ``hf``: ``lm_eval --model hf`` (transformers) on the same folder;

and prints both scores and the largest difference of any choice's loglikelihood. The
harness is a client only: install it where you like (it pulls many packages; keep it out of
vlite's environment) and name its interpreter with ``--lm-eval-python``::

    python -m venv /tmp/lm-eval
    /tmp/lm-eval/bin/pip install torch==2.13.0 "lm_eval[api]" accelerate
    python benchmarks/lm_eval_loglikelihood.py --lm-eval-python /tmp/lm-eval/bin/python

No network is needed: the dataset is a local JSON-lines file and the tokenizer the
model folder's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import harness  # benchmarks/harness.py: run as a script, its folder is on sys.path
import serving  # benchmarks/serving.py: its server launcher

HERE = Path(__file__).resolve().parent
TASK_DIR = HERE / "lm_eval_task"
SERVED_NAME = "vlite"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument("--model", type=Path, help="a Hugging Face folder; default: vlite's own")
    parser.add_argument(
        "--lm-eval-python",
        default="python",
        help="the Python interpreter that has lm_eval installed",
    )
    parser.add_argument("--task-file", type=Path, default=TASK_DIR / "vlite_mc.jsonl")
    parser.add_argument("--threads", type=int, default=harness.available_cores())
    parser.add_argument("--limit", type=int, help="only the first N rows")
    return parser.parse_args()


def write_task(data_file: Path, folder: Path) -> None:
    """The task YAML with ``data_files`` pointing at ``data_file``."""
    text = (TASK_DIR / "vlite_mc.yaml").read_text().replace("DATA_FILE", str(data_file))
    (folder / "vlite_mc.yaml").write_text(text)


def run_lm_eval(args: argparse.Namespace, model_args: list[str], task_dir: Path, out: Path):
    """Run the harness; return ``(metrics, {doc id: [loglikelihood per choice]})``."""
    command = [args.lm_eval_python, "-m", "lm_eval", *model_args, "--tasks", "vlite_mc"]
    command += ["--include_path", str(task_dir), "--output_path", str(out), "--log_samples"]
    if args.limit:
        command += ["--limit", str(args.limit)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_*.jsonl")).open()]
    scores = {
        sample["doc_id"]: [float(response[0][0]) for response in sample["resps"]]
        for sample in samples
    }
    return results["results"]["vlite_mc"], scores


def main() -> None:
    args = parse_args()
    folder = args.model or harness.default_model_folder()
    port = serving.free_port()
    argv = [sys.executable, "-m", "vlite", "serve", "--model", str(folder), "--dtype", "float32"]
    argv += ["--port", str(port), "--served-model-name", SERVED_NAME, "--log-level", "warning"]
    argv += ["--cpu-threads", str(args.threads)]
    spec = serving.ServerSpec("vlite", argv, {}, " ".join(argv[2:]))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_task(args.task_file.resolve(), tmp_path)
        with serving.Server(spec, port, serving.server_env(args.threads)) as server:
            server.wait_until_healthy(600)
            vlite_args = [
                "--model",
                "local-completions",
                "--model_args",
                f"model={SERVED_NAME},base_url={server.url}/v1/completions,"
                f"tokenizer={folder},tokenizer_backend=huggingface,num_concurrent=1",
            ]
            vlite_metrics, vlite_scores = run_lm_eval(args, vlite_args, tmp_path, tmp_path / "v")
        hf_args = ["--model", "hf", "--model_args", f"pretrained={folder},dtype=float32"]
        hf_args += ["--device", "cpu", "--batch_size", "1"]
        hf_metrics, hf_scores = run_lm_eval(args, hf_args, tmp_path, tmp_path / "h")
    report(vlite_metrics, hf_metrics, vlite_scores, hf_scores)


def report(vlite_metrics, hf_metrics, vlite_scores, hf_scores) -> None:
    print("\n| metric | vlite serve (local-completions) | transformers (hf) |")
    print("| --- | --- | --- |")
    for name in ("acc,none", "acc_norm,none"):
        print(f"| {name.split(',')[0]} | {vlite_metrics[name]:.4f} | {hf_metrics[name]:.4f} |")
    differences = [
        abs(a - b)
        for doc_id, choices in hf_scores.items()
        for a, b in zip(vlite_scores[doc_id], choices)
    ]
    print(
        f"\n{len(differences)} choice loglikelihoods; largest difference "
        f"{max(differences):.2e}, mean {sum(differences) / len(differences):.2e}"
    )


if __name__ == "__main__":
    main()
