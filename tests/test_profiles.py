"""Device profiles, shapes, compression curves, sizes: loading and validation."""

import json

import pytest

from vocabjax.compression import DEFAULT_CURVE, load_compression
from vocabjax.errors import UserError
from vocabjax.hardware import BUILTIN_DEVICES, DeviceProfile, load_device, save_device
from vocabjax.outputs import atomic_directory, atomic_write_json
from vocabjax.shapes import BUILTIN_SHAPES, load_shape
from vocabjax.trainprofile import load_training
from vocabjax.units import parse_float_list, parse_size, parse_size_list


def test_paper_ridge_points():
    assert load_device("a10g").ridge_point() == pytest.approx(117, abs=1)
    assert load_device("a100-paper").ridge_point() == pytest.approx(183, abs=0.5)
    for p in BUILTIN_DEVICES.values():
        assert p.source


def test_profile_round_trip(tmp_path):
    for p in BUILTIN_DEVICES.values():
        path = save_device(p, tmp_path / f"{p.name}.json")
        assert load_device(path) == p
        data = json.loads(path.read_text())
        assert set(data["ceilings"]) == {
            "hbm_bandwidth",
            "peak_flops",
            "ridge_point",
            "launch_overhead_s",
            "dispatch_overhead_s",
        }


def _write(tmp_path, obj, name="p.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ({"schema": 2, "kind": "device"}, "schema 2 is not supported"),
        ({"schema": 1, "kind": "compression"}, "expected a 'device' profile"),
        (
            {"schema": 1, "kind": "device", "name": "x"},
            "missing field\\(s\\) ceilings, memory_bytes",
        ),
        (
            {
                "schema": 1,
                "kind": "device",
                "name": "x",
                "memory_bytes": 1e9,
                "ceilings": {
                    "hbm_bandwidth": 1e9,
                    "peak_flops": {"bf16": -1},
                    "launch_overhead_s": 0,
                },
            },
            "peak_flops.bf16 must be > 0",
        ),
        (
            {
                "schema": 1,
                "kind": "device",
                "name": "x",
                "memory_bytes": 1e9,
                "ceilings": {"hbm_bandwidth": 1e9, "peak_flops": 1e12, "launch_overhead_s": 0},
                "best": [{"op": "greedy"}],
            },
            "best\\[0\\]: missing field",
        ),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_device_profiles(tmp_path, content, message):
    with pytest.raises(UserError, match=message):
        load_device(_write(tmp_path, content))


def test_missing_and_unknown_devices(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_device(tmp_path / "nope.json")
    with pytest.raises(UserError, match="unknown device 'tpu9'"):
        load_device("tpu9")


def test_a_single_peak_number_is_accepted(tmp_path):
    p = load_device(
        _write(
            tmp_path,
            {
                "schema": 1,
                "kind": "device",
                "name": "cpu",
                "memory_bytes": 1e9,
                "ceilings": {"hbm_bandwidth": 1e10, "peak_flops": 1e11, "launch_overhead_s": 1e-6},
            },
        )
    )
    assert isinstance(p, DeviceProfile) and p.ridge_point() == pytest.approx(10)


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    path = tmp_path / "p.json"
    atomic_write_json(path, {"schema": 1, "kind": "device", "x": 1})
    with pytest.raises(UserError, match="non-finite"):
        atomic_write_json(path, {"schema": 1, "kind": "device", "x": float("nan")})
    assert json.loads(path.read_text())["x"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_atomic_directory_removes_partial_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_directory(out) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(out) as tmp:
        (tmp / "done").write_text("x")
    assert [p.name for p in out.iterdir()] == ["done"]


def test_shapes_from_files(tmp_path):
    (tmp_path / "m.toml").write_text(
        "d_model = 512\nn_layers = 4\nn_heads = 8\nd_ff = 2048\nglu = true\n"
    )
    m = load_shape(tmp_path / "m.toml")
    assert (
        m.name == "m"
        and m.n_kv_heads == 8
        and m.n_nonembedding == 4 * (4 * 512 * 512 + 3 * 512 * 2048)
    )
    (tmp_path / "g.json").write_text(
        json.dumps({**BUILTIN_SHAPES["llama-8b"].to_json(), "name": "g"})
    )
    assert (
        load_shape(tmp_path / "g.json").n_nonembedding == BUILTIN_SHAPES["llama-8b"].n_nonembedding
    )
    (tmp_path / "bad.toml").write_text("d_model = \n")
    with pytest.raises(UserError, match="does not parse"):
        load_shape(tmp_path / "bad.toml")
    (tmp_path / "odd.json").write_text(
        json.dumps({"d_model": 100, "n_layers": 2, "n_heads": 3, "d_ff": 4})
    )
    with pytest.raises(UserError, match="not divisible by n_heads=3"):
        load_shape(tmp_path / "odd.json")
    (tmp_path / "extra.json").write_text(
        json.dumps({"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 4, "x": 1})
    )
    with pytest.raises(UserError, match="unknown field\\(s\\) x"):
        load_shape(tmp_path / "extra.json")
    with pytest.raises(UserError, match="unknown model 'gpt5'"):
        load_shape("gpt5")


def test_llama_presets_match_published_sizes():
    # total parameters with untied heads: Llama 3.1 8B has 8.03B, 70B 70.6B
    assert BUILTIN_SHAPES["llama-8b"].n_params(128256) == pytest.approx(8.03e9, rel=0.005)
    assert BUILTIN_SHAPES["llama-70b"].n_params(128256) == pytest.approx(70.55e9, rel=0.005)
    assert BUILTIN_SHAPES["llama-1b"].n_params(128256, tied=True) == pytest.approx(
        1.236e9, rel=0.005
    )


def test_compression_curve(tmp_path):
    assert load_compression("default") is DEFAULT_CURVE
    assert DEFAULT_CURVE.beta(32768.0) == pytest.approx(3.94, rel=1e-6)
    path = _write(
        tmp_path,
        {
            "schema": 1,
            "kind": "compression",
            "corpus": "c",
            "points": [
                {"vocab": 1000, "bytes_per_token": 3.0},
                {"vocab": 100, "bytes_per_token": 2.0},
            ],
        },
    )
    c = load_compression(path)
    assert c.vocab == (100, 1000) and float(c.beta(316.2278)) == pytest.approx(2.5, rel=1e-4)
    bad = _write(
        tmp_path,
        {
            "schema": 1,
            "kind": "compression",
            "points": [
                {"vocab": 100, "bytes_per_token": 3.0},
                {"vocab": 1000, "bytes_per_token": 2.0},
            ],
        },
        "bad.json",
    )
    with pytest.raises(UserError, match="bytes per token falls from V=100 to V=1000"):
        load_compression(bad)


def test_training_profile(tmp_path):
    path = _write(
        tmp_path,
        {
            "schema": 1,
            "kind": "training",
            "points": [
                {"vocab": 8192, "tokens_per_s": 1000.0, "bpb": 1.1},
                {"vocab": 32768, "tokens_per_s": 500.0, "bpb": 1.0},
            ],
        },
    )
    t = load_training(path)
    assert float(t.seconds_per_token(8192.0)) == pytest.approx(1e-3, rel=1e-5)
    assert float(t.seconds_per_token(16384.0)) == pytest.approx(1 / (1000 * 0.5**0.5), rel=1e-4)
    bad = _write(
        tmp_path,
        {
            "schema": 1,
            "kind": "training",
            "points": [
                {"vocab": 8192, "bpb": 1.1},
                {"vocab": 32768, "tokens_per_s": 5.0, "bpb": 1.0},
            ],
        },
        "b.json",
    )
    with pytest.raises(UserError, match="tokens_per_s is missing at some points"):
        load_training(bad)


@pytest.mark.parametrize(
    "text, value",
    [
        ("8k", 8192),
        ("65536", 65536),
        ("65k", 65536),
        ("262k", 262144),
        ("1m", 1048576),
        ("50257", 50257),
        ("100k", 102400),
        ("32K", 32768),
        ("1.5k", 1536),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["0", "-8k", "8x", "", "1.5", "k"])
def test_parse_size_rejects(text):
    with pytest.raises(UserError):
        parse_size(text)


def test_lists():
    assert parse_size_list("8k, 32k,8k") == [8192, 32768]
    assert parse_float_list("0,1,1e3", what="lam") == [0.0, 1.0, 1000.0]
    for bad in ("nan", "inf", "-1", ""):
        with pytest.raises(UserError):
            parse_float_list(bad, what="lam")
