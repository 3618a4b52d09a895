"""The paper's Table 1 on this machine: speedup and τ per method, domain and concurrency.

Methods, measured on the same held-out prompts in one run (greedy, bf16, SmolLM2-135M target):

- ``ar``        plain autoregressive decoding through our runtime — the 1.0× reference
- ``hf``        Hugging Face ``generate`` on the same target (what a CPU user would otherwise run)
- ``hf-pld``    HF ``generate`` with prompt-lookup speculation (HF supports it at batch 1 only)
- ``dflash``    the shipped offline drafter, never updated, fixed k̂ = 16
- ``osd``       the drafter adapted online with the forward-KL (OSD) loss, fixed k̂ = 16
- ``adaflash``  the drafter adapted online with OPD + its online length head (``head`` policy)
- ``oracle``    the AdaFlash drafter with a length oracle that verifies exactly accepted + 1

Online adaptation: for each domain, ``--rounds`` rounds of on-policy training on that domain's
train prompts. At T = 0 the trajectories serving would log are the target's greedy outputs
whatever drafter served them (speculation is lossless), so they are generated once per domain
with plain decoding and fed to both online methods in the same chunks; the adaptation curve
(simulated τ on the eval trajectories after each round) is kept. Speed is a ratio to ``ar`` at
the same concurrency, measured in the same run. Results: JSON, a Markdown table and PNG charts.

    python bench/compare.py --quick                    # smoke check, < 10 min
    python bench/compare.py --out docs/results/compare # the full run (hours on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch

from adaflash.cli import DEFAULT_DRAFTER, encode_prompt
from adaflash.config import DistillConfig, EngineConfig, SamplingParams
from adaflash.distill import simulate_acceptance
from adaflash.engine.engine import Engine
from adaflash.engine.round import draft_tokens
from adaflash.metrics import speedup
from adaflash.models.drafter import DFlashDrafter, load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import Trajectory, load_prompts
from lightning_modules.train import fit

REPO = Path(__file__).resolve().parent.parent
SPEC_METHODS = ("dflash", "osd", "adaflash", "oracle")


class OracleLengthEngine(Engine):
    """k̂ = accepted + 1 exactly: the best any length policy can do (needs the answer key)."""

    def __init__(self, *args, references: dict[tuple[int, ...], list[int]], **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.references = references

    def _propose(self):  # type: ignore[no-untyped-def]
        def propose(reqs, states, k_hat):  # type: ignore[no-untyped-def]
            assert self.drafter is not None
            drafts = draft_tokens(self.target, self.drafter, states, int(k_hat.max()) - 1)
            k_hat = k_hat.clone()
            for i, (r, row) in enumerate(zip(reqs, drafts, strict=True)):
                ref = self.references.get(tuple(r.prompt_ids), [])[len(r.output_ids) :]
                n = 0
                while n < len(row) and n < len(ref) and row[n] == ref[n]:
                    n += 1
                k_hat[i] = min(n + 1, int(k_hat[i]))
            return drafts, k_hat

        return propose


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    t0 = time.perf_counter()
    recs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    c = engine.counters
    return {
        "tokens_per_s": engine.stats.output_tokens / wall,
        "accept_len": c.accept_len,
        "verify_len": c.verify_len,
        "output_tokens": engine.stats.output_tokens,
        "_outputs": {tuple(p): list(r.output_ids) for p, r in zip(prompts, recs, strict=True)},
    }


def run_hf(
    model,
    prompts: list[list[int]],
    concurrency: int,
    max_new: int,
    pad_id: int,
    eos: list[int],
    lookup: bool,
) -> dict:
    """HF generate, ``concurrency`` prompts per call (left padding)."""
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        group = prompts[i : i + concurrency]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        kw = {"prompt_lookup_num_tokens": 10} if lookup else {}
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=eos,
                **kw,
            )
        for row in out[:, width:].tolist():
            n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            tokens += n - (1 if row[n - 1] in eos else 0)
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "output_tokens": tokens}


def adapt(
    base: DFlashDrafter,
    target: TargetModel,
    train: list[Trajectory],
    evals: list[tuple[list[int], int]],
    loss: str,
    rounds: int,
    chunk: int,
    args: argparse.Namespace,
) -> tuple[DFlashDrafter, list[float]]:
    """``rounds`` online rounds (train on the next chunk, starting from the last version)."""
    drafter = copy.deepcopy(base).float()
    curve = [simulate_acceptance(drafter, target, evals, args.sim_anchors).accept_len]
    cfg = DistillConfig(loss=loss, epochs=args.epochs, anchors_per_seq=args.anchors)
    for r in range(rounds):
        part = train[r * chunk : (r + 1) * chunk]
        if not part:
            break
        drafter = fit(drafter, target, part, None, cfg, progress=False).drafter
        curve.append(simulate_acceptance(drafter, target, evals, args.sim_anchors).accept_len)
    return drafter, curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 10 min)")
    ap.add_argument("--drafter", default=str(REPO / "assets" / "drafters" / DEFAULT_DRAFTER))
    ap.add_argument("--target", default=None)
    ap.add_argument("--domains", nargs="+", default=["math", "code", "chat", "blend"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument(
        "--prompts",
        type=int,
        default=16,
        help="eval prompts per domain (at concurrency C > this, the first C prompts)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="online adaptation rounds")
    ap.add_argument("--chunk", type=int, default=64, help="train trajectories per round")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--sim-anchors", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--note", default="", help="free text stored with the results")
    ap.add_argument("--out", default="docs/results/compare")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.domains, args.concurrency = ["chat", "math"], [1, 4]
        args.prompts, args.max_new_tokens, args.rounds, args.chunk = 4, 48, 1, 8
        args.epochs, args.out = 1, args.out + "-quick"

    t_start = time.time()
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.dtype)
    tok = Tokenizer.from_folder(target_dir)
    eos = sorted(set(target.cfg.eos_token_ids) | set(tok.eos_token_ids))
    shipped = load_drafter(args.drafter, "float32")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, args.dtype))
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows, curves = [], {}
    for domain in args.domains:
        all_prompts = [
            encode_prompt(tok, p.prompt, chat=True)
            for p in load_prompts(domain, "eval", max([args.prompts, *args.concurrency]))
        ]
        prompts = all_prompts[: args.prompts]
        # the domain's on-policy data: greedy trajectories of its train prompts
        train_prompts = [
            encode_prompt(tok, p.prompt, chat=True)
            for p in load_prompts(domain, "train", args.rounds * args.chunk)
        ]
        gen = Engine(
            target,
            None,
            EngineConfig(policy="ar", max_running_requests=16),
            eos_token_ids=tuple(eos),
        )
        train = [
            Trajectory(f"{domain}-{i}", domain, p, list(r.output_ids), "", r.finish_reason)
            for i, (p, r) in enumerate(
                zip(train_prompts, gen.generate(train_prompts, params), strict=True)
            )
        ]
        ar_ref = run_engine(
            Engine(
                target,
                None,
                EngineConfig(policy="ar", max_running_requests=16),
                eos_token_ids=tuple(eos),
            ),
            all_prompts,
            params,
        )["_outputs"]
        evals = [(p + ar_ref[tuple(p)], len(p)) for p in prompts]
        drafters = {"dflash": shipped}
        for name, loss in (("osd", "osd"), ("adaflash", "opd")):
            drafters[name], curves[f"{domain}/{name}"] = adapt(
                shipped, target, train, evals, loss, args.rounds, args.chunk, args
            )
            print(
                f"[{domain}] {name} adaptation curve (simulated τ): "
                f"{[round(x, 3) for x in curves[f'{domain}/{name}']]}",
                flush=True,
            )
        for c in args.concurrency:
            prompts = all_prompts[: max(args.prompts, c)]
            cfg = {"max_running_requests": c, "max_batch_tokens": 16 * c}
            base = run_engine(
                Engine(target, None, EngineConfig(policy="ar", **cfg), eos_token_ids=tuple(eos)),
                prompts,
                params,
            )
            results = {"ar": base}
            results["hf"] = run_hf(hf, prompts, c, args.max_new_tokens, eos[0], eos, False)
            if c == 1:
                results["hf-pld"] = run_hf(hf, prompts, 1, args.max_new_tokens, eos[0], eos, True)
            for m in SPEC_METHODS:
                d = drafters["adaflash" if m == "oracle" else m]
                policy = "head" if m == "adaflash" else "fixed"
                kw = {"references": ar_ref} if m == "oracle" else {}
                cls = OracleLengthEngine if m == "oracle" else Engine
                results[m] = run_engine(
                    cls(
                        target,
                        copy.deepcopy(d),
                        EngineConfig(policy=policy, **cfg),
                        eos_token_ids=tuple(eos),
                        **kw,
                    ),
                    prompts,
                    params,
                )
            ar_outs = base["_outputs"]
            for m, r in results.items():
                outs = r.pop("_outputs", None)
                row = {
                    "domain": domain,
                    "concurrency": c,
                    "method": m,
                    **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                    "speedup": round(speedup(r["tokens_per_s"], base["tokens_per_s"]), 3),
                }
                if outs is not None:  # lossless check (bf16 may flip a near-tie now and then)
                    row["identical_to_ar"] = sum(outs[k] == ar_outs[k] for k in ar_outs)
                rows.append(row)
                print(
                    f"{domain:<6} C={c:<3} {m:<9} {row['tokens_per_s']:7.1f} tok/s "
                    f"x{row['speedup']:.2f}  τ {row.get('accept_len', float('nan')):.2f}  "
                    f"verify_len {row.get('verify_len', float('nan')):.2f}",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "bench/compare.py",
        "args": vars(args),
        "rows": rows,
        "adaptation_curves": curves,
        "minutes": round((time.time() - t_start) / 60, 1),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(markdown(result))
    charts(result, out)
    print(
        f"wrote {out}/results.json, table.md, speedup.png, adaptation.png ({result['minutes']} min)"
    )


def markdown(result: dict) -> str:
    rows = result["rows"]
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["concurrency"], r["domain"]): r for r in rows}
    lines = [
        f"Speedup over `ar` / τ (verify length) — {result['date']}, "
        f"{result['machine']['platform']}, torch {result['machine']['torch']}, "
        f"{result['args']['prompts']} prompts (C prompts where C is larger) × "
        f"{result['args']['max_new_tokens']} tokens per domain, greedy, "
        f"{result['args']['dtype']}, {result['machine']['torch_threads']} torch thread(s). "
        + result["args"].get("note", ""),
        "",
        "| method | C | " + " | ".join(domains) + " | avg |",
        "|---|---|" + "---|" * (len(domains) + 1),
    ]
    for m in methods:
        for c in concs:
            cells, sp, taus = [], [], []
            for d in domains:
                r = cell.get((m, c, d))
                if r is None:
                    cells.append("—")
                    continue
                sp.append(r["speedup"])
                if "accept_len" in r:
                    taus.append(r["accept_len"])
                    cells.append(
                        f"{r['speedup']:.2f}× / {r['accept_len']:.2f} ({r['verify_len']:.1f})"
                    )
                else:
                    cells.append(f"{r['speedup']:.2f}×")
            if not sp:
                continue
            avg = f"{sum(sp) / len(sp):.2f}×" + (f" / {sum(taus) / len(taus):.2f}" if taus else "")
            lines.append(f"| {m} | {c} | " + " | ".join(cells) + f" | {avg} |")
    lines += [
        "",
        "Cells: speedup / τ (average verify length). τ = tokens per round, bonus included.",
    ]
    return "\n".join(lines) + "\n"


def charts(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in methods:
        ys = []
        for c in concs:
            vals = [r["speedup"] for r in rows if r["method"] == m and r["concurrency"] == c]
            ys.append(sum(vals) / len(vals) if vals else float("nan"))
        ax.plot(concs, ys, marker="o", label=m)
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup over plain decoding (avg over domains)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in result["adaptation_curves"].items():
        ax.plot(range(len(curve)), curve, marker="o", label=name)
    ax.set_xlabel("online adaptation round")
    ax.set_ylabel("simulated τ on held-out prompts (full block)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "adaptation.png", dpi=110)


if __name__ == "__main__":
    main()
