"""The Gradio UI (mounted at /ui): Chat, live Dashboard, and Admin behind the admin token."""

from __future__ import annotations

import hmac
import html
import time
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from adaflash.config import POLICIES
from adaflash.metrics import SpecCounters
from app.service import Service
from ui import charts

WINDOWS = {"5 min": 300, "15 min": 900, "60 min": 3600}
STYLE = {
    "draft": "background:#c8e6c9;border-radius:3px",
    "suffix": "background:#bbdefb;border-radius:3px",
    "target": "background:#ffe0b2;border-radius:3px",
    "unknown": "background:#eeeeee;border-radius:3px",  # the SGLang backend does not say
}


def provenance_html(pieces: list[tuple[str, str]]) -> str:
    """Tokens coloured by how they were produced: the drafter's accepted draft (green), an
    accepted suffix draft (blue) or the target's own (orange)."""
    spans = "".join(
        f'<span class="tok-{kind}" style="{STYLE.get(kind, STYLE["unknown"])}">'
        f"{html.escape(text)}</span>"
        for text, kind in pieces
    )
    legend = (
        '<div style="font-size:12px;margin-bottom:6px">'
        f'<span style="{STYLE["draft"]}">&nbsp;accepted draft token&nbsp;</span> '
        f'<span style="{STYLE["suffix"]}">&nbsp;accepted suffix draft&nbsp;</span> '
        f'<span style="{STYLE["target"]}">&nbsp;target token (bonus / plain)&nbsp;</span>'
        + (
            f' <span style="{STYLE["unknown"]}">&nbsp;not reported by the backend&nbsp;</span>'
            if any(kind not in ("draft", "suffix", "target") for _, kind in pieces)
            else ""
        )
        + "</div>"
    )
    body = "font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.8"
    return f'{legend}<div style="{body}">{spans}</div>'


