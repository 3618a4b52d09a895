"""The threaded runner: async streaming of text deltas, stop strings, cancellation."""

import asyncio

import pytest

from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.detokenize import TextStreamer, find_stop, safe_prefix_len
from adaflash.engine.engine import Engine
from adaflash.engine.runner import EngineRunner
from adaflash.tokenizer import Tokenizer
from tests.engine.conftest import random_drafter
from tests.tiny import add_tokenizer


@pytest.fixture
def runner(tiny):
    folder, target, _ = tiny
    tok = Tokenizer.from_folder(add_tokenizer(folder))
    engine = Engine(
        target, random_drafter(target), EngineConfig(policy="head"), detokenize=tok.decode
    )
    r = EngineRunner(engine)
    r.start()
    yield r, tok
    r.stop()


async def collect(runner, prompt, params):
    return [d async for d in runner.stream(prompt, params)]


def test_stream_equals_batch_generation(runner):
    r, tok = runner
    prompt = tok.encode("Tell me a story.")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    deltas = asyncio.run(collect(r, prompt, params))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    ids = [t for d in deltas for t in d.token_ids]
    assert len(ids) == 24
    assert "".join(d.text for d in deltas) == tok.decode(ids)


def test_sixteen_concurrent_streams(runner):
    r, tok = runner
    prompts = [tok.encode(f"Question {i}: why?") for i in range(16)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(r, p, params) for p in prompts))

    outs = asyncio.run(main())
    engine = Engine(r.engine.target, None, EngineConfig(policy="ar"))
    want = engine.generate(prompts, params)
    for deltas, ref in zip(outs, want, strict=True):
        assert tuple(t for d in deltas for t in d.token_ids) == ref.output_ids


def test_stop_string_cuts_text(runner):
    r, tok = runner
    prompt = tok.encode("abc")
    free = asyncio.run(collect(r, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True)))
    text = "".join(d.text for d in free)
    stop = text[8:10]
    deltas = asyncio.run(
        collect(r, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)))
    )
    got = "".join(d.text for d in deltas)
    assert got == text[: text.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_cancelled_stream_aborts_request(runner):
    r, tok = runner

    async def main():
        agen = r.stream(tok.encode("hello"), SamplingParams(max_new_tokens=400, ignore_eos=True))
        first = await agen.__anext__()
        await agen.aclose()
        return first

    asyncio.run(main())
    for _ in range(100):
        if not r.engine.has_work:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert not r.engine.running


def test_invalid_request_raises_value_error(runner):
    r, _ = runner
    with pytest.raises(ValueError, match="context window"):
        asyncio.run(collect(r, [5] * 10, SamplingParams(max_new_tokens=10_000)))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(collect(r, [], SamplingParams()))


def test_text_streamer_holds_back_possible_stop_prefix():
    chars = "hello world"
    s = TextStreamer(lambda ids: "".join(chars[i] for i in ids), stops=("wor",))
    assert s.push([0, 1, 2, 3, 4, 5]) == "hello "
    assert s.push([6]) == ""  # "w" may start "wor"
    assert s.push([7]) == ""
    assert s.push([8]) == ""  # "wor" found: stop, nothing after
    assert s.stopped and s.push([9], final=True) == ""
    assert find_stop("abcSTOP", ("STOP",)) == 3
    assert safe_prefix_len("abc\ufffd", ()) == 3
