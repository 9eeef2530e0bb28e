"""Record a live baseline from any OpenAI-compatible server (vLLM, SGLang, llama.cpp server, ...).

Each request POSTs `/v1/completions` with `stream: true` and reads the server-sent events (`data: {...}`
lines until `data: [DONE]`), timestamping every chunk on arrival. Lengths are fixed where the server allows
it (`ignore_eos: true`, `min_tokens` = `max_tokens`, as vLLM accepts); a server that rejects those fields
(HTTP 400/422) is asked again without them, and the baseline says that lengths may vary. The token count
comes from the server's `usage` (asked for with `stream_options.include_usage`) when it sends one, else from
the number of chunks carrying a choice.

Per request: TTFT = first chunk - request sent; TPOT = (last chunk - first chunk) / (tokens - 1).
One untimed warm-up request comes first; the baseline holds the median, p10 and p90 over the timed ones.
Only the standard library's HTTP client is used; every read has a timeout and every loop a bound.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import AtomflowError
from ..store.store import write_json_atomic
from .baselines import SCHEMA, catalog_name, spec_bandwidth, validate
from .run_record import now_iso, slug
from .timing import summarize

FIXED_LENGTH = "fixed"
# Request variants, tried in this order on the warm-up request until the server accepts one.
VARIANTS = (
    (FIXED_LENGTH, lambda n: {"ignore_eos": True, "min_tokens": n, "stream_options": {"include_usage": True}}),
    ("usage", lambda n: {"stream_options": {"include_usage": True}}),
    ("plain", lambda n: {}),
)


class _Rejected(AtomflowError):
    """The server refused the request's fields (HTTP 400/422): try a plainer variant."""