def build_ui(service: Service) -> gr.Blocks:
    tok = service.tokenizer

    async def respond(
        message: str,
        history: list[dict[str, Any]],
        system: str,
        temperature: float,
        max_tokens: int,
        show_tokens: bool,
    ) -> AsyncIterator[tuple[Any, ...]]:
        message, system, history = message or "", system or "", history or []
        if not message.strip():
            yield history, "", gr.update(), "Type a message first."
            return
        messages = [{"role": "system", "content": system}] if system.strip() else []
        messages += [{"role": m["role"], "content": _text(m["content"])} for m in history]
        messages.append({"role": "user", "content": message})
        history = [
            *history,
            {"role": "user", "content": message},
            {"role": "assistant", "content": ""},
        ]
        try:
            prompt = tok.chat(messages)
            params = service.sampling(
                temperature=temperature,
                top_p=None,
                top_k=None,
                max_new_tokens=int(max_tokens),
                prompt_len=len(prompt),
            )
        except ValueError as exc:
            history[-1]["content"] = f"Error: {exc}"
            yield history, "", gr.update(), ""
            return
        t0, text, pieces, n, rounds = time.perf_counter(), "", [], 0, 0
        async for d in service.backend.stream(prompt, params, domain="chat"):
            text += d.text
            n += len(d.token_ids)
            rounds += 1 if d.token_ids else 0
            pieces += [
                (tok.decode([t]), kind) for t, kind in zip(d.token_ids, d.kinds, strict=True)
            ]
            history[-1]["content"] = text
            rate = n / max(time.perf_counter() - t0, 1e-6)
            line = f"**{rate:.1f} tokens/s** · τ ≈ {n / max(rounds, 1):.2f} tokens per round"
            if d.finished and d.record is not None:
                c = SpecCounters.from_totals(
                    service.backend.block_size,
                    d.record.rounds,
                    d.record.verified,
                    d.record.accepted,
                )
                line = (
                    f"**{rate:.1f} tokens/s** · τ = {c.accept_len:.2f} · verify_len = "
                    f"{c.verify_len:.2f} · {n} tokens in {d.record.rounds} rounds · "
                    f"drafter {d.record.drafter_version} · finish: {d.finish_reason}"
                )
            yield (history, "", gr.update(value=provenance_html(pieces), visible=show_tokens), line)

    def dashboard(window: str) -> tuple[Any, ...]:
        d = service.dashboard(WINDOWS.get(window, 300))
        b, total = service.backend, d.total
        summary = (
            f"**serving {b.version}** · policy `{b.policy}` · "
            f"γ = {b.gamma:g} · last {window}: {total.rounds} rounds, "
            f"τ = {total.accept_len:.2f}, verify_len = {total.verify_len:.2f}, "
            f"{d.busy_tokens_per_s:.1f} tokens/s while busy · queue drops "
            f"{service.sink.dropped} · trainer "
            f"{'up' if service.trainer_alive() else 'not running'}"
        )
        probed = d.probed
        if probed.rounds:
            summary += (
                f"  \ndrafter τ on whole blocks, from {probed.rounds} probes (shadow drafts the"
                f" cost policy checks against what the target committed): {probed.accept_len:.2f}"
            )
        cost = b.cost_snapshot()
        if cost is not None:
            summary += (
                f"  \ncost model (measured online): target pass {cost['target_base_ms']:.1f} ms"
                f" + {cost['target_per_token_ms']:.2f} ms/token"
                f" + {cost['target_per_request_ms']:.2f} ms/request · drafter pass "
                f"{cost['drafter_base_ms']:.1f} ms + {cost['drafter_per_request_ms']:.2f}"
                f" ms/request + {cost['drafter_per_context_token_ms']:.3f} ms/context token"
            )
        runs = d.runs
        table = [
            [
                r.id,
                r.trigger,
                r.status,
                r.samples,
                r.steps,
                None if r.seconds is None else round(r.seconds, 1),
                r.version_id or "",
                (r.error or "")[:80],
            ]
            for r in runs
        ]
        return (
            summary,
            charts.timeline(d.buckets, d.versions, d.now, d.probes, d.gates),
            charts.throughput(d.buckets, d.versions, d.now),
            charts.slots(d.slots),
            charts.domains(d.per_domain),
            charts.training(runs),
            table,
        )

    def authorised(token: str) -> bool:
        want = service.cfg.admin_token
        return want is not None and hmac.compare_digest(token.encode(), want.encode())

    def versions_table() -> list[list[Any]]:
        rows = []
        for v in reversed(service.versions()):
            gate = v.gate_tau
            rows.append(
                [
                    v.id,
                    v.status,
                    v.parent or "",
                    v.loss or "",
                    v.samples,
                    gate[1] if gate else "",
                    gate[0] if gate else "",
                    v.reason or "",
                    v.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                ]
            )
        return rows

    def login(token: str) -> tuple[Any, ...]:
        if not service.cfg.admin_token:
            return (
                gr.update(visible=False),
                "Admin is disabled: start the server with "
                "`--admin-token` (or `ADAFLASH_ADMIN_TOKEN`).",
                gr.update(),
            )
        if not authorised(token):
            return gr.update(visible=False), "Error: Wrong admin token.", gr.update()
        ids = [v.id for v in reversed(service.versions())]
        return (
            gr.update(visible=True),
            "OK: Logged in.",
            gr.update(choices=ids, value=ids[0] if ids else None),
        )

    def guarded(fn: Any) -> Any:
        def run(token: str, *args: Any) -> tuple[str, list[list[Any]]]:
            if not authorised(token):
                return "Error: Not logged in.", versions_table()
            try:
                msg = fn(*args)
            except (RuntimeError, ValueError) as exc:  # VersionError is a RuntimeError
                msg = f"Error: {exc}"
            return msg, versions_table()

        return run

    def do_train() -> str:
        run_id, note = service.request_training()
        return f"OK: Training run {run_id} requested" + (f" ({note})." if note else ".")

    def do_promote(version: str) -> str:
        v = service.promote(version, reason="promoted from the admin UI")
        return f"OK: {v.id} is active; serving {service.backend.version}."

    def do_rollback() -> str:
        v = service.rollback()
        return f"OK: Rolled back to {v.id}."

    def do_config(policy: str, gamma: float) -> str:
        service.configure(policy, gamma)
        return f"OK: policy = {policy}, γ = {gamma:g} (from the next step)."

    with gr.Blocks(title="AdaFlash") as demo:
        gr.Markdown(
            f"## ⚡ AdaFlash · `{service.model_name}` · self-improving speculative decoding"
        )
        with gr.Tab("Chat", id="chat"):
            chatbot = gr.Chatbot(height=380, elem_id="chatbot", label="Conversation")
            with gr.Row():
                msg = gr.Textbox(
                    placeholder="Ask something…",
                    show_label=False,
                    scale=6,
                    elem_id="chat-input",
                    autofocus=True,
                )
                send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            reply_stats = gr.Markdown(elem_id="reply-stats")
            tokens_view = gr.HTML(visible=False, elem_id="provenance")
            with gr.Accordion("Settings", open=False):
                system = gr.Textbox(label="System prompt", lines=2)
                temperature = gr.Slider(
                    0.0,
                    service.cfg.max_temperature,
                    value=0.0,
                    step=0.05,
                    label="Temperature (0 = greedy)",
                )
                max_tokens = gr.Slider(
                    16, service.max_new_tokens, value=192, step=16, label="Max tokens"
                )
                show_tokens = gr.Checkbox(
                    value=True,
                    label="Colour tokens by how they were produced",
                    elem_id="show-tokens",
                )
            clear = gr.Button("Clear conversation", size="sm")
            inputs = [msg, chatbot, system, temperature, max_tokens, show_tokens]
            outputs = [chatbot, msg, tokens_view, reply_stats]
            msg.submit(respond, inputs, outputs)
            send.click(respond, inputs, outputs)
            clear.click(
                lambda: ([], "", gr.update(value="", visible=False), ""),
                None,
                [chatbot, msg, tokens_view, reply_stats],
            )

        with gr.Tab("Dashboard", id="dashboard"):
            with gr.Row():
                window = gr.Dropdown(list(WINDOWS), value="5 min", label="Window", scale=1)
                summary = gr.Markdown(elem_id="dash-summary")
            with gr.Row():
                tau_plot = gr.Plot(elem_id="plot-timeline", label="τ / verify length")
                tps_plot = gr.Plot(elem_id="plot-throughput", label="tokens/s")
            with gr.Row():
                slot_plot = gr.Plot(elem_id="plot-slots", label="per-slot acceptance")
                domain_plot = gr.Plot(elem_id="plot-domains", label="per-domain τ")
            train_plot = gr.Plot(elem_id="plot-training", label="training runs")
            runs_table = gr.Dataframe(
                headers=[
                    "run",
                    "trigger",
                    "status",
                    "samples",
                    "steps",
                    "seconds",
                    "version",
                    "error",
                ],
                elem_id="runs-table",
                label="training runs",
            )
            timer = gr.Timer(2.0)
            dash_out = [summary, tau_plot, tps_plot, slot_plot, domain_plot, train_plot, runs_table]
            timer.tick(dashboard, [window], dash_out)
            window.change(dashboard, [window], dash_out)
            demo.load(dashboard, [window], dash_out)

        with gr.Tab("Admin", id="admin"):
            with gr.Row():
                token = gr.Textbox(
                    type="password", label="Admin token", elem_id="admin-token", scale=4
                )
                login_btn = gr.Button("Log in", elem_id="admin-login", scale=1)
            login_msg = gr.Markdown(elem_id="admin-login-msg")
            with gr.Column(visible=False, elem_id="admin-panel") as panel:
                status = gr.Markdown(elem_id="admin-status")
                versions = gr.Dataframe(
                    headers=[
                        "version",
                        "status",
                        "parent",
                        "loss",
                        "samples",
                        "gate τ (new)",
                        "gate τ (active)",
                        "reason",
                        "created",
                    ],
                    value=versions_table,
                    elem_id="versions-table",
                    label="versions",
                )
                with gr.Row():
                    train_btn = gr.Button("Retrain now", variant="primary", elem_id="train-btn")
                    version_dd = gr.Dropdown(label="Version", choices=[], elem_id="version-dd")
                    promote_btn = gr.Button("Promote", elem_id="promote-btn")
                    rollback_btn = gr.Button("Roll back", elem_id="rollback-btn")
                with gr.Row():
                    policy = gr.Radio(
                        list(POLICIES),
                        value=service.backend.policy,
                        label="Verify-length policy",
                    )
                    gamma = gr.Slider(
                        0.25,
                        3.0,
                        value=service.backend.gamma,
                        step=0.05,
                        label="γ (load scaling of k̂)",
                    )
                    apply_btn = gr.Button("Apply", elem_id="apply-btn")
            login_btn.click(login, [token], [panel, login_msg, version_dd])
            train_btn.click(guarded(do_train), [token], [status, versions])
            promote_btn.click(guarded(do_promote), [token, version_dd], [status, versions])
            rollback_btn.click(guarded(do_rollback), [token], [status, versions])
            apply_btn.click(guarded(do_config), [token, policy, gamma], [status, versions])
    return demo


def _text(content: Any) -> str:
    """Chatbot message content as plain text (Gradio 6 may hand back a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)
