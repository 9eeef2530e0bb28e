"""Why a cooperative launch of the persistent step is refused (CUresult 720, too large): the kernel's attributes and
the occupancy the driver computes for it, at the plan's shared memory and around it."""
import ctypes

from atomflow_bench.gpu.device import smem_limits
from atomflow_bench.gpu.ops import kernel_lib, persist
from atomflow_bench.config import CATALOG

d = ctypes.CDLL("libcuda.so.1")
lib = kernel_lib()
ATTRS = {"max_threads": 0, "static_smem": 1, "local": 3, "regs": 4, "ptx": 5, "max_dyn_smem": 8, "carveout": 9}
for name, fmt in (("llama-3.2-1b", "fp16"), ("llama-3.2-3b", "fp8")):
    cfg = CATALOG[name].config
    fn = lib[persist.kernel_name(fmt, cfg.head_dim, cfg.group_size)]
    p = persist.plan(cfg, fmt, smem_limits())
    fn.max_dynamic_shared_size_bytes = p["shmem"]
    h = ctypes.c_void_p(fn.kernel.ptr)
    out = {}
    for k, a in ATTRS.items():
        v = ctypes.c_int()
        d.cuFuncGetAttribute(ctypes.byref(v), a, h)
        out[k] = v.value
    occ = {}
    for shm in (0, 48 * 1024, 100 * 1024, p["shmem"]):
        n = ctypes.c_int()
        rc = d.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), h, 288, ctypes.c_size_t(shm))
        occ[shm] = (rc, n.value)
    print(name, fmt, "plan", p, "attrs", out, "occupancy (rc, blocks/SM) by dyn smem", occ, "smem limits", smem_limits())
