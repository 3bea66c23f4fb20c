"""``specdec report DIR``: figures, a self-contained HTML page and a Markdown summary from profile.json.

Figures (PNG, matplotlib's Agg backend): acceptance by draft position per category, predicted and
measured speedup against k, the histogram of tokens per verify pass (τ), the split of the
speculative run's time between drafting, verifying, loop overhead and prefill, and the drafters
side by side per category (acceptance and τ, the recommended one per category marked). The HTML page embeds
the PNGs as base64, so it can be mailed or attached on its own.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from specdec.workbench.categories import ALL, config_label, is_choice, with_categories
from specdec.workbench.profile import TAU_NOTE

FIGURES = ("acceptance_by_position.png", "speedup_vs_k.png", "tau_histogram.png", "time_split.png",
           "by_category.png")


def load_profile(folder: str | Path) -> tuple[Path, dict]:
    folder = Path(folder)
    path = folder / "profile.json" if folder.is_dir() else folder
    if not path.is_file():
        raise ValueError(f"no profile.json in {str(folder)!r}; run `specdec profile ... --out {folder}` first")
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(profile, dict) or "configs" not in profile or "verify_cost" not in profile:
        raise ValueError(f"{str(path)!r} is not a specdec profile (no 'configs' / 'verify_cost')")
    return path.parent, with_categories(profile)



def write_report(folder: str | Path) -> dict:
    """Write the PNGs, report.html and report.md next to profile.json; returns their paths and the summary."""
    out, profile = load_profile(folder)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {
        "acceptance_by_position.png": _plot_acceptance(plt, profile),
        "speedup_vs_k.png": _plot_speedup(plt, profile),
        "tau_histogram.png": _plot_tau(plt, profile),
        "time_split.png": _plot_time_split(plt, profile),
        "by_category.png": _plot_by_category(plt, profile),
    }
    files = {}
    for name, fig in paths.items():
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files[name] = str(out / name)
    summary = summarize(profile)
    (out / "report.md").write_text(_markdown(profile, summary))
    (out / "report.html").write_text(_html(profile, summary, out))
    files["report.md"] = str(out / "report.md")
    files["report.html"] = str(out / "report.html")
    return {"files": files, "summary": summary}


def summarize(profile: dict) -> dict:
    """The headline numbers: per config the best k and speedup; the recommendation and its check."""
    configs = []
    for c in profile["configs"]:
        o = c["overall"]
        configs.append({"method": c["method"], "draft_cost_ratio": c["draft_cost_ratio"],
                        "draft_cost_shape": c.get("draft_cost_shape", "per_token"),
                        "draft_time_per_round_s": c.get("draft_time_per_round_s"),
                        "acceptance_rate": o["acceptance_rate"], "mean_acceptance_length": o["mean_acceptance_length"],
                        "best_k": o["best_k"], "predicted_speedup": o["best_speedup"],
                        "measured_speedup_at_k_max": o["measured_speedup_at_k_max"]})
    by_cat = {}
    for cat, e in profile.get("by_category", {}).items():
        rec, val = e["recommendation"], e.get("validation")
        by_cat[cat] = {"num_prompts": e["num_prompts"], "recommended": None if rec["plain"] else rec["label"],
                       "method": rec["method"],
                       "k": rec["k"], "plain": rec["plain"], "predicted_speedup": rec["predicted_speedup"],
                       "measured_speedup": val["measured_speedup"] if val else None,
                       "drafters": {r["label"]: {"acceptance_rate": r["acceptance_rate"],
                                                 "mean_acceptance_length": r["mean_acceptance_length"],
                                                 "best_k": r["best_k"], "predicted_speedup": r["best_speedup"],
                                                 "measured_speedup_at_k_max": r["measured_speedup_at_k_max"]}
                                    for r in e["drafters"]}}
    return {"model": profile["model"], "k_max": profile["k_max"], "num_prompts": profile["num_prompts"],
            "verify_cost": profile["verify_cost"]["v"], "configs": configs,
            "recommendation": profile.get("recommendation"), "validation": _validation_summary(profile),
            "by_category": by_cat}


def _validation_summary(profile: dict) -> dict | None:
    v = profile.get("validation")
    if not v:
        return None
    return {k: v[k] for k in ("k", "predicted_speedup", "predicted_speedup_end_to_end", "measured_speedup",
                              "relative_error", "relative_error_end_to_end", "plain_tokens_per_s",
                              "spec_tokens_per_s")}


# -- figures --------------------------------------------------------------------------------------


def _label(c: dict) -> str:
    return c.get("label") or config_label(c)


def _plot_acceptance(plt, profile: dict):
    configs = profile["configs"]
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4), squeeze=False)
    for ax, c in zip(axes[0], configs):
        for cat, e in c["categories"].items():
            pos = list(range(1, len(e["acceptance_rate_per_pos"]) + 1))
            style = dict(color="black", linewidth=2.5) if cat == ALL else dict(alpha=0.8)
            ax.plot(pos, e["alpha_conditional"], marker="o", label=f"{cat} (α_i)", **style)
            if cat == ALL:
                ax.plot(pos, e["acceptance_rate_per_pos"], linestyle="--", color="gray",
                        label="all (accepted at i / drafted at i)")
        ax.set_xlabel("draft position i")
        ax.set_ylabel("acceptance")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(pos)
        ax.set_title(f"{_label(c)}: conditional acceptance α_i")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig


def _plot_speedup(plt, profile: dict):
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ks = profile["verify_cost"]["k"]
    for i, c in enumerate(profile["configs"]):
        o = c["overall"]
        if is_choice(c):  # measured only: one c per drafted token does not describe a mix of methods
            ax.scatter([c["k_measured"]], [o["measured_speedup_at_k_max"]], marker="D", s=50, color="gray",
                       label=f"{_label(c)} (per-request choice): measured at k={c['k_measured']}", zorder=3)
            continue
        line, = ax.plot(ks, o["predicted_speedup"], marker="o", label=f"{_label(c)}: predicted S(k)")
        ax.plot(ks, o["predicted_speedup_end_to_end"], linestyle=":", color=line.get_color(),
                label=f"{_label(c)}: predicted end to end (prefill, loop overhead)")
        ax.scatter([c["k_measured"]], [o["measured_speedup_at_k_max"]], marker="s", s=50, color=line.get_color(),
                   label=f"{_label(c)}: measured at k={c['k_measured']}", zorder=3)
        v = profile.get("validation")
        rec = profile.get("recommendation") or {}
        sweep = profile.get("sweep")
        if sweep and rec.get("config_index") == i:
            ax.plot([0] + [r["k"] for r in sweep], [1.0] + [r["measured_speedup"] for r in sweep], marker="x",
                    linestyle="--",
                    color="black", label=f"{_label(c)}: measured at every k (sweep)", zorder=3)
        if v and rec.get("config_index") == i:
            ax.scatter([v["k"]], [v["measured_speedup"]], marker="*", s=160, color=line.get_color(), zorder=4,
                       edgecolor="black", label=f"measured at recommended k={v['k']}")
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("S(k) = E(k) / (k·c + v(k)) and measured speedup")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _plot_tau(plt, profile: dict):
    configs = profile["configs"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    n = len(configs)
    width = 0.8 / n
    for i, c in enumerate(configs):
        hist = c["overall"]["tau_histogram"]
        total = sum(hist) or 1
        xs = [t + 1 + (i - (n - 1) / 2) * width for t in range(len(hist))]
        ax.bar(xs, [h / total for h in hist], width=width,
               label=f"{_label(c)} (mean τ {c['overall']['mean_acceptance_length']:.2f})")
    ax.set_xlabel("τ: tokens emitted per verify pass (incl. recovered/bonus token)")
    ax.set_ylabel("share of rounds")
    ax.set_title(f"τ histogram at k={profile['k_max']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def _plot_time_split(plt, profile: dict):
    rows = []
    c0 = profile["configs"][0]["overall"]
    rows.append(("plain", c0["plain_time_split"]))
    for c in profile["configs"]:
        rows.append((f"{_label(c)}\nk={c['k_measured']}", c["overall"]["time_split"]))
    v = profile.get("validation")
    if v:
        rows.append((f"recommended\nk={v['k']}", v["time_split"]))
    parts = [("draft_s", "drafting"), ("verify_s", "verifying"), ("overhead_s", "loop overhead"),
             ("prefill_s", "prefill")]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(rows)), 4.2))
    bottoms = [0.0] * len(rows)
    for key, name in parts:
        vals = [r[1].get(key, 0.0) for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottoms, label=name)
        bottoms = [b + x for b, x in zip(bottoms, vals)]
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("where the time goes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def _plot_by_category(plt, profile: dict):
    """Per category, the drafters side by side: acceptance rate (top) and τ at k = K (bottom); the
    recommended drafter per category has a black edge and a star with its k; a method list measured as
    itself (per-request choice) is hatched."""
    by_cat = profile["by_category"]
    cats = list(by_cat)
    labels = [_label(c) for c in profile["configs"]]
    n = len(labels)
    width = 0.8 / n
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax_acc, ax_tau) = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(cats) * max(n, 2) / 2 + 2), 6.5),
                                         sharex=True)
    for i, label in enumerate(labels):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(cats))]
        rows = [by_cat[cat]["drafters"][i] for cat in cats]
        style = {"color": colors[i % len(colors)], "hatch": "//" if rows and rows[0]["choice"] else None}
        ax_acc.bar(xs, [r["acceptance_rate"] for r in rows], width=width, label=label, **style)
        ax_tau.bar(xs, [r["mean_acceptance_length"] for r in rows], width=width, **style)
        for x, cat, r in zip(xs, cats, rows):
            rec = by_cat[cat]["recommendation"]
            if rec["plain"] or rec["config_index"] != i:
                continue
            for ax, key in ((ax_acc, "acceptance_rate"), (ax_tau, "mean_acceptance_length")):
                ax.bar([x], [r[key]], width=width, fill=False, edgecolor="black", linewidth=2)
                ax.annotate(f"★ k={rec['k']}\n{rec['predicted_speedup']:.2f}x", (x, r[key]), ha="center",
                            va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax_acc.set_ylabel(f"acceptance rate (k={profile['k_max']})")
    ax_acc.set_ylim(0, 1.2)
    ax_acc.set_title("drafters per category: ★ the recommended one, its best k and predicted speedup "
                     "(no ★: plain decoding)", fontsize=10)
    ax_acc.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax_tau.set_ylabel(f"τ at k={profile['k_max']}")
    ax_tau.axhline(1.0, color="gray", linewidth=1)
    ax_tau.set_ylim(0, profile["k_max"] + 1.6)
    ax_tau.set_xticks(range(len(cats)))
    ax_tau.set_xticklabels(cats, rotation=30 if len(cats) > 4 else 0, ha="right" if len(cats) > 4 else "center",
                           fontsize=8)
    for ax in (ax_acc, ax_tau):
        ax.grid(alpha=0.3, axis="y")
    return fig


# -- text -----------------------------------------------------------------------------------------


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _markdown(profile: dict, summary: dict) -> str:
    lines = [f"# specdec profile: {profile['model']}", "",
             f"{profile['num_prompts']} prompts ({', '.join(profile['categories'])}), max {profile['max_tokens']} "
             f"tokens, temperature {profile['temperature']}, k measured up to {profile['k_max']}.", "",
             f"Cost model: {profile['cost_model']}.", f"{TAU_NOTE}.", "",
             "Verify cost v(k) (a (k+1)-token target forward ÷ a 1-token forward): "
             + ", ".join(f"v({k})={x:.2f}" for k, x in zip(profile["verify_cost"]["k"], profile["verify_cost"]["v"]))
             + f"; 1-token forward {profile['verify_cost']['t1_s'] * 1e3:.2f} ms.", "",
             "c: a draft step ÷ a 1-token target step; for a parallel draft (one forward per round) its round at "
             "k_max ÷ that step, marked /round. Draft per round: measured at k_max.", "",
             "| config | c | draft per round | acceptance | τ | best k | predicted S(best k) | "
             "at k_max: predicted / measured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c, s in zip(profile["configs"], summary["configs"]):
        at_k = c["overall"]["predicted_speedup"][c["k_measured"]]
        per_round = " /round" if s["draft_cost_shape"] == "per_round" else ""
        draft_ms = "-" if s["draft_time_per_round_s"] is None else f"{s['draft_time_per_round_s'] * 1e3:.2f} ms"
        lines.append(f"| {_label(c)} | {s['draft_cost_ratio']:.3f}{per_round} | {draft_ms} | "
                     f"{s['acceptance_rate']:.1%} | "
                     f"{s['mean_acceptance_length']:.2f} | {s['best_k']} | {s['predicted_speedup']:.2f}x | "
                     f"{at_k:.2f}x / {s['measured_speedup_at_k_max']:.2f}x |")
    for c in profile["configs"]:
        per_round = c.get("draft_cost_per_round")
        lines += ["", f"## {_label(c)}: per category", ""]
        if per_round:
            lines += ["Draft cost per round, k = 1..K, in 1-token target steps ("
                      + ("one forward whatever k" if c.get("draft_cost_shape") == "per_round" else "k draft steps")
                      + "): " + ", ".join(f"{x:.3f}" for x in per_round[1:]) + ".", ""]
        lines += ["| category | prompts | α_1..α_K | τ | plain tok/s | spec tok/s (k_max) | best k | S(best k) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for cat, e in c["categories"].items():
            alphas = " ".join(f"{a:.2f}" for a in e["alpha_conditional"])
            lines.append(f"| {cat} | {e['num_prompts']} | {alphas} | {e['mean_acceptance_length']:.2f} | "
                         f"{e['plain_tokens_per_s']:.1f} | {e['spec_tokens_per_s']:.1f} | {e['best_k']} | "
                         f"{e['best_speedup']:.2f}x |")
    lines += _markdown_by_category(profile)
    rec = summary["recommendation"]
    if rec:
        lines += ["", "## Recommendation", "",
                  f"{rec['reason']}: `{json.dumps(rec['speculative_config'])}` "
                  f"(predicted {rec['predicted_speedup']:.2f}x)."]
    v = summary["validation"]
    if v:
        lines += ["", f"Run at k={v['k']} against plain decoding in the same process: measured "
                      f"**{v['measured_speedup']:.2f}x** ({v['spec_tokens_per_s']:.1f} vs {v['plain_tokens_per_s']:.1f}"
                      f" tokens/s); predicted {v['predicted_speedup']:.2f}x (error {_pct(v['relative_error'])}), "
                      f"{v['predicted_speedup_end_to_end']:.2f}x end to end (prefill and loop overhead included) "
                      f"(error {_pct(v['relative_error_end_to_end'])})."]
    if profile.get("sweep"):
        lines += ["", "| k | predicted S(k) | predicted end to end | measured | error (end to end) |",
                  "| --- | --- | --- | --- | --- |"]
        for r in profile["sweep"]:
            err = (r["predicted_speedup_end_to_end"] - r["measured_speedup"]) / r["measured_speedup"]
            lines.append(f"| {r['k']} | {r['predicted_speedup']:.2f}x | {r['predicted_speedup_end_to_end']:.2f}x | "
                         f"{r['measured_speedup']:.2f}x | {err:+.0%} |")
    lines += [""] + [f"![{name}]({name})" for name in FIGURES] + [""]
    return "\n".join(lines)


def _markdown_by_category(profile: dict) -> list[str]:
    by_cat = profile["by_category"]
    if not by_cat:
        return []
    K = profile["k_max"]
    lines = ["", "## Per category: which drafter", "",
             "Engines that take one speculative method per deployment (vLLM, SGLang, TensorRT-LLM, llama.cpp) "
             "need one deployment per category (or a router in front) to use a different drafter per category; "
             "`specdec export --by-category` writes those settings. ★ marks the recommended drafter. A method "
             "list is also measured as itself (choice: specdec's per-request choice among its methods), measured "
             "only: the cost model's one c per drafted token does not describe a mix of methods.", "",
             f"| category | prompts | drafter | acceptance | τ (k={K}) | S(k={K}) predicted / measured | best k "
             "| S(best k) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cat, e in by_cat.items():
        rec = e["recommendation"]
        for r in e["drafters"]:
            star = " ★" if not rec["plain"] and r["config_index"] == rec["config_index"] else ""
            pred = ("-", "-", "-") if r["choice"] else (  # a choice's cost per drafted token mixes its methods'
                f"{r['predicted_speedup_at_k_max']:.2f}x", str(r["best_k"]), f"{r['best_speedup']:.2f}x")
            lines.append(f"| {cat} | {e['num_prompts']} | {r['label']}{star} | {r['acceptance_rate']:.1%} | "
                         f"{r['mean_acceptance_length']:.2f} | {pred[0]} / {r['measured_speedup_at_k_max']:.2f}x | "
                         f"{pred[1]} | {pred[2]} |")
    v = profile.get("validation")
    single = (f"{profile['configs'][profile['recommendation']['config_index']].get('label', '')}, k={v['k']} "
              "for all, measured" if v else "one setting for all, measured")
    lines += ["", f"| category | recommended | predicted | measured | {single} |", "| --- | --- | --- | --- | --- |"]
    for cat, e in by_cat.items():
        rec, val = e["recommendation"], e.get("validation")
        pick = "plain decoding" if rec["plain"] else f"{rec['label']}, k={rec['k']}"
        measured = f"{val['measured_speedup']:.2f}x" if val and val.get("measured_speedup") is not None else "-"
        single = val.get("all_prompts_setting_measured_speedup") if val else None
        lines.append(f"| {cat} | {pick} | {rec['predicted_speedup']:.2f}x | {measured} | "
                     + (f"{single:.2f}x" if single is not None else "-") + " |")
    return lines


def _html(profile: dict, summary: dict, folder: Path) -> str:
    body = []
    md = _markdown(profile, summary).splitlines()
    table: list[str] = []

    def flush_table():
        if not table:
            return
        rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table if not set(line) <= set("|- ")]
        out = ["<table>"]
        for i, row in enumerate(rows):
            tag = "th" if i == 0 else "td"
            out.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row) + "</tr>")
        out.append("</table>")
        body.append("\n".join(out))
        table.clear()

    for line in md:
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("!["):
            name = line[line.index("(") + 1: line.rindex(")")]
            data = base64.b64encode((folder / name).read_bytes()).decode()
            body.append(f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{html.escape(name)}</figcaption></figure>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.strip():
            text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(line))
            text = re.sub(r"`(.+?)`", r"<code>\1</code>", text)
            body.append(f"<p>{text}</p>")
    flush_table()
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;"
             "text-align:right}th{background:#f4f4f4}img{max-width:100%}figure{margin:1.5em 0}")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>specdec profile</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
