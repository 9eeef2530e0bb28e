"""`atomflow-bench compare-peers` through the real CLI (CPU): run records with peers, baseline files, the shipped
baselines; one table, speedups only on the same GPU, other GPUs roofline-normalised and labelled."""
from __future__ import annotations

import json

import pytest
from helpers_runs import H100, make_run, with_prefill

from atomflow_bench.config import CATALOG
from helpers_cli import invoke
from test_output import md_tables
from test_output_numbers import numbers_as_text

RTX = "NVIDIA GeForce RTX 5060 Ti"
CFG = CATALOG["llama-3.1-8b"].config
SPEED, NORM = "speedup vs ours (same GPU)", "roofline-normalised vs ours (other GPU)"


def peer(mode: str, tpot: float, gpu: str = H100, context: int = 128, tokens: int = 64) -> dict:
    """A `peers[]` entry shaped as measure/peers.py writes it."""
    nbytes = {"weights": CFG.weight_bytes("fp16"),
              "kv": int(round((context + (tokens - 1) / 2 + 1) * CFG.kv_bytes_per_token()))}
    nbytes["total"] = nbytes["weights"] + nbytes["kv"]
    return {"engine": f"HF transformers 5.0.0 {mode} fp16", "mode": mode,
            "framework": {"torch": "2.11.0", "transformers": "5.0.0"},
            "sdpa_backends": ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"], "gpu": gpu, "device": "cuda",
            "precision": "fp16", "context": context, "tokens": tokens, "repeats": 3,
            "tpot_ms": {"median": tpot, "p10": tpot * 0.99, "p90": tpot * 1.01, "repeat_medians": [tpot] * 3},
            "tok_per_s": 1e3 / tpot, "bytes_per_token": nbytes, "bandwidth_gbs": nbytes["total"] / (tpot * 1e-3) / 1e9,
            "same_tokens_as_first_mode": True, "token_ids": [1, 2, 3]}


def llama_cpp(fmt: str, tpot: float, gguf_bytes: int, gpu: str = H100, context: int | None = 128) -> dict:
    return {"schema": "atomflow-bench/baseline/1",
            "engine": {"name": "llama.cpp server", "version": "b9999", "flags": f"-ngl 99, {fmt} GGUF"},
            "gpu": {"name": gpu, "memory_bandwidth_gbs": None}, "model": "meta-llama/Llama-3.1-8B-Instruct",
            "precision": fmt, "weight_bytes": gguf_bytes, "context": context, "tokens": 128,
            "metrics": {"tpot_ms": tpot, "tok_per_s": 1e3 / tpot}, "source": "measured with atomflow-bench baseline "
            "record on 2026-01-01", "method": "streamed /v1/completions"}


def write(tmp_path, name: str, rec: dict) -> str:
    (tmp_path / name).write_text(json.dumps(rec))
    return str(tmp_path / name)


@pytest.fixture
def files(tmp_path):
    ours = make_run(5.0, model="llama-3.1-8b", weights="fp16")  # H100 SXM
    ours["peers"] = [peer("eager", 25.0), peer("compiled", 8.0), peer("static", 900.0, gpu="cpu")]
    return {"ours": write(tmp_path, "ours.json", ours), "ours_rec": ours,
            "rtx": write(tmp_path, "rtx.json", make_run(30.0, model="llama-3.1-8b", gpu=RTX, copy_gbs=420.0,
                                                        context=512)),
            "other_model": write(tmp_path, "3b.json", make_run(2.0, model="llama-3.2-3b")),
            "f16": write(tmp_path, "lcpp-f16.json", llama_cpp("F16", 6.5, 16_068_890_912)),
            "q8": write(tmp_path, "lcpp-q8.json", llama_cpp("Q8_0", 4.1, 8_540_775_712, context=1024))}


def shown(capsys, *args) -> list[dict]:
    """The rows of `compare-peers ARGS` as people see them (the markdown table's text; an empty cell None)."""
    code, out, _ = invoke(capsys, "compare-peers", *args, "--format", "md")
    assert code == 0
    [rows] = md_tables(out).values()
    return [{k: (v if v != "" else None) for k, v in r.items()} for r in rows]


