"""``bench/compare.py`` with each engine's steps under a cProfile of its own.

    python bench/profile_study.py --study policies --threads 2 --prompts 8 --max-new-tokens 128 \
        --repeats 2 --no-hf --ignore-eos --criteria-only --domains math --concurrency 16 \
        --out /tmp/profile-study

runs the study as ``compare.py`` would (same arguments, same process, same lockstep) and then
prints, per (drafter, method), the functions that took the most time inside that engine's steps
(``PROFILE_TOP`` of them, from the environment; 30). Where a method's time goes in the
study's own process, which a smaller probe may not show: the 2026-12-05 profile of math C = 16
found ~7% of every engine's time in ``torch.zeros`` of KV caches growing (README, the policy
study)."""

from __future__ import annotations

import cProfile
import os
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # bench/ is not a package: its directory on the path, as compare.py runs


def main() -> None:
    profiles: dict[compare.Key, cProfile.Profile] = {}

    def run_lockstep(engines, prompts, params):  # compare.run_lockstep, each step profiled
        done = {key: {} for key in engines}
        ids = {
            key: [e.add_request(p, params, on_finish=compare.finisher(done[key])) for p in prompts]
            for key, e in engines.items()
        }
        spent = dict.fromkeys(engines, 0.0)
        live = list(engines)
        order = random.Random(compare.LOCKSTEP_SEED)
        while live:
            for key in order.sample(live, len(live)):
                e, prof = engines[key], profiles.setdefault(key, cProfile.Profile())
                t0 = time.perf_counter()
                prof.enable()
                stepped = e.step()
                prof.disable()
                spent[key] += time.perf_counter() - t0
                if len(done[key]) == len(prompts) or not (stepped or e.has_work):
                    live.remove(key)
        return {
            key: compare.engine_result(e, prompts, [done[key][i] for i in ids[key]], spent[key])
            for key, e in engines.items()
        }

    compare.run_lockstep = run_lockstep
    compare.main()
    for key, prof in profiles.items():
        print(f"===== drafter {key[0]}, method {key[1]}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ.get("PROFILE_TOP", 30)))


if __name__ == "__main__":
    main()
