"""atomflow-bench: single-stream (M=1) Llama decode on NVIDIA GPUs through CuPy RawKernels.

The decode path, one module per stage:
config -> weights -> arena -> kernels -> step -> graph -> bench -> report.
`import atomflow_bench` and every CPU command work without CuPy or a GPU.
"""
__version__ = "0.1.0"