def rows_by_engine_format(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["engine"].split(" (")[0], r["format"]): r for r in rows}


def test_one_table_of_ours_peers_runs_and_baselines(files, capsys):
    args = (files["ours"], files["rtx"], files["f16"], files["q8"], files["other_model"])
    code, out, err = invoke(capsys, "compare-peers", *args, "--format", "json")
    assert code == 0
    data = json.loads(out)  # the data: numbers and nulls, never text with units
    assert data[0][SPEED] is None and data[0]["% of copy roofline"] == files["ours_rec"]["roofline"]["pct"]
    assert all(isinstance(r["TPOT ms"], float) and isinstance(r["tok/s"], float) for r in data)
    assert all(r[k] is None or isinstance(r[k], (int, float)) for r in data
               for k in ("ctx", "bytes/token GB", "% of copy roofline", SPEED, NORM))
    rows = shown(capsys, *args)
    by = rows_by_engine_format(rows)
    ours_tpot = files["ours_rec"]["tpot_ms"]["median"]
    assert rows[0]["engine"] == "atomflow-bench 0.1.0" and rows[0]["source"] == files["ours"]
    assert rows[0][SPEED] == "— (ours)" and rows[0]["% of copy roofline"] == f"{files['ours_rec']['roofline']['pct']:.1f}%"
    assert [r["engine"] for r in rows[1:4]] == ["HF transformers 5.0.0 eager fp16",
                                                "HF transformers 5.0.0 compiled fp16", "HF transformers 5.0.0 static fp16"]
    assert set(by) == {("atomflow-bench 0.1.0", "fp16"), ("HF transformers 5.0.0 eager fp16", "fp16"),
                       ("HF transformers 5.0.0 compiled fp16", "fp16"), ("HF transformers 5.0.0 static fp16", "fp16"),
                       ("atomflow-bench 0.1.0", "fp8"),
                       ("llama.cpp server b9999", "F16"), ("llama.cpp server b9999", "Q8_0"),
                       ("vLLM v0.19.1", "bf16 (weights not stated; bf16 KV cache)")}

    # same GPU (H100 80GB HBM3 on both sides): speedup = their TPOT / ours; with no 8-bit run of ours given, the
    # Q8_0 row is compared with our fp16 run, and says so
    for key, tpot, vs in ((("HF transformers 5.0.0 eager fp16", "fp16"), 25.0, ""),
                          (("HF transformers 5.0.0 compiled fp16", "fp16"), 8.0, ""),
                          (("llama.cpp server b9999", "F16"), 6.5, ""),
                          (("llama.cpp server b9999", "Q8_0"), 4.1, " vs ours fp16")):
        assert by[key][SPEED] == f"x{tpot / ours_tpot:.2f}{vs}" and by[key][NORM] == "— (same GPU)"
        assert by[key]["TPOT ms"] == f"{tpot:.3f}" and by[key]["tok/s"] == f"{1e3 / tpot:.1f}"
    # each engine's own bytes: the peers' fp16 weights + KV; the GGUF's size + KV at its context
    eager = by[("HF transformers 5.0.0 eager fp16", "fp16")]
    assert eager["bytes/token GB"] == f"{peer('eager', 25.0)['bytes_per_token']['total'] / 1e9:.3f}"
    copy = files["ours_rec"]["copy_bandwidth_gbs"]["median"]
    assert eager["% of copy roofline"] == \
        f"{100 * peer('eager', 25.0)['bytes_per_token']['total'] / (copy * 1e9) * 1e3 / 25.0:.1f}%"
    q8 = by[("llama.cpp server b9999", "Q8_0")]
    assert q8["bytes/token GB"] == f"{(8_540_775_712 + round((1024 + 64.5) * CFG.kv_bytes_per_token())) / 1e9:.3f}"
    # a baseline on our GPU model: its bytes against the copy bandwidth our run measured on that GPU, labelled
    q8_bytes = 8_540_775_712 + round((1024 + 64.5) * CFG.kv_bytes_per_token())
    assert q8["% of copy roofline"] == f"{100 * q8_bytes / (copy * 1e9) * 1e3 / 4.1:.1f}%"
    assert "our run's copy bandwidth (same GPU model)" in q8["note"]
    assert q8["ctx"] == "1024" and "ctx 1024, ours 128" in q8["note"]  # another context: kept, with its context

    # a peer on another device (a CPU smoke test): no copy roofline of the run's GPU, no speedup, nothing to normalise
    cpu = by[("HF transformers 5.0.0 static fp16", "fp16")]
    assert cpu["% of copy roofline"] is None and cpu[SPEED] == "— (other GPU)"
    assert cpu[NORM] == "n/a (bytes or spec bandwidth unknown)" and "spec bandwidth unknown" in cpu["note"]

    # another GPU: no speedup; roofline-normalised and labelled
    rtx = by[("atomflow-bench 0.1.0", "fp8")]
    assert rtx[SPEED] == "— (other GPU)" and rtx["GPU"] == RTX and rtx["ctx"] == "512"
    assert "other GPU: roofline-normalised (spec 448 GB/s)" in rtx["note"]
    theirs = make_run(30.0, model="llama-3.1-8b", gpu=RTX, copy_gbs=420.0, context=512)
    ratio = (files["ours_rec"]["bandwidth_gbs"] / 3350) / (theirs["bandwidth_gbs"] / 448)
    assert rtx[NORM] == f"x{ratio:.2f} vs ours fp16"  # an fp8 run, and no fp8 run of ours on the H100

    # the shipped vLLM fit: evaluated at our context, an absolute ratio labelled, bytes unknown
    vllm = by[("vLLM v0.19.1", "bf16 (weights not stated; bf16 KV cache)")]
    assert vllm["TPOT ms"] == "6.446" and vllm["tok/s"] == f"{1e3 / 6.445594:.1f}" and vllm["ctx"] == "128"
    assert "fitted line, evaluated at ctx 128" in vllm["note"] and "variant not stated" in vllm["note"]
    assert vllm[SPEED] == f"x{6.445594 / ours_tpot:.2f} (absolute; GPU variant not stated)"
    assert vllm["bytes/token GB"] is None and vllm["GPU"] == "NVIDIA H100 (variant not stated)"

    # other models are left out, each with a note (stderr with --format json)
    assert not any("3b" in r["source"] or "rtx5060ti" in r["source"] for r in rows)
    assert f"left out: {files['other_model']} (run): model llama-3.2-3b, ours llama-3.1-8b" in err
    assert "vllm-rtx5060ti-llama-3.2-3b.json (vLLM): model llama-3.2-3b" in " ".join(err.split())


