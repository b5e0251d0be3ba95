"""sims/quality.py on a tiny configuration: every part runs, the report has a row and a verdict
per claim, and a second invocation resumes (reads every run, trains none)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64}


def load_study(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "sims"))  # the script imports its _common
    spec = importlib.util.spec_from_file_location("sims_quality", ROOT / "sims" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_study_runs_small_and_resumes(tmp_path, monkeypatch, capsys):
    quality = load_study(monkeypatch)
    monkeypatch.setattr(quality, "shipped_tokenizers", list)  # whatever this venv has installed
    micro = tmp_path / "micro.json"
    micro.write_text(json.dumps(SHAPE))
    args = [
        "--work", str(tmp_path / "work"), "--scales", str(micro), "--corpora", "builtin",
        "--vocab", "300,400", "--seeds", "2", "--train-bytes", "2k", "--max-bytes", "128k",
        "--seq-len", "16", "--batch", "2", "--eval-bytes", "1k", "--prune-from", "400",
        "--prune-to", "300", "--head-set", "300,400", "--compression-bytes", "128k",
        "--compression-vocab", "300,500", "--figure", str(tmp_path / "q.png"),
        "--data", str(tmp_path / "q.json"),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [str(ROOT / "sims" / "quality.py"), *args])
    docs = {}

    def keep(name, title, body):
        docs[name] = body

    assert quality.main(args, doc_writer=keep) == 0
    log = capsys.readouterr().err
    assert "runs (bpb: 4, pruned: 4, heads: 4)" in log and "min left" in log
    assert "[12/12]" in log and "trained in" in log and "eta" in log
    body = docs["quality.md"]
    assert "**Equal training bytes, not equal tokens**" in body
    for claim in ("(1) bpb spread", "(2) pruning 400 -> 300", "(3) nested heads",
                  "(3) separate heads", "(4) training throughput"):  # fmt: skip
        row = next(line for line in body.splitlines() if claim in line)
        assert any(word in row for word in ("agrees", "disagrees", "inconclusive")), row
    data = json.loads((tmp_path / "q.json").read_text())
    assert data["kind"] == "quality_study" and len(data["pruned_pct"]) == 2
    # the claim table paper_claims.py reads is the doc's own
    assert len(data["claims"]) >= 7 and all(row in body for row in data["claims"])
    assert {r["vocab"] for r in data["bpb"]} == {300, 400}
    # every run of the corpus was scored on one held-out text, whatever its V
    (corpus,) = data["corpora"]
    assert corpus["runs"] == 12 and len(corpus["heldout"]) == 1 and len(corpus["train"]) == 1
    assert "(one text for every run)" in body
    assert "each run's from its own training steps: the median step of" in body
    assert (
        tmp_path / "work" / "micro-builtin-v400-to-v300-s1" / "tokenizer" / "id_map.json"
    ).exists()
    assert (tmp_path / "q.png").stat().st_size > 0
    # Resumed: every run is read, none trained again.
    assert quality.main(args, doc_writer=keep) == 0
    again = capsys.readouterr().err
    assert again.count(" steps read;") == 12 and "trained in" not in again
    # Other settings over the same --work: an error, not runs of two studies mixed.
    other = [x if x != "2k" else "3k" for x in args]
    assert quality.main(other, doc_writer=keep) != 0
    err = capsys.readouterr().err
    assert "was trained for" in err and "give another --work" in err


def test_the_time_left_is_scaled_by_the_runs_already_trained(tmp_path, monkeypatch):
    import types

    quality = load_study(monkeypatch)
    args = types.SimpleNamespace(batch=8, seq_len=64)
    study = types.SimpleNamespace(args=args, work=tmp_path)

    def job(key: str, scale: str):
        return quality.Job(key, scale, "builtin", (512,), 0, 100)

    tiny = [job("t0", "tiny"), job("t1", "tiny")]
    small = [job("s0", "small"), job("s1", "small"), job("s2", "small")]
    parts = {"bpb": tiny + small}
    left, how = quality.estimate(study, parts)
    assert left == pytest.approx(sum(quality.guess(j, args) for j in tiny + small))
    assert how.startswith("at 100 GFLOP/s")

    def trained(j, seconds: float) -> None:
        (tmp_path / j.key).mkdir()
        (tmp_path / j.key / "training.json").write_text("{}")
        times = json.loads((tmp_path / "seconds.json").read_text()) if j.key != "t0" else {}
        times[j.key] = seconds
        (tmp_path / "seconds.json").write_text(json.dumps(times))

    trained(tiny[0], 3 * quality.guess(tiny[0], args))  # tiny ran 3x slower than assumed
    left, how = quality.estimate(study, parts)
    assert left == pytest.approx(3 * sum(quality.guess(j, args) for j in tiny[1:] + small))
    trained(small[0], 2 * quality.guess(small[0], args))  # small 2x: its own scale's figure
    left, how = quality.estimate(study, parts)
    want = 3 * quality.guess(tiny[1], args) + 2 * sum(quality.guess(j, args) for j in small[1:])
    assert left == pytest.approx(want)
    assert "the 2 runs trained here (small x2.00, tiny x3.00)" in how
    for j, t in ((tiny[1], 1.0), (small[1], 1.0), (small[2], 1.0)):
        trained(j, t)
    assert quality.estimate(study, parts) == (0.0, "every run is trained")


def test_the_compression_reading_separates_v_from_the_family(monkeypatch):
    quality = load_study(monkeypatch)

    def point(tokenizer, vocab, bpt):
        return {"tokenizer": tokenizer, "vocab": vocab, "bytes_per_token": bpt}

    comp = {
        "points": [
            point("nested 32768", 32768, 4.0),
            point("nested 65536", 65536, 4.1),
            point("m/d/tekken.json cut to 32768", 32768, 3.2),
            point("m/d/tekken.json cut to 65536", 65536, 3.5),
            point("m/d/tekken.json", 131072, 3.7),
            point("w/a/gpt2.tiktoken cut to 32768", 32768, 3.0),
            point("w/a/gpt2.tiktoken", 50256, 3.1),
            point("m/d/sp.model.v1", 32000, 3.3),
        ],
        "aliases": {"m/d/sp.model.v1": ["m/d/sp.model.v2"]},
    }
    v = {row["series"]: row for row in quality.v_alone(comp)}
    assert set(v) == {"nested levels", "m/d/tekken.json", "w/a/gpt2.tiktoken"}
    assert v["m/d/tekken.json"]["lo"] == 32768 and v["m/d/tekken.json"]["hi"] == 131072
    assert v["m/d/tekken.json"]["cut"] == pytest.approx(1 - 3.2 / 3.7)
    assert v["m/d/tekken.json"]["paper"] == pytest.approx(1 - 0.8 ** (2 / 3))  # 2 of 3 doublings
    assert [p["vocab"] for p in quality.families_at(comp)] == [32768, 32768, 32000, 32768]
    reading = "\n".join(quality.compression_reading(comp))
    assert "13.5% fewer tokens from 32768 to 131072" in reading
    assert "m/d/sp.model.v2: the same counts as m/d/sp.model.v1" in reading
    assert "3.000 (w/a/gpt2.tiktoken cut to 32768) to 4.000 (nested 32768)" in reading
    # the claim table keeps spans of a doubling or more: gpt2's 32768 -> 50256 is left out
    rows = [r for r in quality.claim_rows(*_no_training_parts(), comp) if "sequence length" in r]
    assert len(rows) == 2 and not any("gpt2" in r for r in rows)
    assert "agrees" in next(r for r in rows if "tekken" in r)


def _no_training_parts():
    """claim_rows' arguments before the compression ones, for a study with no runs."""
    import argparse

    a = argparse.Namespace(scales=["tiny"], corpora=["builtin-prose"], prune_from=16384,
                           prune_to=2048)  # fmt: skip
    return a, [], (0.0, -1.0, 1.0), [], {"nested": 0.4, "separate": 0.3}, []
