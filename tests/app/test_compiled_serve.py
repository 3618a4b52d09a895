"""``serve`` with its default compiled batch-1 step: it compiles in the background while the
eager step serves, /metrics shows it, and once ready it serves the target's greedy tokens."""

import re
import time

import httpx
import pytest

from tests.server import start_server, stop_server

pytestmark = pytest.mark.slow  # the compile takes minutes on two cores

PROMPT = [5, 6, 7, 8, 9]
NEW = 24


def compiled_metrics(url: str) -> tuple[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    status = re.search(r'adaflash_compiled_decode\{status="(\w+)"\} 1\.0', text)
    steps = re.search(r"adaflash_compiled_decode_steps_total ([0-9.e+]+)", text)
    assert status and steps, text
    return status.group(1), float(steps.group(1))


def greedy(folder, prompt: list[int], n: int) -> list[int]:
    from tests.engine.test_exactness import hf_greedy
    from tests.tiny import hf_model

    return hf_greedy(hf_model(folder), prompt, n)


@pytest.fixture(scope="module")
def compiling_server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # one batched graph and one verification width,
        mp.setenv("ADAFLASH_BATCH_GRAPHS", "4")  # not 4/8/16 each: minutes fewer
        mp.setenv("ADAFLASH_VERIFY_GRAPHS", "4")
        s = start_server(tmp_path_factory.mktemp("compiled"), compile=True)
    yield s
    if s.proc.poll() is None:
        stop_server(s)


def test_serve_compiles_in_the_background_and_serves_exact_tokens(compiling_server):
    url = compiling_server.url
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
    early = httpx.post(url + "/generate", json=body, timeout=120).json()  # served meanwhile
    deadline = time.time() + 600
    while compiled_metrics(url)[0] != "ready":
        assert time.time() < deadline, "the decode steps did not compile in 10 minutes"
        assert compiled_metrics(url)[0] != "failed", compiling_server.log.read_text()[-2000:]
        time.sleep(1)
    _, before = compiled_metrics(url)
    late = httpx.post(url + "/generate", json=body, timeout=120).json()
    _, after = compiled_metrics(url)
    expected = greedy(compiling_server.target, PROMPT, NEW)
    assert early["output_ids"] == expected
    assert late["output_ids"] == expected
    assert after > before  # the compiled step ran some of them (plain steps of the cost policy)