def test_each_row_is_compared_with_ours_of_its_weight_width(files, tmp_path, capsys):
    """Our fp16 and fp8 runs (same model, GPU, context) are both "ours": the Q8_0 and W8A16 rows are compared with our
    fp8 run, the F16/bf16 rows and the HF peers with our fp16 run, and every speedup cell names which."""
    fp8 = make_run(3.0, model="llama-3.1-8b", weights="fp8")
    fp8["peers"] = [peer("eager", 24.0)]
    ours8 = write(tmp_path, "ours8.json", fp8)
    old16 = write(tmp_path, "old16.json", make_run(5.5, model="llama-3.1-8b", weights="fp16", seed=1))
    rtx8 = write(tmp_path, "rtx8.json", make_run(30.0, model="llama-3.1-8b", gpu=RTX, copy_gbs=420.0))
    at2048 = write(tmp_path, "fp8-2048.json", make_run(3.3, model="llama-3.1-8b", weights="fp8", context=2048))
    rows = shown(capsys, files["ours"], ours8, old16, rtx8, at2048, files["f16"], files["q8"])
    t16, t8 = files["ours_rec"]["tpot_ms"]["median"], fp8["tpot_ms"]["median"]
    assert [(r["source"], r[SPEED]) for r in rows if r[SPEED] == "— (ours)"] == \
        [(files["ours"], "— (ours)"), (ours8, "— (ours)")]  # the reference first, then ours of the other width
    src = {(r["source"].rsplit(" [", 1)[-1].rstrip("]") if r["source"].endswith(".json]") else r["source"]): r
           for r in rows}
    assert src["lcpp-q8.json"][SPEED] == f"x{4.1 / t8:.2f} vs ours fp8"
    assert src["lcpp-f16.json"][SPEED] == f"x{6.5 / t16:.2f} vs ours fp16"
    assert src[f"{ours8} peers[0]"][SPEED] == f"x{24.0 / t16:.2f} vs ours fp16"  # an fp16 peer of the fp8 run
    assert src[f"{files['ours']} peers[0]"][SPEED] == f"x{25.0 / t16:.2f} vs ours fp16"
    old = make_run(5.5, model="llama-3.1-8b", weights="fp16", seed=1)["tpot_ms"]["median"]
    assert src[old16][SPEED] == f"x{old / t16:.2f} vs ours fp16"  # a second fp16 run is a row, not a reference
    assert src[at2048][SPEED] == f"x{make_run(3.3, model='llama-3.1-8b')['tpot_ms']['median'] / t8:.2f} vs ours fp8"
    theirs = make_run(30.0, model="llama-3.1-8b", gpu=RTX, copy_gbs=420.0)
    assert src[rtx8][NORM] == f"x{(fp8['bandwidth_gbs'] / 3350) / (theirs['bandwidth_gbs'] / 448):.2f} vs ours fp8"
    vllm = src["vllm-h100-llama-3.1-8b-fp8-kvcache-post.json"]
    assert vllm[SPEED] == f"x{6.445594 / t16:.2f} vs ours fp16 (absolute; GPU variant not stated)"


