import json

import pytest

from shardscope.cli import main
from shardscope.core.params import count_parameters
from shardscope.presets import model_preset


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_human_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--model", "llama-3-8b", "--gpus", "8")
    assert code == 0
    for word in ("ddp", "zero1", "zero2", "zero3", "optimizer state", "activations", "peak", "fits", "assumptions"):
        assert word in out
    assert "GiB" in out


def test_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--model", "llama-3-70b", "--gpus", "64", "--strategy", "all", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "shardscope.estimate/v1"
    assert data["model"]["parameters"] == count_parameters(model_preset("llama-3-70b"))
    assert [s["strategy"] for s in data["strategies"]] == ["ddp", "zero1", "zero2", "zero3", "hsdp"]
    keys = {
        "parameters_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
        "buffers_bytes",
        "temporary_bytes",
        "overhead_bytes",
        "total_bytes",
        "peak_bytes",
        "reserved_peak_bytes",
    }
    for entry in data["strategies"]:
        assert keys == set(entry["per_rank"])
        # the caching allocator holds every allocated byte; the context is in peak_bytes, not in the reserved peak
        per_rank = entry["per_rank"]
        assert per_rank["reserved_peak_bytes"] >= per_rank["peak_bytes"] - per_rank["overhead_bytes"]
        assert entry["fits"] is (per_rank["reserved_peak_bytes"] + per_rank["overhead_bytes"] <= 80 * 2**30)
        assert all(isinstance(value, int) for value in entry["per_rank"].values())
        assert {"strategy", "engine", "world_size", "parameters", "host_bytes", "fits"} <= set(entry)


@pytest.mark.parametrize("params", ["7.5B", "70e9", "6738415616"])
def test_params_forms(capsys: pytest.CaptureFixture[str], params: str) -> None:
    code, out, _ = run(capsys, "estimate", "--params", params, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["strategies"][0]["activations_estimated"] is False
    assert data["strategies"][0]["per_rank"]["activations_bytes"] == 0


def test_units_gb(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--params", "7.5B", "--units", "GB", "--engine", "paper")
    assert code == 0 and " GB" in out and "GiB" not in out


def test_gpu_memory_and_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "estimate",
        "--model",
        "llama-3-70b",
        "--gpus",
        "8",
        "--gpu-memory",
        "24GiB",
        "--strategy",
        "ddp",
        "--json",
    )
    assert code == 0
    assert json.loads(out)["strategies"][0]["fits"] is False


BAD = [
    (["--model", "gpt2", "--seq-len", "1024", "--gpus", "0"], "--gpus"),
    (["--model", "gpt2", "--seq-len", "1024", "--gpus", "-2"], "--gpus"),
    (["--model", "gpt2", "--seq-len", "1024", "--gpus", "2.5"], "--gpus"),
    (["--model", "gpt2", "--seq-len", "1024", "--gpus", "12", "--gpus-per-node", "8"], "multiple of gpus_per_node"),
    (
        ["--model", "gpt2", "--seq-len", "1024", "--strategy", "hsdp", "--shard-group", "3"],
        "dp_replicate 2 x dp_shard 3 = 6, not the 8 GPUs given",
    ),
    (["--model", "nope"], "unknown model preset"),
    (["--model", "gpt2", "--seq-len", "1024", "--gpu", "nope"], "unknown GPU preset"),
    (["--model", "gpt2", "--seq-len", "1024", "--engine", "megatron"], "--engine"),
    (["--model", "gpt2", "--seq-len", "1024", "--strategy", "zero4"], "Strategy.name='zero4'"),
    (["--params", "1e30"], "outside"),
    (["--params", "lots"], "not a number"),
    (["--model", "gpt2", "--seq-len", "1024", "--seq-len", "0"], "--seq-len"),
    (["--config", "/no/such/config.json"], "does not exist"),
    (["--model", "gpt2", "--seq-len", "1024", "--gpu-memory", "0GiB"], "more than 0"),
    (["--model", "gpt2", "--seq-len", "1024", "--allocator-headroom", "3"], "allocator_headroom"),
]


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _out, err = run(capsys, "estimate", *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_bad_config_files(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path))
    cases = {
        "truncated.json": '{"model_type": "llama", "hidden_',
        "bert.json": '{"model_type": "bert"}',
        "list.json": "[1, 2]",
    }
    for name, text in cases.items():
        (folder / name).write_text(text)
        code, _, err = run(capsys, "estimate", "--config", str(folder / name))
        assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--help"]) == 0
    assert "examples:" in capsys.readouterr().out
