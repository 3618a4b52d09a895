"""bench/peers.py refuses a run it cannot do before loading or compiling anything."""

from __future__ import annotations

import sys

import pytest

from tests.bench.loader import bench_script


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "adaflash-ar", "llamacpp-bf16"], "llamacpp-bf16 needs --gguf-bf16"),
        (["--engines", "llamacpp-q4_1"], "llamacpp-q4_1 needs --gguf-q4"),
        (["--gguf-bf16", "no/such.gguf"], "--gguf-bf16: no such file"),
        (["--engines", "vllm"], "unknown engine(s) ['vllm']"),
    ],
)
def test_a_peer_asked_for_without_its_file_is_an_error_not_a_silent_skip(
    argv, message, monkeypatch, capsys
):
    with bench_script("peers") as peers:
        monkeypatch.setattr(sys, "argv", ["peers.py", "--out", "unused.json", *argv])
        with pytest.raises(SystemExit) as exit_:
            peers.main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_paired_ratios_divide_round_by_round_and_skip_what_is_missing():
    rows = [
        {"engine": "adaflash-ar", "batch": 1, "tok_s_rounds": [30.0, 20.0, 33.0]},
        {"engine": "llamacpp-bf16", "batch": 1, "tok_s_rounds": [20.0, 25.0, 30.0]},
        {"engine": "hf", "batch": 1, "tok_s_rounds": [1.0, 1.0, 1.0]},  # not a peer row
        {"engine": "llamacpp-q4_1", "batch": 8, "tok_s_rounds": [10.0, 10.0, 10.0]},  # no ar
    ]
    with bench_script("peers") as peers:
        lines = peers.paired_ratios(rows, [1, 8])
    assert lines == [
        "\nbatch 1: adaflash-ar ÷ llamacpp-bf16 per round 1.50, 0.80, 1.10 (median 1.10×)"
    ]
