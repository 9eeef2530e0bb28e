"""The store holds float weights in fp16: a fetched file's bf16 tensors are rewritten as fp16, refused when a value
is beyond fp16's range; integer-typed weights are refused (`check_dtypes`).

`to_fp16` writes a new file beside the old one and renames it over it, so a file hard-linked from the HF cache is
replaced in the store, never changed in the cache.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import FetchError, VerifyError

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3")
FP16_MAX = 65504.0
CHUNK = 1 << 22  # bf16 values converted at a time (8 MB in, 8 MB out)


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset of the data) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > os.fstat(f.fileno()).st_size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for info in header.values():
            if not (isinstance(info["shape"], list) and isinstance(info["dtype"], str)
                    and len(info["data_offsets"]) == 2):
                raise ValueError("malformed tensor entry")
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        raise VerifyError(f"{path.name}: not a readable safetensors header ({type(e).__name__})") from None
    return header, 8 + n


def check_dtypes(path: Path, header: dict, names) -> None:
    """VerifyError when a tensor in `names` (the config's weights) is not floating point."""
    for name, info in header.items():
        if name in names and info["dtype"] not in FLOAT_DTYPES:
            raise VerifyError(f"{path.name}: tensor {name!r} is {info['dtype']}, not floating point "
                              "(weights must be float)")


def _bf16_to_fp16(raw: np.ndarray, name: str, path: Path, start: int, shape) -> np.ndarray:
    """fp16 of bf16 bits `raw` (uint16); FetchError at the first finite value fp16 cannot hold."""
    f32 = (raw.astype(np.uint32) << 16).view(np.float32)
    over = np.isfinite(f32) & (np.abs(f32) > FP16_MAX)
    if over.any():
        i = int(np.flatnonzero(over)[0])
        where = [int(j) for j in np.unravel_index(start + i, shape)] if shape else []
        raise FetchError(f"{path.name}: tensor {name!r} is bf16 with {float(f32[i]):g} at {where}, beyond fp16's "
                         f"range (±{FP16_MAX:g}); the store holds fp16")
    return f32.astype(np.float16)


def to_fp16(directory: Path) -> list[str]:
    """Rewrite every *.safetensors file of `directory` holding bf16 tensors with them as fp16; returns the files
    rewritten."""
    done = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            header, data_start = safetensors_header(path)
        except VerifyError:  # not a safetensors file: the checks after this one say so, with its cause
            continue
        if not any(info["dtype"] == "BF16" for info in header.values()):
            continue
        with open(path, "rb") as f:
            f.seek(8)
            meta = json.loads(f.read(data_start - 8)).get("__metadata__")
        order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        new, offset = ({"__metadata__": meta} if meta is not None else {}), 0
        for name in order:
            info = dict(header[name])
            begin, end = info["data_offsets"]
            size = end - begin
            if info["dtype"] == "BF16":
                info["dtype"] = "F16"
            info["data_offsets"] = [offset, offset + size]
            new[name], offset = info, offset + size
        raw = json.dumps(new, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        tmp = path.with_name(f".{path.name}.fp16")
        try:
            with open(path, "rb") as src, open(tmp, "wb") as out:
                out.write(struct.pack("<Q", len(raw)) + raw)
                for name in order:
                    info = header[name]
                    begin, end = info["data_offsets"]
                    src.seek(data_start + begin)
                    if info["dtype"] != "BF16":
                        out.write(src.read(end - begin))
                        continue
                    n = (end - begin) // 2
                    for o in range(0, n, CHUNK):
                        bits = np.frombuffer(src.read(2 * min(CHUNK, n - o)), dtype=np.uint16)
                        out.write(_bf16_to_fp16(bits, name, path, o, tuple(info["shape"])).tobytes())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        done.append(path.name)
    return done
