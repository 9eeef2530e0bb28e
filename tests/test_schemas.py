"""Record ids (atomflow_bench/schemas.py): every record committed under results/, lab/records/ and baselines/ loads
through each reader of its kind (plot, compare, compare-peers, sweep, baseline list), the older ids adapted; an id
the list does not hold is refused in one line; the writers write the newest id of their kind."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from atomflow_bench import schemas
from atomflow_bench.cli import main
from atomflow_bench.errors import AtomflowError, ConfigError
from atomflow_bench.measure import baselines, llama_cpp, peer_table, plot, run_record, sweep, tune

ROOT = Path(__file__).resolve().parents[1]
OLD_TP_PROFILE = ROOT / "lab" / "records" / "v41-tp" / "C" / "profile-8b-fp16-tp2.json"


def committed_records() -> list[tuple[Path, dict]]:
    """(path, record) of every committed JSON object of results/, lab/records/ and baselines/ with an atomflow-bench
    schema id."""
    out = subprocess.run(["git", "ls-files", "results", "lab/records", "baselines"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    recs = []
    for name in out:
        if name.endswith(".json"):
            rec = json.loads((ROOT / name).read_text())
            if isinstance(rec, dict) and str(rec.get("schema", "")).startswith(schemas.PREFIX):
                recs.append((ROOT / name, rec))
    return recs


def test_the_list():
    for kind, listed in schemas.SCHEMAS.items():
        assert listed and all(schemas.named_kind(i) == kind for i in listed), kind
        assert [int(i.rsplit("/", 1)[1]) for i in listed] == list(range(1, len(listed) + 1)), kind
        assert all(text.strip() for text in listed.values()) and schemas.current(kind) == list(listed)[-1]
    assert schemas.current("profile") == "atomflow-bench/profile/2"
    assert run_record.head("profile")["schema"] == "atomflow-bench/profile/2"
    assert run_record.SCHEMA == schemas.current("run") and baselines.SCHEMA == schemas.current("baseline")


def test_every_committed_record_loads_through_its_readers():
    recs = committed_records()
    kinds = {schemas.named_kind(r["schema"]) for _, r in recs}
    assert {"run", "profile", "baseline", "sweep", "validate", "llama-cpp-source"} <= kinds and len(recs) > 200
    for path, rec in recs:
        kind = schemas.named_kind(rec["schema"])
        assert kind is not None and rec["schema"] in schemas.ids(kind), f"{path}: {rec['schema']} is not listed"
        if kind in ("run", "profile", "baseline", "sweep"):  # plot
            got = plot.load_records([path])
            assert got["ignored"] == [] or kind == "sweep", (path, got["ignored"])
        if kind == "run":  # compare and sweep read through run_record.load; compare-peers takes a result
            sweep.figures(run_record.load(path))
            if rec.get("instrument"):
                with pytest.raises(AtomflowError, match="timing-instrument run"):
                    peer_table.load_result(path)
            else:
                assert peer_table.load_result(path)[0] == "run"
        if kind == "baseline":  # baseline list, run's comparisons, compare-peers
            baselines.load_baseline(path)
            assert peer_table.load_result(path)[0] == "baseline"
        if kind == "llama-cpp-source":  # measure/llama_cpp.py --source-json
            assert llama_cpp.read_source(path) == rec


def test_the_older_tp_profile_is_read_by_plot():
    """A profile/1 record of `profile --tp` from before roles were taken apart: no role_marginals, its exchanges."""
    got = plot.load_records([OLD_TP_PROFILE])
    [(path, rec)] = got["profiles"]
    assert path == OLD_TP_PROFILE and rec["role_marginals"] is None and rec["comm"]["paths"]


def test_the_older_tp_profile_is_plotted(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    try:
        main(["plot", str(OLD_TP_PROFILE), "--out", str(tmp_path), "--format", "json"])
    except SystemExit as e:
        assert e.code in (0, None)
    rows = json.loads(capsys.readouterr().out)
    assert [r["plot"] for r in rows] == ["exchanges"]
    assert Path(rows[0]["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _profile(schema: str, roles: bool, comm: bool) -> dict:
    rec = {"schema": schema, "gpu": {"name": "NVIDIA H100 80GB HBM3"}, "model": "llama-3.2-1b", "weights": "fp16",
           "context": 128, "tp": 2}
    if roles:
        rec["role_marginals"] = {"length": 129, "step_us": {"median": 900.0},
                                 "rows": [{"role": "wqkv", "count": 16, "saved_us": 90.0, "floor_us": 80.0}]}
    if comm:
        step = {"median": 950.0, "p10": 949.0, "p90": 951.0}
        rec["comm"] = {"path": "peer", "sum_bytes": 8192, "sums_per_token": 32, "in_step_us": 50.0,
                       "step_graph_us": step, "step_without_exchanges_us": {"median": 900.0},
                       "paths": {"peer": {"per_token_us": 80.0, "token_graph_us": {"median": 80.0}}}}
    return rec


@pytest.mark.parametrize("schema, roles, comm, refused", [
    ("atomflow-bench/profile/1", False, True, None),             # the older --tp record: its exchanges
    ("atomflow-bench/profile/1", True, False, None),
    ("atomflow-bench/profile/2", True, True, None),
    ("atomflow-bench/profile/2", False, True, "without role_marginals.rows"),  # profile/2 always has them
    ("atomflow-bench/profile/1", False, False, "nothing of it to plot"),      # the kernel table alone
])
def test_profile_records_by_id(tmp_path, schema, roles, comm, refused):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(_profile(schema, roles, comm)))
    if refused:
        with pytest.raises(AtomflowError, match=refused):
            plot.load_records([f])
        assert plot.load_records([tmp_path])["ignored"][0][0] == f  # in a directory: left out, said why
    else:
        assert len(plot.load_records([f])["profiles"]) == 1


@pytest.mark.parametrize("argv_of, schema", [
    (None, "atomflow-bench/profile/9"),  # plot's reader (the command needs matplotlib first)
    (None, "atomflow-bench/run/2"),
    (lambda f: ["compare", f, f], "atomflow-bench/run/2"),
    (lambda f: ["compare-peers", f], "atomflow-bench/baseline/2"),
    (lambda f: ["baseline", "list", "--baselines", str(Path(f).parent)], "atomflow-bench/baseline/3"),
])
def test_an_id_the_list_lacks_is_refused_in_one_line(tmp_path, capsys, argv_of, schema):
    f = tmp_path / "rec.json"
    f.write_text(json.dumps({"schema": schema, "gpu": {"name": "x"}}))
    if argv_of is None:
        with pytest.raises(AtomflowError) as e:
            plot.load_records([f])
        err = f"error: {e.value}\n"
    else:
        with pytest.raises(SystemExit) as e:
            main(argv_of(str(f)))
        err = capsys.readouterr().err
        assert e.value.code != 0
    assert len(err.strip().splitlines()) == 1, err
    kind = schemas.named_kind(schema)
    assert err.startswith("error: ") and f"schema {schema!r} is not one this version of atomflow-bench reads" in err
    assert f"({kind} records: {', '.join(schemas.ids(kind))})" in err


def test_other_readers_refuse_an_id_the_list_lacks(tmp_path, monkeypatch, capsys):
    from atomflow_bench.validate.truth import TRUTH_JSON, Truth

    (tmp_path / TRUTH_JSON).write_text(json.dumps({"schema": "atomflow-bench/truth/2"}))
    with pytest.raises(ConfigError, match="'atomflow-bench/truth/2' is not one this version"):
        Truth(tmp_path)
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    k = {"gpu": "x"}
    p = tune.path_of(k, 256)
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"schema": "atomflow-bench/tuning/2", "forms": "short:ring/l2=8;split:ring/l2=0"}))
    assert tune.load_key(k, 256) is None  # another version's tune: tuned anew, with one warning
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'atomflow-bench/tuning/2' is not one this version" in err
    src = tmp_path / "SOURCE.json"
    for schema, why in (("atomflow-bench/llama-cpp-source/2", "is not one this version"),
                        (None, "not a llama.cpp source record")):
        src.write_text(json.dumps({"schema": schema}))
        assert llama_cpp.main(["bench.json", "--source-json", str(src), "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and why in err, err
