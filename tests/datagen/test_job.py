"""The drafter-data job on a tiny random target: stages, sealing, resume, de-duplication.

A random model writes no real requests, so these tests admit every finished or unfinished user
turn (``AnyText``): their point is the job's bookkeeping, which the filter does not change."""

import gzip
import json
from dataclasses import dataclass

import pytest

from adaflash.config import EngineConfig
from adaflash.datagen.card import write_card
from adaflash.datagen.job import DataJob, DataJobConfig, read_shards, shard_paths
from adaflash.datagen.prompts import RequestFilter, normalize
from adaflash.engine.engine import Engine
from adaflash.models.target import load_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts
from tests.tiny import add_tokenizer, build_checkpoint

STOPS = tuple(range(2, 96, 8))  # frequent enough that a random model ends many turns


@dataclass(frozen=True)
class AnyText(RequestFilter):
    def reason(self, text: str, finish_reason: str, request: bool = True) -> str | None:
        return None if text.strip() else "too_short"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return add_tokenizer(build_checkpoint(tmp_path_factory.mktemp("dd") / "t", "llama", seed=5))


def make_job(target_dir, cfg, fail_after=None):
    tok = Tokenizer.from_folder(target_dir)
    engine = Engine(
        load_target(target_dir),
        None,
        EngineConfig(policy="ar", dtype="float32", max_running_requests=8),
        detokenize=tok.decode,
        eos_token_ids=STOPS,
    )
    if fail_after is not None:
        step, calls = engine.step, [0]

        def dying_step():
            calls[0] += 1
            if calls[0] > fail_after:
                raise KeyboardInterrupt("killed")
            return step()

        engine.step = dying_step
    job = DataJob(cfg, engine, tok, log=lambda m: None)
    job.turn_end = STOPS
    return job


def config(tmp_path, name):
    return DataJobConfig(
        out=tmp_path / name / "out",
        work=tmp_path / name / "work",
        shards=2,
        prompts_per_shard=8,
        mix=(("magpie:general", 0.5), ("magpie:casual", 0.25), ("stdlib", 0.25)),
        second_turns=1.0,
        max_prompt_tokens=12,
        max_new_tokens=16,
        filter=AnyText(),
    )


def rows(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def test_job_seals_shards_with_cards_and_distinct_prompts(target_dir, tmp_path):
    cfg = config(tmp_path, "a")
    made = make_job(target_dir, cfg).run()
    assert [p.name for p in made] == ["shard-00-00000.jsonl.gz", "shard-00-00001.jsonl.gz"]
    assert not list(cfg.work.iterdir())  # stage files removed once sealed
    prompts = []
    for path in made:
        shard, card = rows(path), json.loads(path.with_name(path.name[:-9] + ".json").read_text())
        assert card["sequences"] == len(shard) > 0
        assert card["response_tokens"] == sum(len(r["response_ids"]) for r in shard)
        assert sum(card["by_source"].values()) == len(shard)
        firsts = [r for r in shard if r["turns"] == 1]
        assert {r["source"] for r in firsts} <= {"magpie:general", "magpie:casual", "stdlib"}
        assert all(r["id"].removesuffix("+t2") in {f["id"] for f in firsts} for r in shard)
        for r in shard:
            assert r["domain"] == ("code" if r["source"] == "stdlib" else "chat")
            assert 0 < len(r["response_ids"]) <= cfg.max_new_tokens
        prompts += [normalize(r["prompt"]) for r in shard]
    assert len(prompts) == len(set(prompts))  # no prompt twice, within or across shards
    assert any(r["turns"] == 2 for p in made for r in rows(p))
    trajectories = read_shards(shard_paths(cfg.out))
    assert len(trajectories) == len(prompts)
    assert make_job(target_dir, cfg).run() == []  # done shards are not made again
    card = write_card(cfg.out).read_text()
    assert f"2 shards, **{len(prompts):,} sequences**" in card and "magpie:casual/t1" in card


def test_a_killed_job_resumes_to_the_same_shard(target_dir, tmp_path):
    whole = make_job(target_dir, config(tmp_path, "whole")).shard(0)
    cfg = config(tmp_path, "killed")
    for fail_after in (3, 12, 40):  # killed while sampling, then while answering
        with pytest.raises(KeyboardInterrupt):
            make_job(target_dir, cfg, fail_after=fail_after).shard(0)
        assert not (cfg.out / "shard-00-00000.jsonl.gz").exists()
    assert list(cfg.work.iterdir())  # finished rows kept for the next run
    resumed = make_job(target_dir, cfg).shard(0)
    assert rows(resumed) == rows(whole)


def test_eval_prompts_are_never_training_prompts(target_dir, tmp_path):
    job = make_job(target_dir, config(tmp_path, "x"))
    for domain in ("chat", "code", "math"):
        assert job.seen.seen(load_prompts(domain, "eval")[0].prompt) == "exact"
    assert job.seen.seen(load_prompts("math", "train")[0].prompt) == "exact"


def test_config_refuses_bad_mixes():
    with pytest.raises(ValueError, match="unknown sources"):
        DataJobConfig(mix=(("magpie:poetry", 1.0),))
    with pytest.raises(ValueError, match="sum to 1"):
        DataJobConfig(mix=(("magpie:general", 0.5),))
    only = DataJobConfig().magpie_only()
    assert "stdlib" not in dict(only.mix) and abs(sum(dict(only.mix).values()) - 1) < 1e-9
    assert sum(DataJobConfig().quotas().values()) == DataJobConfig().prompts_per_shard