def completions_url(base: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/completions` -> the completions endpoint."""
    base = base.rstrip("/")
    if base.endswith("/completions"):
        return base
    return base + ("/completions" if base.endswith("/v1") else "/v1/completions")


def synthetic_prompt(n_words: int, request: int) -> str:
    """About `n_words` tokens; the leading request number defeats prefix caching between requests."""
    return " ".join([str(request)] + ["the"] * max(n_words - 1, 0))


def stream_once(url: str, payload: dict, timeout: float, max_tokens: int) -> dict:
    """One streamed completion: {ttft_s, t_first, t_last, chunks, usage_tokens, prompt_tokens}."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    deadline = time.monotonic() + timeout + max_tokens  # a whole request: one second per token on top
    t0 = time.perf_counter()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        body = e.read(300).decode(errors="replace").strip().replace("\n", " ")
        cls = _Rejected if e.code in (400, 422) else AtomflowError
        raise cls(f"POST {url}: HTTP {e.code} {e.reason}: {body}") from None
    except (urllib.error.URLError, OSError) as e:
        raise AtomflowError(f"POST {url}: cannot connect ({getattr(e, 'reason', e)})") from None
    times, usage, done = [], None, False
    try:
        with resp:
            for _ in range(8 * max_tokens + 64):  # data + blank line per chunk, a few comments/keep-alives
                if time.monotonic() > deadline:
                    raise AtomflowError(f"POST {url}: no end of stream within {timeout + max_tokens:.0f} s")
                line = resp.readline()
                now = time.perf_counter()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    raise AtomflowError(f"POST {url}: not a JSON event: {data[:120]!r}") from None
                if "error" in event:
                    raise AtomflowError(f"POST {url}: server error in stream: {event['error']}")
                if event.get("choices"):
                    times.append(now)
                usage = event.get("usage") or usage
            else:
                raise AtomflowError(f"POST {url}: stream longer than expected for max_tokens={max_tokens}")
    except (http.client.HTTPException, OSError) as e:
        raise AtomflowError(f"POST {url}: stream broke after {len(times)} chunks ({type(e).__name__}: {e})") from None
    if not done:
        raise AtomflowError(f"POST {url}: stream ended after {len(times)} chunks without `data: [DONE]`")
    if not times:
        raise AtomflowError(f"POST {url}: stream carried no completion chunks")
    return {"ttft_s": times[0] - t0, "t_first": times[0], "t_last": times[-1], "chunks": len(times),
            "usage_tokens": (usage or {}).get("completion_tokens"), "prompt_tokens": (usage or {}).get("prompt_tokens")}


def _tpot_ms(r: dict, url: str) -> float:
    n = r["usage_tokens"] or r["chunks"]
    if n < 2:
        raise AtomflowError(f"POST {url}: only {n} token(s) generated; TPOT needs at least 2")
    return (r["t_last"] - r["t_first"]) / (n - 1) * 1e3


def measure(url: str, model: str, prompt_tokens: int, max_tokens: int, requests: int, timeout: float = 60.0) -> dict:
    """Warm-up (choosing the request variant the server accepts), then `requests` timed completions."""
    url = completions_url(url)

    def payload(i: int, extra: dict) -> dict:
        return {"model": model, "prompt": synthetic_prompt(prompt_tokens, i), "max_tokens": max_tokens,
                "temperature": 0, "stream": True, **extra}

    for variant, extra in VARIANTS:
        try:
            stream_once(url, payload(0, extra(max_tokens)), timeout, max_tokens)
            break
        except _Rejected:
            if variant == VARIANTS[-1][0]:
                raise
    runs = [stream_once(url, payload(i, extra(max_tokens)), timeout, max_tokens) for i in range(1, requests + 1)]
    return {"variant": variant, "runs": runs, "tpot_ms": [_tpot_ms(r, url) for r in runs],
            "ttft_ms": [r["ttft_s"] * 1e3 for r in runs]}


def bytes_format_for(precision: str) -> str | None:
    p = precision.lower()
    if p in ("fp16", "bf16", "float16", "bfloat16", "half"):
        return "fp16"
    return "fp8" if p in ("fp8", "w8a16") else None


def record_baseline(openai_url: str, model: str, gpu: str, *, catalog_model: str | None = None,
                    gpu_bandwidth: float | None = None, precision: str = "unspecified",
                    engine: str = "OpenAI-compatible server",
                    engine_version: str | None = None, flags: str | None = None, prompt_tokens: int = 128,
                    max_tokens: int = 128, requests: int = 5, timeout: float = 60.0, command: str = "",
                    weight_bytes: int | None = None, weight_bytes_basis: str | None = None) -> dict:
    """Measure the server and return an `atomflow-bench/baseline/1` record (validated). `weight_bytes`: the server's
    own weight bytes read per token when known (e.g. a GGUF's, measure/llama_cpp.py streamed_weight_bytes), with how
    it was computed; else the comparison counts the catalog model at the record's precision."""
    m = measure(openai_url, model, prompt_tokens, max_tokens, requests, timeout)
    runs = m["runs"]
    counted = [r["usage_tokens"] or r["chunks"] for r in runs]
    from_usage = all(r["usage_tokens"] for r in runs)
    fixed = from_usage and all(n == max_tokens for n in counted)
    reported_prompt = {r["prompt_tokens"] for r in runs}
    context = reported_prompt.pop() if len(reported_prompt) == 1 and None not in reported_prompt else None
    tp, tt = summarize(m["tpot_ms"]), summarize(m["ttft_ms"])
    length_note = ("ignore_eos + min_tokens sent" if m["variant"] == FIXED_LENGTH
                   else "the server rejected ignore_eos/min_tokens, so lengths may vary")
    method = (f"{requests} streamed POST {completions_url(openai_url)} requests (SSE, temperature 0) after one "
              f"untimed warm-up; prompt of ~{prompt_tokens} words (server-reported: "
              f"{context if context is not None else 'n/a'} tokens), max_tokens {max_tokens} ({length_note}); "
              f"generated tokens per request {min(counted)}-{max(counted)}, counted from "
              f"{'usage.completion_tokens' if from_usage else 'chunks carrying a choice'}. "
              "TTFT = first chunk - request sent; TPOT = (last chunk - first chunk) / (tokens - 1); "
              "median/p10/p90 over requests. Times include the HTTP/SSE path on the client side.")
    rec = {
        "schema": SCHEMA,
        "engine": {"name": engine, "version": engine_version, "flags": flags},
        "gpu": {"name": gpu, "memory_bandwidth_gbs": gpu_bandwidth or spec_bandwidth(gpu)},
        "model": catalog_model or catalog_name(model), "served_model": model,
        "precision": precision, "bytes_format": bytes_format_for(precision),
        "context": context, "tokens": max_tokens if fixed else None,
        "metrics": {"tpot_ms": tp["median"], "tok_per_s": 1e3 / tp["median"], "tpot_p10_ms": tp["p10"],
                    "tpot_p90_ms": tp["p90"], "ttft_ms": tt["median"], "samples": requests},
        "source": f"measured with {command or 'atomflow-bench baseline record'} on {now_iso()[:10]}",
        "method": method,
        "created": now_iso(),
    }
    if weight_bytes is not None:
        rec["weight_bytes"] = weight_bytes
        rec["weight_bytes_basis"] = weight_bytes_basis
    return validate(rec, "recorded baseline")


def default_path(rec: dict, directory: Path = Path("baselines")) -> Path:
    stamp = rec["created"].replace(":", "").replace("-", "")
    return directory / f"{slug(rec['engine']['name'])}-{slug(rec['gpu']['name'])}-{slug(rec['model'])}-{stamp}.json"


def write_baseline(rec: dict, path: Path | None = None) -> Path:
    path = Path(path) if path else default_path(rec)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, rec)
    return path