@pytest.mark.parametrize("fmt, width", [("fp16", 16), ("F16 (GGUF F16 weights; ...)", 16), ("bf16 (weights not "
                                        "stated; bf16 KV cache)", 16), ("fp8", 8), ("Q8_0", 8), ("W8A16 (FP8-E4M3)", 8),
                                        ("unspecified (likely bf16)", None), ("Q4_K_M", None), ("", None)])
def test_weight_width_reads_the_formats_leading_word(fmt, width):
    from atomflow_bench.measure.peer_table import weight_width

    assert weight_width(fmt) == width


def test_ours_chooses_the_reference(files, tmp_path, capsys):
    empty = tmp_path / "none"
    empty.mkdir()
    rows = shown(capsys, files["ours"], files["rtx"], "--ours", files["rtx"], "--baselines", empty)
    assert rows[0]["source"] == files["rtx"] and rows[0]["GPU"] == RTX and rows[0][SPEED] == "— (ours)"
    assert len(rows) == 5 and not any(r["engine"].startswith("vLLM") for r in rows)  # --baselines: none recorded
    assert all(r[SPEED] == "— (other GPU)" for r in rows[1:])  # the H100 rows, seen from the RTX


def test_rows_carry_a_speedup_only_on_the_same_gpu(files, tmp_path):
    from atomflow_bench.measure.peer_table import compare_peers

    rows, notes = compare_peers([files["ours"], files["rtx"], files["f16"]], baselines_dir=None)
    kinds = {(r["kind"], r["gpu"], r["format"]): r for r in rows}
    assert kinds[("run", RTX, "fp8")]["speedup"] is None and kinds[("run", RTX, "fp8")]["normalised_ratio"] > 0
    assert kinds[("peer", "cpu", "fp16")]["speedup"] is None
    assert kinds[("baseline", H100, "F16")]["speedup"] == pytest.approx(6.5 / files["ours_rec"]["tpot_ms"]["median"])
    vllm = next(r for r in rows if r["gpu_match"] == "variant not stated")
    assert vllm["tpot_ms"] == pytest.approx(6.445594, abs=1e-6) and vllm["gpu_bandwidth_gbs"] is None
    assert len(notes) == 2  # the shipped Llama-3.2-3B baselines


