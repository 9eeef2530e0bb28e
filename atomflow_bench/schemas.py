"""Every kind of record the tool writes, with every schema id it has written for that kind and what those records
hold: the one list its readers take their ids from.

An id names a set of fields and what they mean. A writer may add a field its readers can do without and keep the id;
a writer that drops or renames a field, changes what one means, or starts writing one that its readers then need (so
that the earlier records of that id lack it) takes the next id, added below. A reader takes every id listed for its
kind and adapts the fields of the older ones; an id that names a kind it reads but is not listed (a record of another
version of the tool) is refused in one line (`check`). The writers take `current(kind)`, the last one listed.
"""
from __future__ import annotations

from .errors import ConfigError

PREFIX = "atomflow-bench/"

SCHEMAS: dict[str, dict[str, str]] = {
    "run": {
        "atomflow-bench/run/1":
            "`run`'s record (docs/RESULTS.md): schema, gpu, model, weights, context, tokens, tpot_ms, "
            "copy_bandwidth_gbs, bytes_per_token and roofline in every one; the fields written since the first "
            "records are optional to readers: forms (the first records: attention_choice and gemv_choice instead), "
            "tp, energy, instrument, peers, l2_keep, other_gpu_processes, ttft_ms, prefill, tensor_core_tflops.",
    },
    "profile": {
        "atomflow-bench/profile/1":
            "`profile --json`. One GPU: the kernel table (rows, kernel_sum_us, graph_step_us, idle_gap_us, "
            "copy_bandwidth_gbs, forms, ...), and in the later records role_marginals. --tp: tp, forms "
            "{forms, origin} and comm (the step and its exchanges), and in the later records role_marginals. A "
            "reader finds role_marginals missing from some records of this id.",
        "atomflow-bench/profile/2":
            "profile/1's fields, and role_marginals in every record (with --tp: of rank 0's step without its "
            "exchanges); prefill (the last prefill chunk of a prompt, op by op: measure/prefill_profile.py; null "
            "with prefill_note where the engine does not prefill) is optional to readers: the earlier records lack "
            "it.",
    },
    "baseline": {
        "atomflow-bench/baseline/1":
            "a recorded baseline, the fields measure/baselines.py lists; weight_bytes, gguf_bytes, "
            "weight_bytes_basis and metrics.tpot_fit_ms (with which metrics.tpot_ms is optional) were added, "
            "optional, after the first records.",
    },
    "sweep": {
        "atomflow-bench/sweep/1":
            "a sweep's summary.json (docs/RESULTS.md); its cells' figures are read from their own run records.",
    },
    "tuning": {
        "atomflow-bench/tuning/1":
            "a saved tune under $ATOMFLOW_HOME/tuning: key, forms (the text), timed, created; max_seq in the later "
            "ones (the file's name holds it too).",
    },
    "truth": {
        "atomflow-bench/truth/1": "validate's ground truth: truth.json beside truth.safetensors (docs/VALIDATION.md).",
    },
    "validate": {
        "atomflow-bench/validate/1":
            "`validate --json`: the probes, their summary, the engine and the truth used; in the later records "
            "prefill (the prefill path's probes and summary, null where it is not checked), optional to readers.",
    },
    "quality": {
        "atomflow-bench/quality/1": "`validate --quality --json`: fp8 against fp16 on a paragraph of English.",
    },
    "gemv": {
        "atomflow-bench/gemv/1": "`gemv --json`: every GEMV shape alone, isolated and chained.",
    },
    "llama-cpp-source": {
        "atomflow-bench/llama-cpp-source/1":
            "the provenance of the llama.cpp tree the llama.cpp baselines were built from (SOURCE.json, written by "
            "the repository's pinning script; measure/llama_cpp.py's --source-json reads it).",
    },
}


def current(kind: str) -> str:
    """The id a writer of `kind` writes: the last one listed."""
    return list(SCHEMAS[kind])[-1]


def ids(kind: str) -> tuple[str, ...]:
    """Every id a reader of `kind` takes, the oldest first."""
    return tuple(SCHEMAS[kind])


def named_kind(schema) -> str | None:
    """The kind an id names by its form (`atomflow-bench/<kind>/<n>`), listed or not; None for another form."""
    if not isinstance(schema, str) or not schema.startswith(PREFIX):
        return None
    kind, _, n = schema[len(PREFIX):].partition("/")
    return kind if kind in SCHEMAS and n.isdigit() else None


def check(rec, kinds, where) -> str | None:
    """The kind (one of `kinds`) whose listed ids hold record `rec`'s id; None when its id is of no kind in `kinds`
    (the reader then says what it reads). An id of one of `kinds` that is not listed: ConfigError, one line."""
    schema = rec.get("schema") if isinstance(rec, dict) else None
    kind = named_kind(schema)
    if kind not in kinds:
        return None
    if schema not in SCHEMAS[kind]:
        raise ConfigError(f"{where}: schema {schema!r} is not one this version of atomflow-bench reads ({kind} "
                            f"records: {', '.join(SCHEMAS[kind])})")
    return kind
