"""benchmarks/gpu_check.py stays alive on a CPU: tiny sizes, every row measured, gradients equal."""

from __future__ import annotations

import json

from benchmarks import gpu_check


def test_gpu_check_runs_tiny_on_cpu(tmp_path):
    # two recompute modes of five: the row code is one for all, and each mode's gradients are the
    # activation-checkpointing tests' (every mode x schedule); every mode ran 20 rows here, 36 s of CI
    out, table = tmp_path / "check.json", tmp_path / "check.md"
    result = gpu_check.main(["--device", "cpu", "--sizes", "tiny", "--steps", "1", "--preset", "h100-80gb",
                             "--recompute", "False,selective", "--out", str(out), "--markdown", str(table)])
    rows = result["rows"]
    assert [r for r in rows if "error" in r or "skipped" in r] == []
    replica_rows = [r for r in rows if r["what"].startswith("replica")]
    assert {r["recompute"] for r in replica_rows} == {False, "selective"}
    wanted = len(gpu_check.PRECISIONS) * len(gpu_check.SCHEDULES) * 2
    assert len(replica_rows) == wanted
    for r in replica_rows:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["analytic_s"] > 0 and r["predicted_bytes"] > 0
        assert r["grad_error"] < (1e-5 if r["precision"] == "fp32" else 5e-2), r
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows, default=str))
    assert table.read_text().count("\n") == len(rows) + 2


def test_gpu_check_refuses_an_unknown_size():
    import pytest

    with pytest.raises(SystemExit, match="unknown sizes"):
        gpu_check.main(["--device", "cpu", "--sizes", "huge"])
    with pytest.raises(SystemExit, match="unknown recompute mode"):
        gpu_check.main(["--device", "cpu", "--recompute", "half"])
    with pytest.raises(SystemExit, match=r"unknown precisions \['fp8'\]"):
        gpu_check.main(["--device", "cpu", "--precisions", "fp32,fp8"])
