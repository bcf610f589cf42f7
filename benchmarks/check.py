"""`mfotel check` wall time, against starting Python in the same run (medians of N).

    .venv/bin/python benchmarks/check.py [--repeats 5]

Each case runs `mfotel check` in a fresh process, as a user does; the baseline is the same
interpreter importing PyYAML and exiting. The bad documents (a billion-laughs alias bomb, a
3 MB value, a 4 MiB list, 210k aliases, 150k keys) must be refused about as fast as a good
document is accepted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mindformers" / "tiny_llama_cpu.yaml"


def documents(folder: Path) -> dict[str, Path]:
    laughs = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    laughs += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    texts = {
        "plain.yaml": "monitor_config:\n  step_interval: 50\n  metrics: [loss, learning_rate]\n",
        "laughs.yaml": "\n".join(laughs) + "\nmonitor_config: {job_name: *a9}\n",
        "long.yaml": "monitor_config:\n  job_name: \"" + "x" * 3_000_000 + "\"\n",
        # issue 24's documents, refused only after PyYAML had built them in the first version
        "zeros.yaml": "x: [" + ",".join(["0"] * (2 * 2**20 - 4)) + "]\n",
        "aliases.yaml": "a: &a [1]\nmonitor_config: {step_interval: 5}\nx: ["
                        + ",".join(["*a"] * 210_000) + "]\n",
        "keys.yaml": "monitor_config: {step_interval: 5}\nx: {"
                     + ",".join(f"{i}: 0" for i in range(150_000)) + "}\n",
    }
    for name, text in texts.items():
        (folder / name).write_text(text)
    return {name: folder / name for name in texts}


def wall(argv: list[str], repeats: int, cwd: Path) -> float:
    subprocess.run(argv, cwd=cwd, capture_output=True, timeout=600)  # warm the file cache
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(argv, cwd=cwd, capture_output=True, timeout=600)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env_python = sys.executable
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        docs = documents(folder)
        check = [env_python, "-m", "mfotel", "check"]
        cases = [
            ("python -c 'import yaml' (baseline)", [env_python, "-c", "import yaml"]),
            ("plain monitor_config", [*check, str(docs["plain.yaml"])]),
            ("billion laughs (refused)", [*check, str(docs["laughs.yaml"])]),
            ("3 MB job_name (refused)", [*check, str(docs["long.yaml"])]),
            ("4 MiB flat list of zeros (refused)", [*check, str(docs["zeros.yaml"])]),
            ("210k aliases (refused)", [*check, str(docs["aliases.yaml"])]),
            ("150k keys (refused)", [*check, str(docs["keys.yaml"])]),
            ("mindformers YAML, --no-mindformers", [*check, "--no-mindformers", str(EXAMPLE)]),
            ("mindformers YAML, monitor_on (imports mindformers)", [*check, str(EXAMPLE)]),
        ]
        base = None
        print(f"| case | wall s (median of {args.repeats}) | vs baseline |")
        print("|---|---|---|")
        for title, argv in cases:
            seconds = wall(argv, args.repeats, folder)
            base = base or seconds
            print(f"| {title} | {seconds:.3f} | {seconds / base:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
