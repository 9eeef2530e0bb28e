"""`baseline record` against a small OpenAI-compatible SSE server on 127.0.0.1, started by the tests."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from atomflow_bench.measure.baselines import load_baselines
from atomflow_bench.cli import main
from atomflow_bench.errors import AtomflowError
from atomflow_bench.measure.server_baseline import completions_url, record_baseline

DELAY = 0.005   # seconds between tokens: the TPOT the recorder must find
TTFT = 0.03     # seconds before the first token
EOS_AFTER = 7   # tokens a server that does not know ignore_eos generates before stopping


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the connection closes after each response: EOF ends a broken stream

    def log_message(self, *args):
        pass

    def _event(self, obj) -> None:
        self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
        self.wfile.flush()

    def do_POST(self):
        srv: FakeServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append(body)
        if srv.mode == "500":
            self.send_error(500, "model crashed")
            return
        if srv.mode == "strict" and ("ignore_eos" in body or "min_tokens" in body):
            self.send_error(400, "unknown field ignore_eos")
            return
        n = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], EOS_AFTER)
        usage = srv.mode != "no-usage" and body.get("stream_options", {}).get("include_usage")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b": keep-alive comment\n\n")
        time.sleep(TTFT)
        for i in range(n):
            if srv.mode == "truncate" and i == 3:
                return  # the server dies mid-stream
            choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}
            self._event({"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]})
            time.sleep(DELAY)
        if usage:
            self._event({"id": "cmpl-1", "choices": [], "usage": {
                "prompt_tokens": len(body["prompt"].split()), "completion_tokens": n, "total_tokens": 0}})
        self._event(b"[DONE]")


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode, self.requests = mode, []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server(request):
    srv = FakeServer(getattr(request, "param", "ok"))
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def record(srv, **kw):
    args = dict(catalog_model="llama-3.2-3b", precision="bf16", engine="fake", prompt_tokens=16, max_tokens=20,
                requests=3, timeout=5.0)
    return record_baseline(srv.url, "tiny-served", "NVIDIA H100 80GB HBM3", **{**args, **kw})


def test_tpot_and_ttft_measured(server):
    rec = record(server)
    m = rec["metrics"]
    assert DELAY * 1e3 * 0.9 < m["tpot_ms"] < DELAY * 1e3 * 2.0
    assert m["tpot_p10_ms"] <= m["tpot_ms"] <= m["tpot_p90_ms"]
    assert TTFT * 1e3 <= m["ttft_ms"] < TTFT * 1e3 + 500
    assert m["tok_per_s"] == pytest.approx(1e3 / m["tpot_ms"]) and m["samples"] == 3
    assert rec["tokens"] == 20 and rec["context"] == 16  # fixed length; prompt length as the server reported it
    assert rec["model"] == "llama-3.2-3b" and rec["served_model"] == "tiny-served"
    assert rec["gpu"]["memory_bandwidth_gbs"] == 3350 and rec["bytes_format"] == "fp16"
    assert "ignore_eos + min_tokens sent" in rec["method"] and "usage.completion_tokens" in rec["method"]
    assert len(server.requests) == 4  # one warm-up + 3 timed
    first = server.requests[0]
    assert first["stream"] is True and first["ignore_eos"] is True and first["min_tokens"] == 20
    assert first["stream_options"] == {"include_usage": True}
    assert len({r["prompt"] for r in server.requests}) == 4  # no prefix-cache hits between requests


@pytest.mark.parametrize("server", ["no-usage"], indirect=True)
def test_tokens_counted_from_chunks_without_usage(server):
    rec = record(server)
    assert DELAY * 1e3 * 0.9 < rec["metrics"]["tpot_ms"] < DELAY * 1e3 * 2.0
    assert "chunks carrying a choice" in rec["method"]
    assert rec["tokens"] is None and rec["context"] is None  # not confirmed by the server


@pytest.mark.parametrize("server", ["strict"], indirect=True)
def test_server_rejecting_ignore_eos_is_retried_and_noted(server):
    rec = record(server)
    assert "ignore_eos" not in server.requests[-1] and server.requests[-1]["stream_options"]["include_usage"]
    assert "lengths may vary" in rec["method"] and f"{EOS_AFTER}-{EOS_AFTER}" in rec["method"]
    assert rec["tokens"] is None


def test_cli_writes_a_loadable_baseline(server, tmp_path, capsys):
    out = tmp_path / "b" / "fake.json"
    main(["baseline", "record", "--openai-url", server.url + "/v1", "--model", "meta-llama/Llama-3.2-3B-Instruct",
          "--gpu", "NVIDIA GeForce RTX 5060 Ti", "--engine", "fake", "--engine-version", "0.1", "--flags", "--x",
          "--precision", "fp16", "--prompt-tokens", "8", "--max-tokens", "10", "--requests", "2", "--timeout", "5",
          "--out", str(out)])
    assert "TPOT median" in capsys.readouterr().out
    [b] = load_baselines(out.parent)
    assert b["model"] == "llama-3.2-3b" and b["gpu"]["memory_bandwidth_gbs"] == 448
    assert b["engine"] == {"name": "fake", "version": "0.1", "flags": "--x"}
    assert b["source"].startswith("measured with atomflow-bench") and b["tokens"] == 10


@pytest.mark.parametrize("server", ["500"], indirect=True)
def test_http_500_is_a_clean_error(server, capsys):
    with pytest.raises(AtomflowError, match="HTTP 500"):
        record(server)
    with pytest.raises(SystemExit) as e:
        main(["baseline", "record", "--openai-url", server.url, "--model", "m", "--gpu", "g", "--timeout", "5"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "HTTP 500" in err and "Traceback" not in err


@pytest.mark.parametrize("server", ["truncate"], indirect=True)
def test_stream_cut_mid_way_is_a_clean_error(server):
    with pytest.raises(AtomflowError, match=r"ended after 3 chunks without `data: \[DONE\]`|stream broke"):
        record(server)


def test_nothing_listening_is_a_clean_error():
    srv = FakeServer("ok")
    url = srv.url
    srv.server_close()  # the port is free again: connection refused
    with pytest.raises(AtomflowError, match="cannot connect"):
        record_baseline(url, "m", "g", max_tokens=4, requests=1, timeout=2.0)


@pytest.mark.parametrize("base", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", "http://h:1/v1/completions"])
def test_completions_url(base):
    assert completions_url(base) == "http://h:1/v1/completions"


def _table(rec: dict) -> str:
    """The `run` table as markdown (one line per row: what a pipe or a CI log gets)."""
    from atomflow_bench.measure.run_record import run_table
    from atomflow_bench.output import text

    return text(run_table(rec), "md")


def test_run_table_shows_the_forms_and_where_they_came_from():
    """The `run` table names the forms that ran, whether they were tuned now, saved or given, what they mean, the
    fastest timed forms when tuned now, and the TPOT per attention bucket with its GEMV form."""
    from helpers_runs import make_run

    rec = make_run(1.5)
    rec.update({"vram_bytes": {"weights": 1 << 30, "kv": 1 << 20, "activations": 1 << 16, "scratch": 1 << 16,
                               "total": (1 << 30) + (1 << 20) + (1 << 17)},
                "launches_per_step": 142, "pdl": True, "load": {"seconds": 1.0},
                "forms": {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "tuned now", "path": "/x.json",
                          "timed": {"lengths": [192, 384], "step_us": {"short:ring/l2=8": 1455.5,
                                                                       "short:ws/l2=8": 1530.0,
                                                                       "split:ring/l2=8": 1490.25,
                                                                       "short:ring/l2=0": 1480.0}}},
                "attention_buckets": [{"attention": "short <= 416", "lengths": [128, 383], "tokens": 256,
                                       "tpot_ms": 1.5, "gemv": "ring/l2=8"}]})
    text = _table(rec)
    assert "short:ring/l2=8;split:ring/l2=0 — tuned in this run: short attention, layer GEMVs per-warp ring" in text
    assert "QKV asks L2 for the last 8 MB of gate/up's weights; beyond it split attention" in text
    assert ("4 forms timed at lengths [192, 384]; fastest short:ring/l2=8 1455.5 µs, short:ring/l2=0 1480.0 µs, "
            "split:ring/l2=8 1490.2 µs") in text
    assert "short <= 416 (lengths 128-383, GEMVs ring/l2=8): 1.5000 ms" in text
    rec["forms"] = {"forms": "split:ws-pre2/l2=0", "origin": "saved", "path": "/x.json"}
    text = _table(rec)
    assert "split:ws-pre2/l2=0 — a saved tune: split attention at every length" in text
    assert "2 ring slots filled before the PDL wait" in text and "forms timed" not in text
    rec["forms"] = {"forms": "split:ring/l2=0", "origin": "given"}
    assert "given (--forms / ATOMFLOW_FORMS)" in _table(rec)


def test_instrument_defines_and_run_table_warning():
    """Only a non-zero instrument knob counts; the `run` table says the TPOT of such a run is a bound."""
    from atomflow_bench.gpu.nvrtc import instrument_defines
    from helpers_runs import make_run

    assert instrument_defines(("GEMV_ONE_WAVE=0", "AF_NO_WAIT=0")) == []
    assert instrument_defines(("ATT_TMA=1", "AF_NO_WAIT=6")) == ["AF_NO_WAIT=6"]
    assert instrument_defines(("AF_NO_SCALES=1", "AF_NO_WAIT=0")) == ["AF_NO_SCALES=1"]
    rec = make_run(1.3)
    rec.update({"vram_bytes": {"weights": 1 << 30, "kv": 1 << 20, "activations": 1 << 16, "scratch": 1 << 16,
                               "total": (1 << 30) + (1 << 20) + (1 << 17)},
                "launches_per_step": 144, "pdl": True, "load": {"seconds": 1.0}})
    assert "INSTRUMENT" not in _table(rec)
    rec["instrument"] = ["AF_NO_WAIT=15"]
    text = _table(rec)
    assert "| INSTRUMENT | AF_NO_WAIT=15: a timing instrument" in text and "a bound, not a result" in text


def test_profile_table_names_the_profiled_step():
    """`profile`'s eager table says which step it profiled: the attention bucket and layer-GEMV form at its length."""
    from atomflow_bench.measure.profile import profile_table
    from atomflow_bench.output import text as as_text

    p = {"context": 8192, "steps": 20, "kernel_sum_us": 2672.6, "graph_step_us": 1786.1, "idle_gap_us": -886.5,
         "copy_bandwidth_gbs": {"median": 2994.0},
         "rows": [{"kernel": "gemv fp8 wgu 16384x3072", "pct": 25.2, "count": 28, "mean_us": 23.97, "us_per_step": 672.4,
                   "gbs": 2167.0, "pct_of_copy": 72.4}],
         "forms": {"length": 8193, "attention": "split", "gemv": "ring/l2=0"}}
    text = as_text(profile_table(p), "md")
    assert "| gemv fp8 wgu 16384x3072 | 25.2 | 28 | 23.97 | 672.4 | 2167 | 72 |" in text
    assert "the step at length 8193: split attention, layer GEMVs ring/l2=0" in text
    del p["forms"]  # records written before v34 have no `forms`
    text = as_text(profile_table(p), "md")
    assert "copy bandwidth 2994 GB/s" in text and "layer GEMVs" not in text