@pytest.mark.parametrize("content, message", [
    ({"schema": "atomflow-bench/profile/1"}, "not a atomflow-bench/run/1 run record nor a atomflow-bench/baseline/1 "
                                             "baseline (schema='atomflow-bench/profile/1')"),
    ([1, 2], "schema=None"),
    ("{oops", "not valid JSON"),
    ({"schema": "atomflow-bench/baseline/1", "engine": "vLLM"}, "field 'engine' must be object"),
    ({"schema": "atomflow-bench/run/1", "gpu": {"name": "x"}}, "model is missing"),
])
def test_a_file_that_is_not_a_record_is_refused_in_one_line(files, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    code, out, err = invoke(capsys, "compare-peers", files["ours"], bad, "--format", "json")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and str(bad) in " ".join(err.split()) and message in " ".join(err.split())
    assert len(err.strip().splitlines()) == 1


def test_missing_file_no_run_record_and_a_baseline_as_ours(files, tmp_path, capsys):
    code, _, err = invoke(capsys, "compare-peers", tmp_path / "absent.json")
    assert code == 1 and "absent.json: not found" in err
    code, _, err = invoke(capsys, "compare-peers", files["f16"])
    assert code == 1 and "no atomflow-bench/run/1 run record among RESULTS" in err
    code, _, err = invoke(capsys, "compare-peers", files["ours"], "--ours", files["f16"])
    assert code == 1 and "--ours" in err and "not a atomflow-bench/run/1 run record" in err


def test_llama_cpp_rows_carry_their_own_bytes_per_token(capsys):
    """The issue-32 records (results/engines-h100): every llama.cpp row has its own bytes/token, the record's
    weight_bytes + K/V rows; the untied 8B's leave out the 1.05 GB (F16) / 0.56 GB (Q8_0) input-embedding table that
    llama.cpp reads one row of per token, so F16 no longer reads as 16.086 GB against our 15.043."""
    from pathlib import Path

    v39 = Path(__file__).resolve().parents[1] / "results" / "engines-h100"
    files = [v39 / "sweep" / "llama-3.1-8b-fp16-ctx128-tp1.json", v39 / "sweep" / "llama-3.1-8b-fp8-ctx128-tp1.json",
             *sorted((v39 / "llama-cpp").glob("llama.cpp-*-llama-3.1-8b-*-ctx128.json"))]
    if not all(f.is_file() for f in files) or len(files) != 4:
        pytest.skip("no results/engines-h100 records")
    rows = {r["format"].split(" ")[0]: r for r in shown(capsys, *map(str, files))}
    kv = round((128 + 127 / 2 + 1) * CFG.kv_bytes_per_token())
    embd_f16, embd_q8 = 128256 * 4096 * 2, 128256 * 4096 // 32 * 34
    assert rows["F16"]["bytes/token GB"] == f"{(16_068_891_040 - embd_f16 + kv) / 1e9:.3f}" == "15.043"
    assert rows["Q8_0"]["bytes/token GB"] == f"{(8_540_770_720 - embd_q8 + kv) / 1e9:.3f}" == "8.008"
    assert float(rows["F16"]["bytes/token GB"]) < (CFG.weight_bytes("fp16") + kv) / 1e9 - 1.0   # not the catalog's


# ---- the prefill columns ----------------------------------------------------------------------------------------
LCPP_3B = "llama.cpp-nvidia-h100-80gb-hbm3-llama-3.2-3b-q8-0-ctx128.json"
PREFILL_VS = "prefill vs ours (same GPU, same prompt)"


def committed(name: str) -> dict:
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "results" / "engines-h100" / "llama-cpp" / name)
                      .read_text())


