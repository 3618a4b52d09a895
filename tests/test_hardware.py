"""The CPU description the kernel choices and result files rely on."""

from pathlib import Path

from adaflash import hardware


def test_cpu_info_names_the_model_and_only_flags_of_interest():
    info = hardware.cpu_info()
    assert isinstance(info["model"], str)
    assert set(info["flags"]) <= set(hardware.FLAGS_OF_INTEREST)
    if Path("/proc/cpuinfo").exists():
        text = Path("/proc/cpuinfo").read_text()
        assert ("avx2" in text.split()) == ("avx2" in info["flags"])
        if "cpu family" in text:  # the generation, where the model name alone may not tell it
            assert isinstance(info["family"], int) and isinstance(info["model_number"], int)


def test_native_bf16_follows_the_flags(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not hardware.native_bf16()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert hardware.native_bf16()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: None)  # no /proc/cpuinfo: assume native
    assert hardware.native_bf16()
