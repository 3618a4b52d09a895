"""Train the default drafter on a CUDA machine in about ten minutes, end to end.

1. on-policy data: the target answers the shipped chat and code training prompts (greedy,
   Hugging Face ``generate`` in large left-padded batches on the GPU) for ``--gen-minutes``;
2. the teacher once per trajectory (features + top-K): on CUDA through transformers in padded
   batches (``teacher_cache.teach_hf``), on a CPU through the engine (``teach``);
3. distillation with Lightning on the GPU (bf16 autocast) for ``--train-minutes``, from scratch
   or continuing ``--init``;
4. the drafter folder (DFlash format + draft vocabulary + model card) in ``--out``, with the
   simulated τ on held-out eval-prompt trajectories in its ``training.json``.

    python scripts/gpu_recipe.py --out /tmp/drafter          # CUDA host, ends inside --minutes 10
    python scripts/gpu_recipe.py --out /tmp/d --device cpu --prompts 4 --max-new-tokens 8 \
        --gen-minutes 0.2 --train-minutes 0.2 --target tests-folder   # the CPU smoke test

Without CUDA it runs on the CPU (slowly: that is what the tests do at a tiny scale).

Measured on one H200 (2026-12-04, a run cut off before training by a fixed outer time limit,
which is why ``--minutes`` exists): generation at batch 512 gave 3,684 answers (548,714 response
tokens) in 103 s; the teacher over them in 2,048-token packs took 160 s. The run the shipped
drafter continues (``--minutes 8.5``, the engine's teacher in 16,384-token packs, training one
sequence at a time): 3,584 answers in 129 s, the teacher over 2,816 of them in 159 s, 177 s of
training at ~29 ms a sequence (591K blocks). The transformers teacher and the batched training
step (``distill.distill_batch``) came after it and have not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaflash.cli import encode_prompt
from adaflash.config import DistillConfig
from adaflash.distill import replay
from adaflash.models.draft_vocab import build_draft_vocab, count_tokens, coverage
from adaflash.models.drafter import load_drafter
from adaflash.models.target import load_target
from adaflash.pull import resolve_target
from adaflash.teacher_cache import CachedSequence, teach, teach_hf
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import Trajectory, load_prompts
from lightning_modules.train import fit, new_drafter, save_run

# the run's budget (--minutes): generation takes at most GEN_SHARE of it, the teacher stops
# starting new trajectories at TEACH_UNTIL of it, and training ends RESERVE minutes before the
# budget's end (Lightning's start, the final replay and the save)
GEN_SHARE = 0.35
TEACH_UNTIL = 0.55
RESERVE = 0.75


def generate(
    folder: Path,
    prompts: list[tuple[str, str, list[int]]],
    device: str,
    batch: int,
    max_new: int,
    minutes: float,
    pad_id: int,
    eos: set[int],
) -> list[Trajectory]:
    """Greedy answers with transformers on ``device``, until the prompts or the time run out."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    out: list[Trajectory] = []
    deadline = time.time() + 60 * minutes
    for i in range(0, len(prompts), batch):
        if time.time() > deadline:
            break
        group = prompts[i : i + batch]
        width = max(len(p) for _, _, p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for _, _, p in group], device=device)
        mask = (
            torch.arange(width, device=device)[None, :]
            >= width - torch.tensor([len(p) for _, _, p in group], device=device)[:, None]
        ).long()
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        for (pid, domain, p), row in zip(group, gen[:, width:].tolist(), strict=True):
            resp = []
            for t in row:
                resp.append(t)
                if t in eos:
                    break
            out.append(Trajectory(pid, domain, p, resp, "", "stop"))
        print(f"[recipe] generated {len(out)}/{len(prompts)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="drafter folder to write")
    ap.add_argument("--target", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--init", default=None, help="continue this drafter folder")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per domain (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="the whole run's budget: generation, teacher and training shrink to end inside it",
    )
    ap.add_argument("--gen-minutes", type=float, default=3.0)
    ap.add_argument("--train-minutes", type=float, default=6.0)
    ap.add_argument(
        "--teach-tokens",
        type=int,
        default=None,
        help="tokens per teacher pass (default: 16384 on CUDA, 2048 on a CPU)",
    )
    ap.add_argument(
        "--teacher",
        choices=["hf", "engine"],
        default=None,
        help="the teacher pass: transformers in padded batches (``teach_hf``, default on CUDA: "
        "the engine's packed pass took 159 s for 2,816 answers on an H200) or the engine's",
    )
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's")
    ap.add_argument(
        "--curve-every",
        type=int,
        default=0,
        help="replay the held-out trajectories every this many blocks (0: only at the end)",
    )
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + 60 * args.minutes
    torch.manual_seed(args.seed)
    folder = resolve_target(args.target)
    tok = Tokenizer.from_folder(folder)
    eos = set(tok.eos_token_ids)
    rows = [
        (p.id, p.domain, encode_prompt(tok, p.prompt, True))
        for d in ("chat", "code")
        for p in load_prompts(d, "train", args.prompts)
    ]
    rows.sort(key=lambda r: len(r[2]))  # similar lengths batch with little padding
    evals = [
        (p.id, p.domain, encode_prompt(tok, p.prompt, True))
        for d in ("chat", "code")
        for p in load_prompts(d, "eval", 8 if args.prompts is None else 2)
    ]
    pad = tok.eos_token_ids[0]
    gen_minutes = min(args.gen_minutes, GEN_SHARE * args.minutes)
    train = generate(
        folder, rows, args.device, args.gen_batch, args.max_new_tokens, gen_minutes, pad, eos
    )
    held = generate(folder, evals, args.device, args.gen_batch, args.max_new_tokens, 60.0, pad, eos)
    t_gen = time.time() - t0
    n_tok = sum(len(t.response_ids) for t in train)
    print(f"[recipe] {len(train)} trajectories, {n_tok} tokens in {t_gen:.0f} s", flush=True)

    target = load_target(folder, "bfloat16" if args.device == "cuda" else "float32", args.device)
    offset = 0  # blocks the chain had seen before this run
    if args.init:
        drafter = load_drafter(args.init, "float32")
        card = Path(args.init) / "training.json"
        if card.is_file():
            offset = int(json.loads(card.read_text()).get("result", {}).get("blocks_seen", 0))
    else:
        drafter = new_drafter(
            target,
            mask_token_id=args.mask_token_id
            if args.mask_token_id is not None
            else tok.mask_token_id(target.cfg.vocab_size),
            num_layers=args.layers,
            block_size=args.block_size,
            seed=args.seed,
        )
    counts = count_tokens((t.response_ids for t in train), target.cfg.vocab_size)
    vocab = build_draft_vocab(
        counts,
        min(args.draft_vocab, target.cfg.vocab_size),
        tuple(e for e in eos if e < target.cfg.vocab_size),
    )
    drafter.set_draft_vocab(
        vocab,
        {"built_from": "recipe trajectories", "train_coverage": round(coverage(vocab, counts), 5)},
    )
    drafter.to(args.device)
    pack = args.teach_tokens or (16384 if args.device == "cuda" else 2048)
    layer_ids = drafter.cfg.target_layer_ids
    if (args.teacher or ("hf" if args.device == "cuda" else "engine")) == "hf":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype).to(args.device)
        hf.eval()

        def run_teacher(part: list[Trajectory]) -> list[CachedSequence]:
            return teach_hf(hf, part, layer_ids, max_tokens=pack)
    else:

        def run_teacher(part: list[Trajectory]) -> list[CachedSequence]:
            return teach(target, part, layer_ids, max_tokens=pack)

    held_seqs = run_teacher(held)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed)).tolist()
    seqs = []  # in a shuffled order, so that a teacher cut short by the budget keeps both domains
    for i in range(0, len(order), 256):
        if seqs and time.time() > t0 + 60 * TEACH_UNTIL * args.minutes:
            print(f"[recipe] teacher budget spent: {len(seqs)} of {len(train)} taught", flush=True)
            break
        part = [train[j] for j in order[i : i + 256]]
        seqs += run_teacher(part)
    t_teach = time.time() - t0 - t_gen
    print(f"[recipe] teacher over {len(seqs)} sequences in {t_teach:.0f} s", flush=True)
    curve_sets = {d: [s for s in held_seqs if s.domain == d] for d in ("chat", "code")}
    tau0 = {d: round(replay(drafter, target, v).accept_len, 4) for d, v in curve_sets.items()}
    print(f"[recipe] held-out simulated tau before training {tau0}", flush=True)
    cfg = DistillConfig(
        epochs=1000,
        max_minutes=min(args.train_minutes, max(0.1, (deadline - time.time()) / 60 - RESERVE)),
        anchors_per_seq=args.anchors,
        batch_size=args.batch_size,
        accumulate=1,
        drafter_lr=args.lr,
        bf16_autocast=args.device == "cuda",
        seed=args.seed,
    )
    result = fit(
        drafter,
        target,
        seqs,
        None,
        cfg,
        progress=False,
        curve_sets=curve_sets,
        curve_every=args.curve_every or 10**12,  # 0: no point mid-run, fit still ends on one
        blocks_offset=offset,
        on_curve=lambda c: print(f"[recipe] curve {c[-1]}", flush=True),
    )
    tau = {d: round(replay(result.drafter, target, v).accept_len, 4) for d, v in curve_sets.items()}
    save_run(
        result,
        Path(args.out),
        title="SmolLM2-135M-Instruct DFlash drafter (GPU recipe)",
        data={
            "trajectories": len(train),
            "domains": ["chat", "code"],
            "target": folder.name,
            "init": args.init or "target layers",
            "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "response_tokens": n_tok,
            "taught": len(seqs),
            "budget_minutes": args.minutes,
        },
        cfg=cfg,
        extra={
            "simulated_tau_held_out": tau,
            "simulated_tau_held_out_before": tau0,
            "generate_s": round(t_gen, 1),
            "teacher_s": round(t_teach, 1),
            "learning_curve": result.curve,
            "total_s": round(time.time() - t0, 1),
        },
    )
    print(json.dumps({"out": args.out, "tau": tau, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
