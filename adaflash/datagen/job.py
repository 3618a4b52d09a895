"""The drafter-data job: shards of self-written prompts and the target's greedy answers.

One shard, each stage resumable from its own file under ``work``:

1. **prompts** — user turns sampled from Magpie prefixes (one per steering system prompt in the
   shard's mix), filtered (``RequestFilter``) and de-duplicated against every earlier shard, the
   eval and held-out prompts (``Deduplicator``); plus standard-library tasks, a seeded slice of
   ``stdlib_pool``.
2. **answers** — the target's greedy answers under its default system prompt, continuous-batched,
   one line appended per finished request.
3. **second turns** — for a share of the Magpie answers that ended on EOS, the next user turn is
   sampled after the conversation so far, filtered, and answered like stage 2.
4. **seal** — ``shard-NNNNN.jsonl.gz`` (written whole, then renamed) and its ``.json`` card
   (counts, refusals by reason, duplicates, tokens, seconds); the stage files are removed.

Seeds are per shard and per row (``seed`` namespace, shard, row), so a shard stage re-run after a
kill samples the same candidates; bf16 near-ties may still differ between machines, which is why
each finished stage is kept as a file rather than recomputed.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from adaflash.config import SamplingParams
from adaflash.datagen.prompts import (
    SMALL_TALK,
    STEERS,
    Deduplicator,
    RequestFilter,
    stdlib_variants,
)
from adaflash.engine.engine import Engine
from adaflash.engine.records import RequestRecord
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import DOMAINS, WORKLOADS_DIR, Trajectory, load_prompts

SHARD_GLOB = "shard-*.jsonl.gz"
CODE_SOURCES = ("stdlib", "magpie:code")


@dataclass(frozen=True)
class DataJobConfig:
    """What one run of the job makes (defaults: the training set's namespace)."""

    out: Path = Path("assets/drafter_data")  # sealed shards (committed)
    work: Path = Path("data/drafter_data_work")  # stage files of unfinished shards
    seed: int = 0  # namespace: training shards 0; held-out sets use another
    shards: int = 100  # shard indices [first_shard, shards) of this namespace
    first_shard: int = 0
    prompts_per_shard: int = 512  # first-turn prompts a shard answers
    mix: tuple[tuple[str, float], ...] = (
        ("magpie:general", 0.36),
        ("magpie:code", 0.12),
        ("magpie:writing", 0.07),
        ("magpie:knowledge", 0.09),
        ("magpie:casual", 0.08),
        ("stdlib", 0.28),
    )
    second_turns: float = 0.3  # share of EOS-ended Magpie answers given a second user turn
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    max_prompt_tokens: int = 96
    oversample: float = 1.6  # candidates sampled per wanted Magpie prompt (refusals, duplicates)
    max_new_tokens: int = 256
    filter: RequestFilter = field(default_factory=RequestFilter)

    def __post_init__(self) -> None:
        unknown = [s for s, _ in self.mix if s != "stdlib" and s.split(":", 1)[-1] not in STEERS]
        if unknown:
            raise ValueError(
                f"unknown sources {unknown}: use stdlib or magpie:<{'|'.join(STEERS)}>"
            )
        if abs(sum(w for _, w in self.mix) - 1.0) > 1e-6:
            raise ValueError("the mix's shares must sum to 1")
        if not 0 <= self.first_shard < self.shards:
            raise ValueError("first_shard must be below shards")

    def magpie_only(self) -> DataJobConfig:
        """The same mix without standard-library tasks (the Magpie shares rescaled)."""
        kept = [(s, w) for s, w in self.mix if s != "stdlib"]
        total = sum(w for _, w in kept)
        return replace(self, mix=tuple((s, w / total) for s, w in kept))

    def shard_name(self, index: int) -> str:
        return f"shard-{self.seed:02d}-{index:05d}"

    def quotas(self) -> dict[str, int]:
        """First-turn prompts per source in one shard (the remainder to the largest source)."""
        q = {s: int(w * self.prompts_per_shard) for s, w in self.mix}
        q[max(self.mix, key=lambda x: x[1])[0]] += self.prompts_per_shard - sum(q.values())
        return q


def domain_of(source: str) -> str:
    return "code" if source in CODE_SOURCES else "chat"


def read_rows(paths: list[Path]) -> Iterator[dict]:
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def shard_paths(folder: Path, seed: int | None = None) -> list[Path]:
    pattern = SHARD_GLOB if seed is None else f"shard-{seed:02d}-*.jsonl.gz"
    return sorted(folder.glob(pattern))


def read_shards(paths: list[Path]) -> list[Trajectory]:
    """Shard rows as trajectories (``response`` left empty: the ids are the data)."""
    return [
        Trajectory(r["id"], r["domain"], r["prompt_ids"], r["response_ids"], "", r["finish_reason"])
        for r in read_rows(paths)
    ]


def stdlib_pool(seed: int = 0) -> list[tuple[str, str]]:
    """(source id, prompt) of every standard-library task: the shipped code-train prompts and
    their further tasks (``stdlib_variants``), in one seeded order; shard i takes its slice."""
    pool = []
    for p in load_prompts("code", "train"):
        pool.append((p.source or p.id, p.prompt))
        pool += [(f"{p.source or p.id}#{tag}", text) for tag, text in stdlib_variants(p.prompt)]
    random.Random(seed).shuffle(pool)
    return pool


def excluded_prompts() -> list[str]:
    """Prompts training must never contain: every eval prompt and the adaptation demo's math
    train prompts (its domain must stay new to the shipped drafter)."""
    texts = [p.prompt for d in DOMAINS for p in load_prompts(d, "eval")]
    return texts + [p.prompt for p in load_prompts("math", "train", folder=WORKLOADS_DIR)]


class StageFile:
    """A JSONL file of finished rows keyed by ``id``: appended as rows finish, read on resume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, dict] = {}
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut by a kill: its request runs again
                    continue
                self.rows[row["id"]] = row

    def append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.rows[row["id"]] = row


class DataJob:
    """Runs shards of one namespace on an engine (plain decoding, continuous batching)."""

    def __init__(
        self,
        cfg: DataJobConfig,
        engine: Engine,
        tok: Tokenizer,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.engine, self.tok, self.log = cfg, engine, tok, log
        self.turn_end = tok.turn_end_ids
        self.seen = Deduplicator()
        self.seen.add_all(excluded_prompts())
        self.seen.add_all(r["prompt"] for r in read_rows(shard_paths(cfg.out)))
        self.pool = stdlib_pool()
        self.refused_requests: dict[str, str] = {}  # id → why the engine refused it

    # -- stages --------------------------------------------------------------------------

    def _run(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        sink: StageFile,
        make_row: Callable[[str, RequestRecord], dict],
    ) -> None:
        """Run requests not yet in ``sink`` to completion, appending a row per finished one."""
        todo = [r for r in requests if r[0] not in sink.rows]
        for rid, ids, params in todo:
            try:
                self.engine.add_request(
                    ids,
                    params,
                    request_id=rid,
                    on_finish=lambda rec: sink.append(make_row(rec.request_id, rec)),
                )
            except ValueError as exc:  # e.g. longer than the context window: left out
                self.refused_requests[rid] = str(exc)
        t0, n0, last = time.perf_counter(), self.engine.stats.output_tokens, time.perf_counter()
        while self.engine.has_work:
            self.engine.step()
            if time.perf_counter() - last > 60:
                last = time.perf_counter()
                n = self.engine.stats.output_tokens - n0
                self.log(
                    f"  {sink.path.name}: {len(sink.rows)}/{len(requests)} rows, "
                    f"{n / (last - t0):.0f} tok/s"
                )

    def _sample_turns(self, name: str, prefixes: list[tuple[str, list[int]]]) -> StageFile:
        """Sample one user turn after each prefix (seeded per id) into the stage file ``name``."""
        cfg = self.cfg
        stage = StageFile(cfg.work / f"{name}.jsonl")

        def params(rid: str) -> SamplingParams:
            return SamplingParams(
                temperature=cfg.prompt_temperature,
                top_p=cfg.prompt_top_p,
                max_new_tokens=cfg.max_prompt_tokens,
                stop_token_ids=self.turn_end,
                seed=_seed(cfg.seed, rid),
            )

        def row(rid: str, rec: RequestRecord) -> dict:
            text = self.tok.decode(list(rec.output_ids)).strip()
            return {"id": rid, "text": text, "finish_reason": rec.finish_reason}

        self._run([(rid, ids, params(rid)) for rid, ids in prefixes], stage, row)
        return stage

    def _answer(self, stage: StageFile, items: list[dict]) -> None:
        greedy = SamplingParams(max_new_tokens=self.cfg.max_new_tokens)

        def row(rid: str, rec: RequestRecord) -> dict:
            item = by_id[rid]
            return {
                **item,
                "response_ids": list(rec.output_ids),
                "finish_reason": rec.finish_reason,
            }

        by_id = {it["id"]: it for it in items}
        self._run([(it["id"], it["prompt_ids"], greedy) for it in items], stage, row)

    def _accept(self, text: str, finish: str, source: str, refused: Counter) -> bool:
        request = source.split(":", 1)[-1] not in SMALL_TALK
        why = self.cfg.filter.reason(text, finish, request) or self.seen.seen(text)
        if why:
            refused[why] += 1
            return False
        self.seen.add(text)
        return True

    def _first_turns(self, index: int, sampled: Counter, refused: Counter) -> list[dict]:
        cfg = self.cfg
        name = cfg.shard_name(index)
        items: list[dict] = []
        for source, quota in cfg.quotas().items():
            if source == "stdlib":
                start = index * quota
                for k, (src, text) in enumerate(self.pool[start : start + quota]):
                    if self.seen.seen(text):
                        refused["stdlib_duplicate"] += 1
                        continue
                    self.seen.add(text)
                    items.append(
                        {
                            "id": f"{name}-{source}-{k:04d}",
                            "source": source,
                            "origin": src,
                            "prompt": text,
                        }
                    )
                continue
            steer = STEERS[source.split(":", 1)[1]]
            prefix = self.tok.user_turn_prefix(
                [{"role": "system", "content": steer}] if steer else []
            )
            n = int(quota * cfg.oversample) + 8
            cands = self._sample_turns(
                f"{name}.{source.replace(':', '-')}",
                [(f"{name}-{source}-{k:04d}", prefix) for k in range(n)],
            )
            kept = 0
            for rid in sorted(cands.rows):
                row = cands.rows[rid]
                if kept < quota and self._accept(
                    row["text"], row["finish_reason"], source, refused
                ):
                    items.append({"id": rid, "source": source, "prompt": row["text"]})
                    kept += 1
            sampled[source] += len(cands.rows)
        for it in items:
            it.update(
                domain=domain_of(it["source"]),
                turns=1,
                prompt_ids=self.tok.chat([{"role": "user", "content": it["prompt"]}]),
            )
        return items

    def _second_turns(
        self, name: str, answered: list[dict], sampled: Counter, refused: Counter
    ) -> list[dict]:
        rng_share = self.cfg.second_turns
        firsts = [
            r
            for r in answered
            if r["source"].startswith("magpie")
            and r["turns"] == 1
            and r["finish_reason"] == "stop"
            and _unit(r["id"]) < rng_share
        ]
        convs = {
            r["id"] + "+t2": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": self.tok.decode(r["response_ids"]).strip()},
            ]
            for r in firsts
        }
        cands = self._sample_turns(
            f"{name}.turn2", [(rid, self.tok.user_turn_prefix(c)) for rid, c in convs.items()]
        )
        src = {r["id"] + "+t2": r for r in firsts}
        items = []
        for rid in sorted(cands.rows):
            row = cands.rows[rid]
            if not self._accept(row["text"], row["finish_reason"], src[rid]["source"], refused):
                continue
            conv = [*convs[rid], {"role": "user", "content": row["text"]}]
            items.append(
                {
                    "id": rid,
                    "source": src[rid]["source"],
                    "prompt": row["text"],
                    "domain": src[rid]["domain"],
                    "turns": 2,
                    "prompt_ids": self.tok.chat(conv),
                }
            )
        sampled["second_turn"] += len(cands.rows)
        return items

    # -- one shard -----------------------------------------------------------------------

    def shard(self, index: int) -> Path | None:
        """Make shard ``index`` (resuming its stages); its path, or None when it was done."""
        cfg = self.cfg
        name = cfg.shard_name(index)
        final = cfg.out / f"{name}.jsonl.gz"
        if final.is_file():
            return None
        t0, tok0 = time.perf_counter(), self.engine.stats.output_tokens
        sampled: Counter = Counter()  # candidate user turns sampled, by source
        refused: Counter = Counter()  # candidates dropped, by reason
        self.log(f"{name}: first-turn prompts")
        firsts = self._first_turns(index, sampled, refused)
        self.log(f"{name}: answering {len(firsts)} prompts")
        answers = StageFile(cfg.work / f"{name}.answers.jsonl")
        self._answer(answers, firsts)
        answered = [answers.rows[it["id"]] for it in firsts if it["id"] in answers.rows]
        self.log(f"{name}: second turns")
        seconds = self._second_turns(name, answered, sampled, refused)
        self._answer(answers, seconds)
        rows = answered + [answers.rows[it["id"]] for it in seconds if it["id"] in answers.rows]
        refused["engine_refused"] += sum(
            r in self.refused_requests for r in (it["id"] for it in firsts + seconds)
        )
        card = {
            "shard": name,
            "sequences": len(rows),
            "by_source": dict(Counter(f"{r['source']}/t{r['turns']}" for r in rows)),
            "sampled": dict(sorted(sampled.items())),
            "refused": dict(sorted(refused.items())),
            "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
            "response_tokens": sum(len(r["response_ids"]) for r in rows),
            "stopped_on_eos": sum(r["finish_reason"] == "stop" for r in rows),
            "generated_tokens": self.engine.stats.output_tokens - tok0,
            "seconds": round(time.perf_counter() - t0, 1),
            "config": {k: v for k, v in asdict(cfg).items() if k not in ("out", "work")},
        }
        _write_atomic(
            final,
            gzip.compress(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode(), 9
            ),
        )
        _write_atomic(final.with_name(f"{name}.json"), (json.dumps(card, indent=1) + "\n").encode())
        for stage in cfg.work.glob(f"{name}.*"):
            stage.unlink()
        self.log(
            f"{name}: {len(rows)} sequences, {card['response_tokens']} response tokens, "
            f"{card['seconds']:.0f} s"
        )
        return final

    def run(self) -> list[Path]:
        made = []
        for index in range(self.cfg.first_shard, self.cfg.shards):
            path = self.shard(index)
            if path is not None:
                made.append(path)
        return made


def _seed(namespace: int, rid: str) -> int:
    return namespace * 1_000_003 + zlib.crc32(rid.encode())


def _unit(rid: str) -> float:
    """A fixed number in [0, 1) per id (which answers get a second turn)."""
    return zlib.crc32(("turn2:" + rid).encode()) / 2**32


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
