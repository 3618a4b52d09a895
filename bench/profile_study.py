"""``bench/compare.py`` with each engine's steps under a cProfile of its own.

    python bench/profile_study.py --study policies --threads 2 --prompts 8 --max-new-tokens 128 \
        --repeats 2 --no-hf --ignore-eos --criteria-only --domains math --concurrency 16 \
        --out /tmp/profile-study

runs the study as ``compare.py`` would (same arguments, same process, same lockstep) and then
prints, per (drafter, method), the functions that took the most time inside that engine's steps
(``PROFILE_TOP`` of them, from the environment; 30), sorted by ``PROFILE_SORT`` (``tottime``;
``cumulative`` shows where a method's time goes by caller). With ``PROFILE_DUMP`` set to a
folder, each profile is also saved there (``<drafter>-<method>.prof``, for ``pstats``).

Where a method's time goes in the study's own process, which a smaller probe may not show: the
2026-12-05 profile of math C = 16 found ~7% of every engine's time in ``torch.zeros`` of KV
caches growing (README, the policy study)."""

from __future__ import annotations

import cProfile
import functools
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # bench/ is not a package: its directory on the path, as compare.py runs


def main() -> None:
    profiles: dict[compare.Key, cProfile.Profile] = {}
    compare.run_lockstep = functools.partial(compare.run_lockstep, profiles=profiles)
    compare.main()
    dump = os.environ.get("PROFILE_DUMP")
    for key, prof in profiles.items():
        print(f"===== drafter {key[0]}, method {key[1]}")
        stats = pstats.Stats(prof).sort_stats(os.environ.get("PROFILE_SORT", "tottime"))
        stats.print_stats(int(os.environ.get("PROFILE_TOP", 30)))
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            prof.dump_stats(Path(dump) / f"{key[0]}-{key[1]}.prof")


if __name__ == "__main__":
    main()