def with_prompt_tests(rec: dict, tests: list[dict]) -> dict:
    """A copy of a committed llama.cpp record whose provenance holds these llama-bench prompt-processing tests."""
    from atomflow_bench.measure.llama_cpp import PROVENANCE_PREFIX, provenance_of

    rec = json.loads(json.dumps(rec))
    prov = provenance_of(rec)
    prov["prompt_tests"] = tests
    text, _ = rec["notes"].split("\n" + PROVENANCE_PREFIX)
    rec["notes"] = f"{text}\n{PROVENANCE_PREFIX}{json.dumps(prov, sort_keys=True)}"
    return rec


@pytest.fixture
def prefill_files(tmp_path):
    """Ours (3B fp8, a 128-token prompt batched, TTFT 8 ms) with the fields; the committed llama-bench record (pp512
    at depth 128) as it is, and as if llama-bench had also run pp128 from an empty cache; the committed server record
    (TTFT at a 129-token prompt) as it is and at 128 tokens; our walked tp run."""
    ours = with_prefill(make_run(1.45, model="llama-3.2-3b"), 8.0)
    walked = with_prefill(make_run(1.6, model="llama-3.2-3b", weights="fp8", seed=4), 40.0, path="walked")
    lcpp = committed(LCPP_3B)
    pp128 = with_prompt_tests(lcpp, [{"n_prompt": 512, "n_depth": 0, "avg_ts": 30000.0, "stddev_ts": 10.0},
                                     {"n_prompt": 128, "n_depth": 0, "avg_ts": 12800.0, "stddev_ts": 10.0}])
    deep128 = with_prompt_tests(lcpp, [{"n_prompt": 128, "n_depth": 128, "avg_ts": 12000.0, "stddev_ts": 10.0}])
    server = committed("llama.cpp-server-nvidia-h100-80gb-hbm3-llama-3.2-3b-q8_0-prompt128.json")
    server128 = dict(server, context=128, metrics=dict(server["metrics"], ttft_ms=20.0))
    tmp_path = tmp_path / "prefill"  # beside the `files` fixture's, when a test takes both
    (tmp_path / "no-baselines").mkdir(parents=True)
    return {"ours": write(tmp_path, "ours.json", ours), "ours_rec": ours,
            "walked": write(tmp_path, "walked.json", walked),
            "lcpp": write(tmp_path, "lcpp.json", lcpp), "pp128": write(tmp_path, "pp128.json", pp128),
            "deep128": write(tmp_path, "deep128.json", deep128),
            "server": write(tmp_path, "server.json", server), "server128": write(tmp_path, "server128.json", server128),
            "none": tmp_path / "no-baselines"}


def by_source(rows: list[dict]) -> dict[str, dict]:
    return {r["source"].rsplit(" [", 1)[-1].rstrip("]") if r["source"].endswith(".json]") else r["source"]: r
            for r in rows}