def test_tool_info_names_the_code(tmp_path):
    """Every record's `tool` names its code three ways: the git commit, whether tracked files differ from it, and a hash
    of the package and kernel sources that changes with any byte or name of them (and with nothing else)."""
    from atomflow_bench.measure.run_record import source_sha256, tool_info

    info = tool_info()
    assert set(info) >= {"git_commit", "git_dirty", "source_sha256"} and len(info["source_sha256"]) == 16
    pkg, ker = tmp_path / "pkg", tmp_path / "ker"
    pkg.mkdir()
    ker.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    (ker / "k.cu").write_text("// kernel\n")
    (ker / "notes.txt").write_text("not code")
    first = source_sha256(pkg, ker)
    assert source_sha256(pkg, ker) == first
    (ker / "notes.txt").write_text("still not code")
    assert source_sha256(pkg, ker) == first
    (ker / "k.cu").write_text("// kernel.\n")
    second = source_sha256(pkg, ker)
    assert second != first
    (ker / "k.cu").rename(ker / "j.cu")
    assert source_sha256(pkg, ker) not in (first, second)


def test_cli_records_the_servers_own_weight_bytes(server, tmp_path, capsys):
    """--weight-bytes / --weight-bytes-basis go into the record; compare-peers then counts them (not the catalog's)."""
    from atomflow_bench.measure.baselines import baseline_bytes_per_token

    out = tmp_path / "b" / "server.json"
    main(["baseline", "record", "--openai-url", server.url + "/v1", "--model", "llama-3.2-3b", "--gpu",
          "NVIDIA H100 80GB HBM3", "--engine", "llama.cpp-server", "--precision", "Q8_0", "--prompt-tokens", "8",
          "--max-tokens", "10", "--requests", "2", "--timeout", "5", "--weight-bytes", "3421894912",
          "--weight-bytes-basis", "GGUF file size", "--out", str(out)])
    [b] = load_baselines(out.parent)
    assert b["weight_bytes"] == 3421894912 and b["weight_bytes_basis"] == "GGUF file size"
    kv = baseline_bytes_per_token(b, 100) - 3421894912
    assert 0 < kv < 3421894912 // 100


def test_weight_bytes_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["baseline", "record", "--openai-url", "http://127.0.0.1:9", "--model", "m", "--gpu", "g",
              "--weight-bytes", "0"])
    assert e.value.code == 2
