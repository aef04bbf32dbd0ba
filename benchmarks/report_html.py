"""The run's HTML report: what leaked, readable. One self-contained file (images inlined).

Sections: the run's title and configuration; one row per attack (exact match, token accuracy with
its prompt-clustered se and 95% upper bound, bag-of-tokens F1, candidates per position); the
defence's utility cost; per prompt, the true tokens and each attack's recovery side by side, token
by token, recovered tokens in green and wrong ones in red (a position the attack never reached is
grey); the prompt's private spans are underlined in the truth, and each attack's line names the
spans it gave back verbatim; then the run's plots. Tokens are shown as the tokenizer decodes each one alone
(``results["token_text"]``), whitespace made visible.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from benchmarks.metrics import describe_noise, use_lines

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-size: 13px; }
.tok { font-family: monospace; white-space: pre; padding: 1px 2px; margin: 0 1px; border-radius: 3px; }
.truth { background: #eef; }
.ok { background: #cfc; }
.wrong { background: #fbb; }
.missing { background: #ddd; color: #888; }
.private { text-decoration: underline 2px #a00; font-weight: bold; }
.leak { color: #a00; font-weight: bold; }
.prompt { margin: 1em 0; }
img { max-width: 48%; margin-right: 1%; }
"""


def _token(text_of: dict, token, css: str) -> str:
    shown = text_of.get(str(token), f"<{token}>") if token is not None else "∅"
    shown = shown.replace(" ", "·").replace("\n", "⏎") or "∅"
    return f'<span class="tok {css}" title="id {token}">{html.escape(shown)}</span>'


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def attack_table(attacks: dict) -> str:
    rows = ["<table><tr><th>attack</th><th>decoder</th><th>exact match</th><th>token accuracy ± se</th>"
            "<th>token acc. upper 95%</th><th>bag-of-tokens F1</th><th>private spans leaked (upper 95%)</th>"
            "<th>candidates / position</th></tr>"]
    for name, s in attacks.items():
        if "token_accuracy" not in s:
            rows.append(f"<tr><td>{html.escape(name)}</td><td colspan=7>not run: {html.escape(str(s.get('skipped', '')))}</td></tr>")
            continue
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{html.escape(str(s.get('decoder', '')))}</td>"
                    f"<td>{_fmt(s.get('exact_match'), '.2f')}</td>"
                    f"<td>{s['token_accuracy']:.3f} ± {_fmt(s.get('token_accuracy_se'), '.3f')}</td>"
                    f"<td>{_fmt(s.get('token_accuracy_upper95'), '.3f')}</td><td>{_fmt(s.get('bag_f1'), '.3f')}</td>"
                    f"<td>{_span_cell(s)}</td>"
                    f"<td>{_fmt(s.get('candidates_per_position'), '.1f')}</td></tr>")
    return "\n".join(rows + ["</table>"])


def _spans_line(leaked: list[str], spans: list[str]) -> str:
    if not spans:
        return ""
    return (f'<br><span class="leak">leaked {len(leaked)}/{len(spans)} private spans: '
            f'{html.escape(", ".join(leaked))}</span>' if leaked else f"<br>0/{len(spans)} private spans leaked")


def _span_cell(s: dict) -> str:
    n = s.get("n_spans") or 0
    return "-" if not n else f"{round(s['span_recall'] * n)}/{n} ({s['span_recall_upper95']:.3f})"


def prompt_sections(rows: list[dict], text_of: dict, prompts: list[dict] | None = None) -> str:
    """Per prompt: the truth (private spans underlined), then one line per attack, token by token."""
    out = []
    info = {p["index"]: p for p in prompts or []}
    for prompt in sorted({r["prompt"] for r in rows}):
        spans = info.get(prompt, {}).get("spans", [])
        private = set(info.get(prompt, {}).get("span_positions", []))
        leaked = info.get(prompt, {}).get("spans_leaked", {})
        mine = [r for r in rows if r["prompt"] == prompt]
        attacks = list(dict.fromkeys(r["attack"] for r in mine))
        truth = [r["true_token"] for r in sorted((r for r in mine if r["attack"] == attacks[0]), key=lambda r: r["position"])]
        lines = [f'<div class="prompt"><b>prompt {prompt}</b><table>',
                 "<tr><td>truth</td><td>" + "".join(_token(text_of, t, "truth private" if pos in private else "truth")
                                                    for pos, t in enumerate(truth)) + "</td></tr>"]
        for attack in attacks:
            got = sorted((r for r in mine if r["attack"] == attack), key=lambda r: r["position"])
            cells = "".join(_token(text_of, r["recovered_token"],
                                   "missing" if r["recovered_token"] is None else "ok" if r["correct"] else "wrong")
                            for r in got)
            n_ok = sum(bool(r["correct"]) for r in got)
            lines.append(f"<tr><td>{html.escape(attack)} ({n_ok}/{len(got)})</td><td>{cells}"
                         f"{_spans_line(leaked.get(attack, []), spans)}</td></tr>")
        out.append("\n".join(lines + ["</table></div>"]))
    return "\n".join(out)


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def render(results: dict, rows: list[dict], images: list[Path]) -> str:
    """The report as one HTML document (module docstring)."""
    title = results.get("title", "sipit-bench run")
    u = results.get("utility") or {}
    utility = ""
    if u:
        utility = (f"<p>Utility: perplexity {_fmt(u.get('ppl_clean'), '.3f')} → {_fmt(u.get('ppl_served'), '.3f')} "
                   f"({_fmt(u.get('ppl_rel_increase'), '+.2%')}) for the served model, top-1 agreement "
                   f"{_fmt(u.get('top1_agreement'), '.3f')}; continued from the exposed states "
                   f"{_fmt(u.get('continued_ppl_rel_increase'), '+.2%')}, top-1 agreement "
                   f"{_fmt(u.get('continued_top1_agreement'), '.3f')} ({u.get('n_tokens')} held-out tokens).</p>")
        utility += "".join(f"<p>{html.escape(line)}</p>" for line in use_lines(u.get("uses") or {}))
    return "\n".join([
        "<!doctype html>", '<html><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>status: {html.escape(str(results.get('status')))}; defence: "
        f"{html.escape(str((results.get('defense') or {}).get('describe', '')))}</p>",
        f"<p>{html.escape(describe_noise(results['noise']))}</p>" if results.get("noise") else "",
        "<h2>Attacks</h2>", attack_table(results.get("attacks", {})), utility,
        "<h2>What leaked, prompt by prompt</h2>",
        '<p><span class="tok ok">recovered</span> <span class="tok wrong">wrong</span> '
        '<span class="tok missing">not reached</span> <span class="tok truth private">private span</span> '
        '(· = space; a span leaks when it comes back verbatim)</p>',
        prompt_sections(rows, results.get("token_text", {}), results.get("prompts")),
        "<h2>Plots</h2>", "".join(_image(p) for p in images if Path(p).is_file()),
        "</body></html>",
    ])
