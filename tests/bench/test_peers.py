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