def test_prefill_columns_and_ratios_at_matching_prompt_lengths(prefill_files, capsys):
    f = prefill_files
    args = (f["ours"], f["walked"], f["lcpp"], f["pp128"], f["deep128"], f["server"], f["server128"], "--baselines",
            f["none"])
    rows = by_source(shown(capsys, *args))
    ours_tok = 128 / 0.008
    assert rows[f["ours"]]["prompt tokens"] == "128" and rows[f["ours"]]["prefill tok/s"] == "16000 (batched)"
    assert rows[f["ours"]]["TTFT ms"] == "8.00" and rows[f["ours"]][PREFILL_VS] == "— (ours)"
    # llama-bench pp128 from an empty cache: the ratio; its pp512 at depth 128: shown with its length, not compared
    assert rows["pp128.json"]["prompt tokens"] == "128" and rows["pp128.json"]["prefill tok/s"] == \
        "12800 (llama-bench pp128, mean)"
    assert rows["pp128.json"][PREFILL_VS] == f"x{ours_tok / 12800:.2f}" == "x1.25"
    assert rows["lcpp.json"]["prompt tokens"] == "512 @ d128"
    assert rows["lcpp.json"]["prefill tok/s"] == "21028 (llama-bench pp512 @ d128, mean)"
    assert rows["lcpp.json"][PREFILL_VS] == "— (prompt 512 after 128, ours 128: not compared)"
    assert rows["deep128.json"][PREFILL_VS] == "— (prompt 128 after 128, ours 128: not compared)"  # not from empty
    # a server's TTFT: at 129 prompt tokens not compared with our 128; at 128 their TTFT / ours
    assert rows["server.json"]["TTFT ms"] == "32.32" and rows["server.json"]["prompt tokens"] == "129"
    assert rows["server.json"][PREFILL_VS] == "— (prompt 129, ours 128: not compared)"
    assert rows["server128.json"][PREFILL_VS] == "x2.50 (TTFT)" and rows["server128.json"]["prefill tok/s"] is None
    # another run of ours at the same prompt, walked: compared, its path named
    assert rows[f["walked"]]["prefill tok/s"] == "3200 (walked)" and rows[f["walked"]][PREFILL_VS] == "x5.00"

    code, out, _ = invoke(capsys, "compare-peers", *args, "--format", "json")
    data = {r["source"].rsplit(" [", 1)[-1].rstrip("]"): r for r in json.loads(out)}
    assert code == 0 and numbers_as_text(list(data.values())) == []
    assert data["pp128.json"][PREFILL_VS] == pytest.approx(1.25) and data["lcpp.json"][PREFILL_VS] is None
    assert data["lcpp.json"]["prompt tokens"] == 512 and data["lcpp.json"]["prefill tok/s"] == 21027.793802
    assert data["server128.json"][PREFILL_VS] == pytest.approx(2.5) and data["server128.json"]["TTFT ms"] == 20.0
    assert data[f["ours"]]["prefill tok/s"] == pytest.approx(ours_tok) and data[f["ours"]][PREFILL_VS] is None


def test_prefill_ratio_only_on_the_same_gpu_and_never_for_records_without_it(prefill_files, tmp_path, capsys):
    from atomflow_bench.measure.peer_table import compare_peers

    f = prefill_files
    rtx = write(tmp_path, "rtx.json", with_prefill(make_run(14.0, model="llama-3.2-3b", gpu=RTX, copy_gbs=420.0), 80.0))
    old = write(tmp_path, "old.json", make_run(1.45, model="llama-3.2-3b"))  # written before the fields
    rows, _ = compare_peers([f["ours"], rtx, old, f["pp128"]], baselines_dir=f["none"])
    src = {r["source"].rsplit(" [", 1)[-1].rstrip("]"): r for r in rows}
    assert src[rtx]["prefill_tok_per_s"] == pytest.approx(1600.0) and src[rtx]["prefill_ratio"] is None
    assert src[rtx]["prefill_basis"] == "other GPU"
    assert src[old]["prompt_tokens"] is None and src[old]["prefill_ratio"] is None and src[old]["prefill_basis"] == ""
    # ours without the fields: the others' figures shown, no ratio
    rows, _ = compare_peers([old, f["pp128"]], baselines_dir=f["none"])
    lcpp = rows[1]
    assert lcpp["prefill_tok_per_s"] == 12800.0 and lcpp["prefill_ratio"] is None
    assert lcpp["prefill_basis"] == "ours has no prefill figure"


def test_records_without_a_prefill_figure_keep_the_table_s_columns(files, prefill_files, tmp_path, capsys):
    old = ["engine", "format", "GPU", "ctx", "TPOT ms", "tok/s", "bytes/token GB", "% of copy roofline", SPEED, NORM,
           "note", "source"]
    code, out, _ = invoke(capsys, "compare-peers", files["ours"], files["f16"], "--format", "json")
    assert code == 0 and list(json.loads(out)[0]) == old
    ours3b = write(tmp_path, "ours-3b.json", make_run(1.45, model="llama-3.2-3b"))  # no prefill figure of ours
    code, out, _ = invoke(capsys, "compare-peers", ours3b, prefill_files["server"], "--format", "json")
    cols = list(json.loads(out)[0])
    assert cols == old[:10] + ["prompt tokens", "prefill tok/s", "TTFT ms", PREFILL_VS] + old[10:]
