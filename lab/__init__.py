"""The lab: instruments and probes for performance work, beside the product (atomflow_bench/), never inside it.

The lab may import the product; the product never imports the lab (tests/test_lab_local.py walks its imports).
Importable from the repository root (`python3 -m pytest`, or `python3 lab/scripts/<name>.py`, which put the root on
the path); the wheel ships none of it. lab/README.md is the index."""
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"  # the lab's .cu files, compiled by the product's KernelLib
KERNELS = {"probe_stream.cu": ("probe_stream",)}  # the lab's kernels by the .cu that defines them (a KernelLib's list)
