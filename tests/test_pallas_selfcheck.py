"""The kernel self-check that benchmarks/gpu_check.py runs: its rows; it sees a bad kernel."""

from __future__ import annotations

import pytest

from pallas_kernels import selfcheck
from pallas_kernels._common import DecodeStats

KEYS = {"kernel", "shape", "dtype", "max_abs_err", "ok"}


@pytest.mark.slow
def test_run_all_interpret_rows_pass():
    rows = selfcheck.run_all(interpret=True, kernels=("fused_topk",))
    assert {(r["kernel"], r["dtype"]) for r in rows} == {
        ("fused_topk", "float32"),
        ("fused_topk", "bfloat16"),
    }
    for r in rows:
        assert set(r) >= KEYS, r
        assert r["ok"], r
        assert 0 <= r["max_abs_err"] < 1e-3


@pytest.mark.slow
def test_wrong_kernel_is_reported(monkeypatch):
    def off_by_one(h, w, seeds=None, **kw):
        out = selfcheck.fused_decode(h, w, seeds, **kw)
        return DecodeStats(out.max_b, out.argmax_b, out.lse_b + 0.01, out.sample_b)

    def broken(*args, **kw):
        raise RuntimeError("does not lower")

    monkeypatch.setitem(selfcheck.KERNELS, "fused_decode", (off_by_one, selfcheck.DecodeBlocks))
    monkeypatch.setitem(selfcheck.KERNELS, "tiled_decode", (broken, selfcheck.TiledBlocks))
    rows = selfcheck.run_all(interpret=True, kernels=("fused_decode", "tiled_decode"))
    assert rows and not any(r["ok"] for r in rows)
    assert all("does not lower" in r["error"] for r in rows if r["kernel"] == "tiled_decode")
    assert all(
        r["max_abs_err"] == pytest.approx(0.01, rel=0.01)
        for r in rows
        if r["kernel"] == "fused_decode"
    )
