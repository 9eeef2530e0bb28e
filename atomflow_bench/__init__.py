"""atomflow-bench: single-stream (M=1) Llama decode on NVIDIA GPUs through CuPy RawKernels.

The decode path, one package per stage: config -> store (fetch, checkpoint) -> gpu (arena, upload, step, graph,
engine; tensor parallel in gpu/tp) -> measure (timing, the run record). docs/ARCHITECTURE.md maps the house and
defines its terms. `import atomflow_bench` and every CPU command work without CuPy or a GPU.
"""
__version__ = "0.1.0"
