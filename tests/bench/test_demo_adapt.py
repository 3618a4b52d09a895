"""bench/demo_adapt.py's pure parts: the bootstrap interval and the summary of the arms."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.loader import bench_script


@pytest.fixture(scope="module")
def adapt() -> Iterator[ModuleType]:
    with bench_script("demo_adapt") as module:
        yield module


def test_bootstrap_interval_holds_the_difference_and_separates_clear_cases(adapt):
    a = [[2.0, 2.1, 1.9, 2.0], [2.2, 1.8, 2.0, 2.0]]
    b = [[1.0, 1.1, 0.9, 1.0], [1.2, 0.8, 1.0, 1.0]]
    point, lo, hi = adapt.bootstrap(a, b)
    assert point == pytest.approx(1.0) and lo <= point <= hi and lo > 0.5
    same, lo, hi = adapt.bootstrap(a, a)
    assert same == 0.0 and lo < 0 < hi  # the same data: the interval straddles zero
    # one noisy repeat widens the interval: the repeat level is resampled too
    _, lo2, hi2 = adapt.bootstrap([[2.0] * 4, [4.0] * 4], b)
    assert hi2 - lo2 > hi - lo


def version(rnd, math, chat, code, tps=10.0, active=None):
    def cell(values, t=tps):
        return {"accept_len": sum(values) / len(values), "tokens_per_s": t, "per_prompt": values}

    return {
        "round": rnd,
        "version": active or f"v{rnd:04d}",
        "status": "active",
        "math/fixed": cell(math),
        "chat/fixed": cell(chat),
        "code/fixed": cell(code),
        "math/cost": cell(math),
        "math/ar": cell([1.0], 8.0),
        "math/cost@1": cell(math, 6.0),
        "math/ar@1": cell([1.0], 5.0),
        "math/head": cell([m + 0.1 for m in math]),
        "math/head-frozen": cell(math),
    }


def test_summary_reports_gain_forgetting_and_arm_difference(adapt):
    arms = [
        {
            "loss": loss,
            "repeat": r,
            "versions": [
                version(0, [1.0, 1.2], [1.5, 1.5], [1.4, 1.6]),
                version(1, [1.0 + gain, 1.2 + gain], [1.5, 1.4], [1.4, 1.6]),
            ],
        }
        for r in range(2)
        for loss, gain in (("opd", 0.6), ("osd", 0.3))
    ]
    s = adapt.summarize(arms)
    assert s["opd"]["repeats"] == 2 and s["opd"]["versions"] == 1
    assert s["opd"]["math_tau_change"][0] == pytest.approx(0.6 / 1.1, abs=1e-3)  # +55%
    assert s["osd"]["math_tau_change"][0] == pytest.approx(0.3 / 1.1, abs=1e-3)
    assert s["opd"]["chat_tau_change"][0] == pytest.approx(-0.05 / 1.5, abs=1e-3)
    assert s["opd"]["code_tau_change"][0] == pytest.approx(0.0)
    assert s["opd_minus_osd_math_tau"][0] == pytest.approx(0.3)
    assert s["opd"]["head_refit_minus_frozen_tau"][0] == pytest.approx(0.1)
    assert s["opd"]["math/cost_tokens_per_s"] == [[10.0, 10.0], [10.0, 10.0]]
    assert s["opd"]["math/cost_over_ar"] == [[1.25, 1.25], [1.25, 1.25]]  # 10 / 8
    assert s["opd"]["math/cost_over_ar@1"] == [[1.2, 1.2], [1.2, 1.2]]  # 6 / 5
    assert s["opd"]["promoted_worse_on_eval"] == [[], []]


def test_promoted_worse_names_only_promotions_that_measured_lower(adapt):
    versions = [
        version(0, [1.4, 1.5], [1.5], [1.5]),
        version(1, [1.6, 1.7], [1.5], [1.5]),  # promoted, better
        version(2, [1.3, 1.2], [1.5], [1.5]),  # promoted, worse than v0001
        version(3, [1.0, 1.0], [1.5], [1.5], active="v0002"),  # rejected: v0002 still serves
    ]
    worse = adapt.promoted_worse(versions)
    assert [w["round"] for w in worse] == [2]
    assert worse[0]["tau_diff"][0] == pytest.approx(-0.4)


def test_resume_keeps_finished_arms_of_the_same_settings_only(adapt, tmp_path):
    args = {k: 1 for k in adapt.RUN_ARGS}
    fresh = {"args": args, "arms": [], "date": "now", "machine": {"cpu": "b"}}
    path = tmp_path / "adapt.json"
    assert adapt.resumed(path, fresh) is fresh  # nothing to resume from
    arm = {"loss": "opd", "repeat": 0, "versions": [], "machine": {"cpu": "a"}}
    earlier = {**fresh, "arms": [arm], "date": "then", "machine": {"cpu": "a"}}
    path.write_text(json.dumps(earlier))
    got = adapt.resumed(path, fresh)  # its arms kept (each names its machine), this machine's
    assert got["arms"] == [arm] and got["date"] == "then" and got["machine"] == {"cpu": "b"}
    path.write_text(json.dumps({**earlier, "args": {**args, "chunk": 2}}))
    with pytest.raises(SystemExit, match="chunk"):
        adapt.resumed(path, fresh)


def test_a_run_needing_more_math_prompts_than_there_are_stops_before_loading_a_model(
    adapt, monkeypatch
):
    supply = len(adapt.load_prompts("math", "train"))
    monkeypatch.setattr(adapt, "load_target", lambda *a: pytest.fail("loaded a model"))
    argv = ["demo_adapt.py", "--versions", "2", "--chunk", str(supply // 2 + 1)]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit, match=f"needs {2 * (supply // 2 + 1)} math train prompts"):
        adapt.main()


def test_an_eval_pass_of_the_cost_policy_reports_its_probes_and_prices(adapt, tmp_path):
    """``run_policy`` on a tiny model, eager: τ per prompt, tokens/s, and for ``cost`` what it
    decided from (probes, their whole-block τ, the drafter's and plain steps' prices)."""
    from types import SimpleNamespace

    from adaflash.models.target import load_target
    from tests.engine.conftest import random_drafter
    from tests.tiny import build_checkpoint

    target = load_target(build_checkpoint(tmp_path, "llama", seed=11, layers=6), "float32")
    args = SimpleNamespace(compile=False, max_new_tokens=12)
    tok = SimpleNamespace(eos_token_ids=())
    prompts = [[5, 6, 7], [10, 11, 12, 13]]
    drafter = random_drafter(target)
    cost = adapt.run_policy(target, drafter, "v0", "cost", prompts, tok, args, 2)
    assert len(cost["per_prompt"]) == 2 and cost["tokens_per_s"] > 0
    assert cost["probes"] >= 0 and "drafter_base_ms" in cost["cost_model_ms"]
    assert cost["probed_tau"] is None or cost["probed_tau"] >= 1.0
    plain = adapt.run_policy(target, None, "v0", "ar", prompts, tok, args, 1)
    assert plain["accept_len"] == 1.0 and "probes" not in plain
    # side by side (each timed on its own steps): the same figures, plain decoding's apart
    cost, plain = adapt.cost_against_ar(target, drafter, "v0", prompts, tok, args, 2)
    assert cost["tokens_per_s"] > 0 and plain["tokens_per_s"] > 0
    assert "drafter_base_ms" in cost["cost_model_ms"] and cost["accept_len"] >= 1.0
    assert plain["accept_len"] == 1.0 and "probes" not in plain


def test_the_relative_change_is_over_the_same_per_prompt_mean_it_resamples(adapt):
    first = version(0, [1.0, 2.0], [1.5], [1.5])
    first["math/fixed"]["accept_len"] = 1.2  # pooled over rounds: long prompts weigh more
    last = version(1, [1.3, 2.3], [1.5], [1.5])
    s = adapt.summarize([{"loss": "opd", "repeat": 0, "versions": [first, last]}])["opd"]
    assert s["math_tau_v0"] == 1.2
    assert s["math_tau_change"][0] == pytest.approx(0.3 / 1.5)  # not 0.3 / 1.2
