"""Building and loading the kernels: a stale build lock never hangs a start."""

import subprocess
import sys
import time

from adaflash.models import gemv


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_one(tmp_path):
    """torch waits on its build folder's ``lock`` file for good; one left by a process killed
    while it loaded the kernel hung every later start. Under the folder's OS lock (let go of
    when its holder dies) such a file is stale and goes; another process that holds the OS lock
    keeps this one waiting."""
    (tmp_path / "lock").write_text("")  # what the killed process left
    with gemv.builder(tmp_path):
        assert not (tmp_path / "lock").exists()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX);"
            " print('held', flush=True); time.sleep(1.5)",
            str(tmp_path / "adaflash.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    t0 = time.perf_counter()
    with gemv.builder(tmp_path):
        waited = time.perf_counter() - t0
    holder.wait()
    assert waited > 0.5  # it waited for the other process to let go
