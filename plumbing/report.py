"""The run report: one self-contained HTML page per run directory, and what the scripts write for it.

    python -m plumbing.report runs/bandit-starpo-s-gae-s0      # (re)builds runs/bandit-starpo-s-gae-s0/report.html

The scripts call `build_report(output_dir)` at every evaluation and at the end; the page is rewritten atomically,
so a browser refresh during training never sees half a file. It reads config.json, metrics.jsonl, rollouts.jsonl,
groups.jsonl and collapse.jsonl (any of them may be missing or still being written) and shows:

* a header: task, algorithm, model, key settings, steps run, wall time, best and last val/success;
* curves drawn here as inline SVG: success (with the random / optimal baselines, dashed, where the script logs
  them), reward, in-group reward std before and after the filter, entropy, gradient norm, response and think
  length, clip fractions, every rubric component (titled with its weight) and, when the run measures it, the
  mutual information between prompt and reasoning beside the entropy. A warning (run.collapse_warnings) draws a
  dashed vertical, in its own colour, on the charts of its kind only. Hover a point for its value;
* the uncertainty filter (groups.jsonl): every group's statistic at a step you pick, the kept groups coloured, and
  the kept ratio and skipped (empty) steps over training;
* template collapse (collapse.jsonl): the latest reasoning-by-prompt log-prob matrix as a heatmap;
* a rollout viewer (a little vanilla JavaScript): pick a split, a step and a trajectory; each turn shows the grid as
  coloured cells (the bandit: its two arms, the chosen one highlighted), the reply with <think> and <answer>
  highlighted, the actions (a move the ice sent another way marked "slipped"), the reward and the rubric breakdown.

Standard library only. No network: no external files, and a Content-Security-Policy that allows only this page's
own script. Model text never reaches the page as markup: it is html-escaped, or embedded as JSON with every `<`
written as \\u003c (so "</script>" in a reply cannot end the data block) and drawn with textContent.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
import re
import sys
import time
from pathlib import Path

MAX_ROLLOUTS_PER_SPLIT = 200  # embedded in the page; more would make it slow to open
MAX_ROLLOUTS_PER_STEP = 24
MAX_TEXT = 4000  # characters kept of each state / reply
LOGS_PER_STEP = ("groups.jsonl", "collapse.jsonl")  # Run.log_groups / log_collapse: one line per (measured) step

########################################################################################################################
# WRITING A RUN — what the scripts log for the report: rollout records and the episode statistics
########################################################################################################################


def rollout_record(t, step: int, split: str, task: str) -> dict:
    """One line of rollouts.jsonl for a multi-turn script's Trajectory t: the episode turn by turn, with the
    environment's own view of every state (env.describe()), so the report draws it without knowing the task.
    score = rubric total, env_reward = payout. (The bandit writes its one-turn records itself.)"""
    turns = [
        dict(
            state=turn.state,
            view=turn.before,
            text=turn.text,
            think=turn.think,
            world=turn.world,
            answer=turn.answer,
            actions=turn.actions,
            env_reward=turn.payout,
            score=turn.reward,
            rubric=turn.parts,
        )
        for turn in t.turns
    ]
    for rec, turn in zip(turns, t.turns):  # FrozenLake's info["slipped"]: one bool per action, where a move slipped
        if any(i.get("slipped") for i in turn.infos):
            rec["slipped"] = [bool(i.get("slipped")) for i in turn.infos]
    final = t.turns[-1].after if t.turns else None  # the world after the last move: a solved room, a goal reached
    return dict(
        step=step,
        split=split,
        task=task,
        seed=t.seed,
        success=bool(t.success),
        score=t.score,
        env_reward=sum(turn.payout for turn in t.turns),
        turns=turns,
        final_view=final,
    )


def single_turn_record(t, step: int, split: str, task: str) -> dict:
    """rollout_record for a one-turn task (the bandit's Trajectory t: t.turn, t.state, t.view): the same schema,
    one turn. score = rubric total, env_reward = payout."""
    s = t.turn
    turn = dict(
        state=t.state,
        view=t.view,
        text=s.text,
        think=s.think,
        answer=s.answer,
        actions=[s.answer.strip()] if s.info["action_is_valid"] else [],
        env_reward=s.payout,
        score=t.score,
        rubric=t.parts,
    )
    return dict(
        step=step,
        split=split,
        task=task,
        seed=t.seed,
        success=bool(s.info["success"]),
        score=t.score,
        env_reward=s.payout,
        turns=[turn],
        final_view=None,
    )


########################################################################################################################
# READING A RUN
########################################################################################################################


def read_jsonl(path: Path) -> list[dict]:
    """One dict per line; a missing file is empty and a broken line (a run still writing) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)  # accepts NaN / Infinity, as json.dumps writes them
        except ValueError:
            continue
        if isinstance(row, dict) and number(row.get("step")) is not None:
            out.append(row)
    return out


def latest_per_step(rows: list[dict], key) -> list[dict]:
    """Rows sorted by step, each step's lines taken from its latest block in the file.

    A fresh run starts with empty files and --resume truncates them to the checkpoint, so a step normally appears
    once; should one appear twice anyway (say, a resume after a crash that skipped the truncation), the later
    block of lines for it wins. key(row) names a block: the step (metrics) or (split, step) (rollouts)."""
    blocks: dict = {}
    prev = object()
    for row in rows:
        k = key(row)
        if k != prev:
            blocks[k] = []  # a new block for this key replaces an earlier one
        blocks[k].append(row)
        prev = k
    return sorted((row for block in blocks.values() for row in block), key=lambda row: row["step"])  # stable


def load_run(run_dir: Path) -> tuple[dict, list[dict], list[dict], list[dict], list[dict]]:
    """config, then metrics, rollouts, groups and collapse rows (each jsonl file: one step's latest lines, by step)."""
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    metrics = latest_per_step(read_jsonl(run_dir / "metrics.jsonl"), lambda r: r["step"])
    rollouts = latest_per_step(read_jsonl(run_dir / "rollouts.jsonl"), lambda r: (str(r.get("split")), r["step"]))
    groups, collapse = (latest_per_step(read_jsonl(run_dir / f), lambda r: r["step"]) for f in LOGS_PER_STEP)
    return (config if isinstance(config, dict) else {}), metrics, rollouts, groups, collapse


def infer_task(config: dict, rollouts: list[dict], run_dir: Path) -> str:
    if config.get("task"):
        return str(config["task"])
    if rollouts and rollouts[0].get("task"):
        return str(rollouts[0]["task"])
    name = run_dir.resolve().name  # e.g. bandit-starpo-s-gae-s0
    return next((t for t in ("bandit", "frozenlake", "sokoban") if name.startswith(t)), name)


def number(v) -> float | None:
    """A plottable float, or None (missing, NaN, inf, not a number)."""
    if isinstance(v, (bool, int, float)) and math.isfinite(v):
        return float(v)
    return None


def series(metrics: list[dict], key: str) -> list[tuple[float, float | None]]:
    """(step, value) for every line that has the key; None (a NaN) breaks the line."""
    return [(r["step"], number(r[key])) for r in metrics if key in r]


########################################################################################################################
# SVG LINE CHARTS — drawn here, so the page needs no charting library
########################################################################################################################

COLOURS = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#db2777"]  # train is always the first (blue)
BASELINE_COLOURS = {"random": "#6b7280", "optimal": "#059669"}
WARN_COLOUR = "#dc2626"
# warn/<kind> (run.collapse_warnings) -> the colour of its markers; each chart names the kinds it concerns
WARNINGS = {
    "echo_trap": WARN_COLOUR,
    "gradient_spike": "#d97706",
    "template_collapse": "#c026d3",
    "reward_hacking": "#0f766e",
}
SKIP_COLOUR = "#6b7280"  # a step the filter left empty (nothing trained)
KEPT_COLOUR, DROPPED_COLOUR = "#0d9488", "#cbd5e1"  # the filter view's bars
HEAT_LOW, HEAT_HIGH = (247, 251, 255), (8, 48, 107)  # the heatmap's colour scale, low to high log-prob (RGB)
OWN_COLOUR = "#f59e0b"  # the heatmap's outline of each reasoning's own prompt
W, H, LEFT, RIGHT, TOP, BOTTOM = 420, 230, 60, 14, 30, 36  # chart size and margins, px


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values (1, 2, 2.5, 5 x 10^k apart) covering [lo, hi]."""
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw - 1e-12)
    first = math.floor(lo / step + 1e-9) * step
    count = int(math.ceil((hi - first) / step - 1e-9)) + 1
    return [round(first + i * step, 12) for i in range(count)]


def fmt(v: float) -> str:
    return "0" if v == 0 else f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2g}"


def esc(s) -> str:
    """Text or attribute value for the page; U+2028/9 as entities too, so no raw line separator is left anywhere."""
    return html.escape(str(s), quote=True).replace("\u2028", "&#x2028;").replace("\u2029", "&#x2029;")


def slug_of(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def line_chart(
    title: str, lines: list, x_range: tuple, baselines=(), marks=(), y_fixed=None, ylabel="", note=""
) -> str:
    """One chart as a <figure>. lines: (label, [(step, value or None)], colour); baselines: (label, value, colour),
    drawn as dashed horizontals; marks: (step, label, colour), dashed verticals (a warning, a skipped step); note: a
    line under the chart."""
    values = [y for _, pts, _ in lines for _, y in pts if y is not None] + [v for _, v, _ in baselines]
    head = f'<figure class="chart" data-chart="{esc(slug_of(title))}"><figcaption>{esc(title)}</figcaption>'
    if not values:
        return head + '<div class="empty">no data yet</div></figure>'
    lo, hi = y_fixed or (min(0.0, *values), max(0.0, *values))
    if hi - lo < 1e-12:  # all zero (zero is always in range): show 0..1
        hi = lo + 1
    yt = nice_ticks(lo, hi)
    lo, hi = min(lo, yt[0]), max(hi, yt[-1])
    x0, x1 = x_range
    xt = [t for t in nice_ticks(x0, x1, 6) if x0 <= t <= x1 and t == int(t)] or [x0]
    px = lambda x: LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT)  # noqa: E731 (data -> pixels)
    py = lambda y: H - BOTTOM - (y - lo) / (hi - lo) * (H - TOP - BOTTOM)  # noqa: E731
    out = [head, f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{esc(title)}">']
    for t in yt:  # horizontal grid lines with y tick labels
        out.append(
            f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" class="tick" text-anchor="end">{fmt(t)}</text>'
        )
    for t in xt:
        out.append(
            f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{H - BOTTOM}" y2="{H - BOTTOM + 4}" class="axis"/>'
            f'<text x="{px(t):.1f}" y="{H - BOTTOM + 16}" class="tick" text-anchor="middle">{int(t)}</text>'
        )
    out.append(
        f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP - 6}" y2="{H - BOTTOM}" class="axis"/>'
        f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{H - BOTTOM}" y2="{H - BOTTOM}" class="axis"/>'
        f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 4}" class="label" text-anchor="middle">step</text>'
        f'<text transform="translate(11 {(TOP + H - BOTTOM) / 2}) rotate(-90)" class="label" '
        f'text-anchor="middle">{esc(ylabel)}</text>'
    )
    for step, label, colour in marks:
        out.append(
            f'<g class="mark" data-mark="{esc(slug_of(label))}"><title>{esc(label)} at step {int(step)}</title>'
            f'<line x1="{px(step):.1f}" x2="{px(step):.1f}" y1="{TOP}" y2="{H - BOTTOM}" stroke="{colour}" '
            f'stroke-dasharray="3 3" stroke-width="1.5"/><path d="M{px(step) - 5:.1f},{TOP - 8} h10 l-5,8 z" '
            f'fill="{colour}"/></g>'
        )
    for label, v, colour in baselines:
        out.append(
            f'<line class="baseline" x1="{LEFT}" x2="{W - RIGHT}" y1="{py(v):.1f}" y2="{py(v):.1f}" '
            f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="6 4">'
            f'<title>{esc(label)} {fmt(v)}</title></line>'
        )
    for label, pts, colour in lines:
        segment: list[str] = []
        for x, y in pts + [(None, None)]:  # a None value (NaN) ends the current segment
            if y is not None:
                segment.append(f"{px(x):.1f},{py(y):.1f}")
            elif segment:
                out.append(
                    f'<polyline points="{" ".join(segment)}" fill="none" stroke="{colour}" stroke-width="2" '
                    f'stroke-linejoin="round"/>'
                )
                segment = []
        if len(pts) <= 60:  # dots (with a hover title) while they do not clutter the line
            out += [
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.8" fill="{colour}">'
                f'<title>{esc(label)} step {int(x)}: {y:.4g}</title></circle>'
                for x, y in pts
                if y is not None
            ]
    legend = [(label, colour, "") for label, _, colour in lines] + [(label, c, "6 4") for label, _, c in baselines]
    legend += list({label: (label, colour, "3 3") for _, label, colour in marks}.values())  # one entry per kind
    x = LEFT + 6
    for label, colour, dash in legend:  # one row of "—— label" along the top
        out.append(
            f'<line x1="{x}" x2="{x + 16}" y1="{TOP - 16}" y2="{TOP - 16}" stroke="{colour}" stroke-width="2.5" '
            f'stroke-dasharray="{dash}"/><text x="{x + 20}" y="{TOP - 12}" class="legend">{esc(label)}</text>'
        )
        x += 30 + 6.2 * len(label)
    tail = f'<div class="note">{esc(note)}</div>' if note else ""
    return "\n".join(out) + "</svg>" + tail + "</figure>"


CLIP_NOTE = (
    "All zero, as expected when each step's rows are trained in one optimizer step on the policy that sampled them "
    "(one PPO epoch, one mini-batch): every ratio is then 1. More epochs or smaller mini-batches move it."
)


def chart_maker(metrics: list[dict]):
    """chart(title, [(key, label)], ylabel, ...) -> one line_chart of these metrics on the run's step axis, with the
    markers of the warning kinds it concerns (warn) and any other marks (step, label, colour)."""
    steps = [r["step"] for r in metrics]
    x_range = (min(steps), max(steps)) if steps else (0, 1)
    if x_range[1] - x_range[0] < 1:
        x_range = (x_range[0], x_range[0] + 1)
    fired = {kind: [r["step"] for r in metrics if number(r.get(f"warn/{kind}")) == 1] for kind in WARNINGS}

    def chart(title, keys, ylabel, y_fixed=None, baselines=(), note="", warn=(), marks=()):
        lines = [(label, series(metrics, k), COLOURS[i]) for i, (k, label) in enumerate(keys) if series(metrics, k)]
        base = []
        for key, label in baselines:  # the evaluation maps are fixed, so a baseline is one value: the last logged
            vals = [v for _, v in series(metrics, key) if v is not None]
            if vals:
                base.append((label, vals[-1], BASELINE_COLOURS[label]))
        marks = [*marks, *((s, kind.replace("_", " "), WARNINGS[kind]) for kind in warn for s in fired[kind])]
        return line_chart(title, lines, x_range, base, marks, y_fixed, ylabel, note)

    return chart


# The mutual-information diagnostics (RAGEN's CollapseDetector), drawn beside the entropy when the run logs them:
# entropy collapse is a low H(R | prompt) (R: the reasoning), template collapse a low MI = H(R) - H(R | prompt).
COLLAPSE_CHARTS = [
    ("Mutual information", [("mi_estimate", "MI"), ("mi_seq_estimate", "MI seq"), ("mi_upper_bound", "bound")], "nats"),
    ("MI z-score", [("mi_zscore", "z-score"), ("mi_zscore_ema", "EMA")], "z"),
    ("Retrieval accuracy", [("retrieval_accuracy", "accuracy"), ("retrieval_chance_level", "chance")], "share"),
    ("Reasoning entropy", [("conditional_entropy_est", "H(R | prompt)"), ("reasoning_entropy_est", "H(R)")], "nats"),
    ("Valid thinking", [("valid_thinking_rate", "turns with a think")], "share"),
]  # the other collapse/* numbers (per-sequence twins, @k retrieval, counts) stay in metrics.jsonl, uncharted


def charts(metrics: list[dict], config: dict) -> list[str]:
    """The fixed set of curves (every one present, maybe empty), the collapse/* charts beside the entropy when the
    run logs them, then one chart per rubric component titled with its weight (config.json's "component_weights")."""
    chart, echo, tc = chart_maker(metrics), ("echo_trap",), ("template_collapse",)
    clip_values = [v for _, v in series(metrics, "actor/pg_clipfrac") if v is not None]
    logged = {k for r in metrics for k in r}
    named = {f"collapse/{k}" for _, keys, _ in COLLAPSE_CHARTS for k, _ in keys}
    collapse = [chart(t, [(f"collapse/{k}", label) for k, label in keys], y, warn=tc) for t, keys, y in COLLAPSE_CHARTS]
    out = [
        chart(
            "Success",
            [("train/success", "train"), ("val/success", "val")],
            "success rate",
            (0.0, 1.0),
            [("val/random_success", "random"), ("val/optimal_success", "optimal")],
            warn=echo,
        ),
        chart("Reward", [("train/reward", "train"), ("val/reward", "val")], "rubric total"),
        chart(
            "In-group reward std",
            [("rollout/in_group_std", "before filter"), ("rollout/chosen_in_group_std", "after filter")],
            "std",
            warn=echo,
        ),
        chart("Entropy", [("actor/entropy", "policy entropy")], "nats / token", warn=echo + tc),
        *(collapse if named & logged else []),
        chart("Gradient norm", [("actor/grad_norm", "before clipping")], "L2 norm", warn=("gradient_spike",)),
        chart(
            "Response and think length",
            [("response_length/mean", "reply (tokens)"), ("think_length/mean", "think (chars)")],
            "length",
        ),
        chart(
            "Clip fractions",
            [("actor/pg_clipfrac", "clipped"), ("actor/pg_clipfrac_lower", "dual clip")],
            "share of tokens",
            note=CLIP_NOTE if clip_values and not any(clip_values) else "",
        ),
    ]
    if "judge/agreement" in logged or "judge/fail_frac" in logged:  # the judge against the truth (plumbing/judge.py)
        judge_keys = [
            ("judge/agreement", "agreement"),
            ("judge/false_positive", "false yes"),
            ("judge/false_negative", "false no"),
        ]
        out.append(
            chart(
                "Judge against the truth",
                [*judge_keys, ("val/success", "val/success")],
                "share",
                (0.0, 1.0),
                warn=("reward_hacking",),
            )
        )
        out.append(
            chart("Judge failures", [("judge/fail_frac", "failed judgements")], "share of questions", (0.0, 1.0))
        )
    shares = sorted(k for k in logged if k.startswith("adv_share/"))
    if shares:  # each weighted component's share of the advantage (--rubric-norm's two ways to mix them)
        out.append(
            chart(
                "Advantage share by component",
                [(k, k.removeprefix("adv_share/")) for k in shares[:6]],
                "share",
                (0.0, 1.0),
            )
        )
    weights = config.get("component_weights") if isinstance(config.get("component_weights"), dict) else {}
    for k in sorted(k for k in logged if k.startswith("rubric/")):
        w = number(weights.get(k.removeprefix("rubric/")))
        title = k + ("" if w is None else f"  (weight {fmt(w)})")
        out.append(chart(title, [(k, "train")], "mean (unweighted)", warn=("reward_hacking",)))
    return out


def gigpo_charts(metrics: list[dict]) -> str:
    """What GiGPO's state groups held (--estimator gigpo, plumbing.metrics.gigpo_stats): their sizes and the share of
    turns alone in their state, and the mean |A_S| by turn over training. Empty for the other estimators."""
    logged = sorted(
        {k for r in metrics for k in r if k.startswith("gigpo/abs_step_adv_turn_")}, key=lambda k: int(k.split("_")[-1])
    )
    if not logged:
        return ""
    chart = chart_maker(metrics)
    picked = sorted({0, 1, len(logged) // 2, len(logged) - 1} & set(range(len(logged))))  # turns 1, 2, mid, last
    by_turn = [(logged[i], "turn " + logged[i].split("_")[-1]) for i in picked]  # (a chart has six colours)
    return (
        chart(
            "GiGPO state groups",
            [("gigpo/step_group_size_mean", "mean size"), ("gigpo/step_group_size_max", "largest")],
            "turns per state",
        )
        + chart("GiGPO singletons", [("gigpo/singleton_frac", "turns alone in their state")], "share", (0.0, 1.0))
        + chart("GiGPO step advantage by turn", [("gigpo/abs_step_adv_mean", "all turns"), *by_turn], "mean |A_S|")
    )


def filter_section(metrics: list[dict], groups: list[dict]) -> str:
    """The uncertainty filter: a picked step's groups as bars (drawn by the page's script from DATA.groups), the kept
    ratio and the skipped steps over training, and GiGPO's state groups beside them (gigpo_charts). Empty when the run
    logs neither groups.jsonl nor the filter metrics."""
    if not groups and not series(metrics, "rollout/filter_kept_ratio"):
        return ""
    chart = chart_maker(metrics)
    skipped = [
        (r["step"], "skipped step", SKIP_COLOUR) for r in metrics if number(r.get("rollout/empty_after_filter")) == 1
    ]
    bars = (
        '<figure class="chart groups"><figcaption id="group-caption"></figcaption><label class="muted">step '
        '<select id="group-step"></select></label><div id="group-bars"></div><div class="legend-row">'
        f'<span><i class="swatch" style="background:{KEPT_COLOUR}"></i> kept (trained on)</span>'
        f'<span><i class="swatch" style="background:{DROPPED_COLOUR}"></i> dropped</span></div></figure>'
        if groups
        else ""
    )
    return (
        '<h2 id="filter">Uncertainty filter</h2><div class="charts">'
        + bars
        + chart(
            "Kept groups", [("rollout/filter_kept_ratio", "kept ratio")], "share of groups", (0.0, 1.0), marks=skipped
        )
        + chart(
            "Empty after filter",
            [("rollout/empty_after_filter", "skipped"), ("rollout/consecutive_empty_after_filter_steps", "in a row")],
            "steps",
            marks=skipped,
        )
        + gigpo_charts(metrics)
        + "</div>"
    )


def group_rows(groups: list[dict]) -> list[dict]:
    """groups.jsonl for the page: per step, every group's statistic (4 significant digits) and the kept indices."""
    out = []
    for g in groups:
        if isinstance(g.get("values"), list):
            values = [None if (v := number(x)) is None else float(f"{v:.4g}") for x in g["values"]]
            kept = [k for k in g.get("kept") or [] if isinstance(k, int) and 0 <= k < len(values)]
            meta = {k: str(g.get(k, "?")) for k in ("stat", "strategy", "value")}
            out.append(dict(step=g["step"], values=values, kept=kept, **meta))
    return out


def heatmap(row: dict) -> str:
    """One collapse.jsonl line as an SVG heatmap: row r is reasoning r scored under every prompt (its per-token mean
    log-prob), its own prompt's cell outlined and the cell it scores best under dotted. "" when malformed."""
    m, cols, prompts = row.get("matrix"), row.get("cols"), row.get("prompts")
    if not (isinstance(m, list) and m and all(isinstance(r, list) and len(r) == len(m[0]) > 0 for r in m)):
        return ""
    R, N = len(m), len(m[0])
    cols = [c if isinstance(c, int) and 0 <= c < N else None for c in (cols if isinstance(cols, list) else [])]
    cols += [None] * (R - len(cols))
    names = [str(p)[:20] for p in (prompts if isinstance(prompts, list) else [])][:N]
    names += [f"prompt {j}" for j in range(len(names), N)]
    vals = [[number(v) for v in r] for r in m]
    finite = [v for r in vals for v in r if v is not None]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    hi = hi if hi > lo else lo + 1

    def shade(v: float) -> str:  # lo -> HEAT_LOW, hi -> HEAT_HIGH
        return "rgb({},{},{})".format(*(round(a + (b - a) * (v - lo) / (hi - lo)) for a, b in zip(HEAT_LOW, HEAT_HIGH)))

    cw, ch, left, top = 44, max(6, min(22, 400 // R)), 56, 24 + 4 * max(map(len, names))  # room for slanted names
    width, height = left + N * cw + 110, top + max(R * ch, 140) + 10
    out = [f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" aria-label="heatmap">']
    for j, name in enumerate(names):  # column labels, slanted
        x = left + j * cw + cw / 2
        out.append(f'<text transform="translate({x:.0f} {top - 6}) rotate(-40)" class="tick">{esc(name)}</text>')
    hits = 0
    for r, (cells, own) in enumerate(zip(vals, cols)):
        y = top + r * ch
        if R <= 24 or r % 5 == 0:
            out.append(f'<text x="{left - 6}" y="{y + ch / 2 + 3:.1f}" class="tick" text-anchor="end">{r}</text>')
        for j, v in enumerate(cells):
            fill = "#e5e7eb" if v is None else shade(v)
            title = f"reasoning {r} (from {names[own] if own is not None else '?'}) under {names[j]}: "
            out.append(
                f'<rect x="{left + j * cw}" y="{y}" width="{cw}" height="{ch}" fill="{fill}">'
                f"<title>{esc(title)}{'—' if v is None else f'{v:.3f}'}</title></rect>"
            )
        if own is not None:
            out.append(
                f'<rect class="own" x="{left + own * cw + 1}" y="{y + 1}" width="{cw - 2}" height="{ch - 2}" '
                f'fill="none" stroke="{OWN_COLOUR}" stroke-width="2"/>'
            )
        if any(v is not None for v in cells):
            best = max((j for j, v in enumerate(cells) if v is not None), key=lambda j: cells[j])
            hits += best == own
            out.append(
                f'<circle cx="{left + best * cw + cw / 2}" cy="{y + ch / 2}" r="{min(3.5, ch / 3):.1f}" fill="#111827" '
                'stroke="#ffffff" stroke-width="1"/>'
            )
    x = left + N * cw + 24  # the colour scale: high at the top
    out.append(f'<text x="{x}" y="{top - 8}" class="label">log-prob</text>')
    for i in range(10):
        v = hi - (hi - lo) * i / 9
        out.append(f'<rect x="{x}" y="{top + i * 14}" width="18" height="14" fill="{shade(v)}"/>')
    out.append(
        f'<text x="{x + 24}" y="{top + 10}" class="tick">{fmt(hi)}</text>'
        f'<text x="{x + 24}" y="{top + 136}" class="tick">{fmt(lo)}</text></svg>'
    )
    note = (
        f"{R} reasonings (rows) scored under each of {N} prompts (columns). Outlined: the prompt the reasoning came "
        f"from; dot: the prompt it scores best under. {hits} of {R} rows pick their own prompt (chance "
        f"{1 / N:.2f}). When the reasoning stops depending on the prompt, the columns look alike and the dots scatter."
    )
    return (
        f'<figure class="chart heatmap"><figcaption>Reasoning × prompt log-probs, step {int(row["step"])}</figcaption>'
        + "".join(out)
        + f'<div class="note">{esc(note)}</div></figure>'
    )


def collapse_section(collapse: list[dict]) -> str:
    """The latest collapse.jsonl matrix as a heatmap; "" when the run has none (no empty heading)."""
    drawn = heatmap(collapse[-1]) if collapse else ""
    return f'<h2 id="collapse">Template collapse</h2><div class="charts">{drawn}</div>' if drawn else ""


########################################################################################################################
# GRIDS AND ARMS — each rollout record carries the environment's own view of every state (env.describe())
########################################################################################################################

# What a cell shows, by the name the environment's legend gives it -> (cell fill, what is drawn on it). Shared by
# every task: a new environment whose legend says "wall", "player", "goal", ... is drawn with no change here, and
# a name not listed gets a colour of its own (a stable hash of the name). One source for the page and the tests.
CELL_STYLE = {
    "wall": ["#57534e", ""],
    "floor": ["#f5f5f4", ""],
    "target": ["#f5f5f4", "target"],
    "box": ["#f5f5f4", "box"],
    "box on target": ["#f5f5f4", "box-on-target"],
    "player": ["#e0e7ff", "player"],
    "player on target": ["#f5f5f4", "player-on-target"],
    "frozen": ["#bfdbfe", ""],
    "hole": ["#1e3a8a", ""],
    "goal": ["#22c55e", ""],
    "player in a hole": ["#1e3a8a", "fallen"],
    "player on goal": ["#22c55e", "player"],
}
# what stands on a cell (see CELL_STYLE) -> its colour
THING_COLOURS = {
    "player": "#2563eb",
    "fallen": "#dc2626",
    "box": "#b45309",
    "box-on-target": "#16a34a",
    "target": "#dc2626",
}
ARM_CHOSEN_COLOUR = "#fcd34d"


def cell_style(name: str) -> list[str]:
    if name in CELL_STYLE:
        return CELL_STYLE[name]
    h = int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)
    return [f"hsl({h % 360}, 55%, 70%)", ""]


def grid_of(view) -> dict | None:
    """A drawable grid from env.describe(): rows of symbols, and per symbol its legend name and style."""
    if not isinstance(view, dict) or not isinstance(view.get("grid"), list):
        return None
    rows = [[str(c) for c in row] for row in view["grid"] if isinstance(row, list)]
    legend = {str(k): str(v) for k, v in (view.get("legend") or {}).items()}
    if not rows:
        return None
    return {"rows": rows, "legend": legend, "style": {sym: cell_style(name) for sym, name in legend.items()}}


def arms_of(view) -> dict | None:
    """The bandit's arms from env.describe(): the names in the order shown, and which one is high-risk."""
    if not isinstance(view, dict) or not isinstance(view.get("arms"), list):
        return None
    return {"names": [str(a) for a in view["arms"]], "high": str(view.get("high_arm") or "")}


def clip_text(s, n: int = MAX_TEXT):
    s = "" if s is None else str(s)
    return s if len(s) <= n else s[:n] + f" … [{len(s) - n} more characters]"


def viewer_rollouts(rollouts: list[dict]) -> tuple[list[dict], int]:
    """A capped, compact copy for the page: per split, up to MAX_ROLLOUTS_PER_STEP per step, on evenly spaced steps
    (first and last included) so that at most MAX_ROLLOUTS_PER_SPLIT are kept. Returns (kept, total)."""
    by_split: dict[str, dict[int, list[dict]]] = {}
    for r in rollouts:
        by_split.setdefault(str(r.get("split", "train")), {}).setdefault(r["step"], []).append(r)
    kept, k = [], max(2, MAX_ROLLOUTS_PER_SPLIT // MAX_ROLLOUTS_PER_STEP)  # k: how many steps fit
    for split, by_step in by_split.items():
        steps = sorted(by_step)
        if len(steps) > k:
            steps = sorted({steps[round(i * (len(steps) - 1) / (k - 1))] for i in range(k)})
        for step in steps:
            for r in by_step[step][:MAX_ROLLOUTS_PER_STEP]:
                turns = []
                for t in r.get("turns") or []:
                    t = t if isinstance(t, dict) else {}
                    state, answer = clip_text(t.get("state")), t.get("answer")
                    turns.append(
                        dict(
                            state=state,
                            text=clip_text(t.get("text")),
                            answer=None if answer is None else clip_text(answer),
                            actions=[str(a) for a in t.get("actions") or []],
                            slipped=[bool(x) for x in t.get("slipped") or []],  # per action: the ice chose the way
                            env_reward=number(t.get("env_reward")),
                            score=number(t.get("score")),
                            rubric={str(k): number(v) for k, v in (t.get("rubric") or {}).items()},
                            grid=grid_of(t.get("view")),
                            arms=arms_of(t.get("view")),
                        )
                    )
                seed = r.get("seed")
                kept.append(
                    dict(
                        step=r["step"],
                        split=split,
                        seed=seed if isinstance(seed, (int, str)) else str(seed),
                        success=bool(r.get("success")),
                        score=number(r.get("score")),
                        env_reward=number(r.get("env_reward")),
                        turns=turns,
                        final_grid=grid_of(r.get("final_view")),
                    )
                )
    return kept, len(rollouts)


def json_for_script(obj) -> str:
    """JSON safe inside <script type="application/json">: no '<' at all (so no </script> or <!--), no raw U+2028/9."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


########################################################################################################################
# THE PAGE
########################################################################################################################

KEY_SETTINGS = [
    "algo",
    "estimator",
    "n_groups",
    "group_size",
    "keep_ratio",
    "lr",
    "critic_lr",
    "kl_coef",
    "clip_low",
    "clip_high",
    "dual_clip",
    "entropy_coef",
    "loss_agg",
    "temperature",
    "max_tokens",
    "max_turns",
    "max_actions_per_traj",
    "val_size",
    "eval_every",
    "seed",
    "backend",
    "device",
]


def header(config: dict, metrics: list[dict], task: str, run_dir: Path) -> str:
    model = config.get("model") or "?"
    if model == "auto" or model == "tiny":
        model = f"{model}: {Path(str(config.get('model_path', ''))).name or '?'}"
    steps_run = max((r["step"] for r in metrics), default=0)
    wall = max((number(r.get("time_s")) or 0.0 for r in metrics), default=0.0)
    val = [(r["step"], v) for r in metrics if (v := number(r.get("val/success"))) is not None]
    best = max(val, key=lambda sv: sv[1]) if val else None
    warn = [
        f"{kind.replace('_', ' ')}: " + ", ".join(f"step {s}" for s in steps)
        for kind in WARNINGS
        if (steps := [r["step"] for r in metrics if number(r.get(f"warn/{kind}")) == 1])
    ]
    planned = config.get("steps")
    facts = [
        ("task", task),
        ("algorithm", f"{config.get('algo', '?')} / {config.get('estimator', '?')}"),
        ("model", model),
        ("steps run", f"{steps_run}" + (f" of {planned}" if planned else "")),
        ("wall time", f"{int(wall // 3600)}:{int(wall % 3600 // 60):02d}:{int(wall % 60):02d}"),
        ("best val/success", f"{best[1]:.3f} (step {best[0]})" if best else "—"),
        ("last val/success", f"{val[-1][1]:.3f} (step {val[-1][0]})" if val else "—"),
    ]
    for key in ("val/random_success", "val/optimal_success"):
        vals = [v for _, v in series(metrics, key) if v is not None]
        if vals:
            facts.append((key.split("/")[1].replace("_", " "), f"{vals[-1]:.3f}"))
    facts.append(("warnings", "; ".join(warn) or "none"))
    cards = "".join(f'<div class="fact"><span>{esc(k)}</span><b>{esc(v)}</b></div>' for k, v in facts)
    settings = " · ".join(f"{esc(k)} <b>{esc(config[k])}</b>" for k in KEY_SETTINGS if k in config)
    full = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in config.items())
    return (
        f'<header><h1>{esc(task)} · {esc(config.get("algo", "run"))} <small>{esc(run_dir.resolve())}</small></h1>'
        f'<div class="facts">{cards}</div><p class="settings">{settings or "no config.json"}</p>'
        f'<details><summary>full config</summary><table>{full}</table></details></header>'
    )


CSS = (
    """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;background:#f8fafc;color:#1f2937}
main{max-width:1340px;margin:0 auto;padding:16px 20px 60px}
h1{font-size:20px;margin:4px 0 12px}h1 small{font-size:12px;color:#6b7280;font-weight:400;margin-left:8px}
h2{font-size:16px;margin:28px 0 10px}
.facts{display:flex;flex-wrap:wrap;gap:8px}
.fact{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:6px 12px}
.fact span{display:block;font-size:11px;color:#6b7280;text-transform:uppercase;letter-spacing:.03em}
.settings{color:#374151;font-size:13px}details table{font-size:12px;border-collapse:collapse}
details td{padding:1px 10px 1px 0;vertical-align:top}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(430px,1fr));gap:12px}
.chart{margin:0;background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:8px}
figcaption{font-weight:600;font-size:13px;margin-bottom:2px}.empty{color:#9ca3af;padding:40px 0;text-align:center}
.note{color:#6b7280;font-size:12px;margin-top:2px}
svg .grid{stroke:#eef0f3}svg .axis{stroke:#9ca3af}svg .tick{font-size:10px;fill:#6b7280}
svg .label{font-size:11px;fill:#4b5563}svg .legend{font-size:11px;fill:#374151}
.controls{display:flex;flex-wrap:wrap;gap:12px;align-items:center;background:#fff;border:1px solid #e5e7eb;
border-radius:8px;padding:8px 12px}select,button{font:inherit;padding:2px 6px}
.turn{background:#fff;border:1px solid #e5e7eb;border-radius:8px;margin-top:10px;padding:10px 12px}
.turn h3{font-size:14px;margin:0 0 8px}.turn-body{display:flex;gap:18px;align-items:flex-start}
.board{flex:0 0 auto;min-width:160px}.talk{flex:1 1 auto;min-width:0}
.reply{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;background:#f9fafb;
border-radius:6px;padding:8px}.think{background:#ede9fe;color:#4c1d95}.answer{background:#fef08a;font-weight:600}
.chip{display:inline-block;background:#e0e7ff;border-radius:10px;padding:0 8px;margin:2px}
table.rubric td{padding:0 12px 0 0;font-size:13px}pre.state{white-space:pre-wrap;font-size:12px}
.arm{border:2px solid #d1d5db;border-radius:10px;padding:14px 18px;margin:0 0 8px;background:#fff;text-align:center}
.arm b{display:block;font-size:16px}.arm span{font-size:11px;color:#6b7280}
.arm.chosen{background:"""
    + ARM_CHOSEN_COLOUR
    + """;border-color:#b45309}
.ok{color:#15803d}.bad{color:#b91c1c}.muted{color:#6b7280}.legend-row{font-size:11px;color:#4b5563;margin-top:4px}
.legend-row span{margin-right:10px;white-space:nowrap}
.swatch{display:inline-block;width:10px;height:10px;vertical-align:-1px}.groups .bar{fill:"""
    + DROPPED_COLOUR
    + """}.groups .bar.kept{fill:"""
    + KEPT_COLOUR
    + """}
.legend-row svg{vertical-align:-2px;outline:1px solid #d1d5db}
.slipped{background:#fde68a;color:#92400e;border-radius:6px;padding:0 4px;margin-left:4px;font-size:11px}
"""
)

# The viewer. Everything from the run goes in through textContent / setAttribute, never innerHTML.
JS = r"""
(function () {
  "use strict";
  const root = document.documentElement;
  const fail = (msg) => { root.dataset.reportStatus = "error"; root.dataset.reportError = String(msg).slice(0, 300); };
  window.addEventListener("error", (e) => fail(e.message));
  document.addEventListener("securitypolicyviolation", (e) => fail("CSP blocked " + e.blockedURI));
  const consoleError = console.error;
  console.error = (...a) => { fail(a.join(" ")); consoleError.apply(console, a); };

  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const $ = (id) => document.getElementById(id);
  const num = (v) => (v === null || v === undefined ? "—" : (+v).toFixed(3).replace(/\.?0+$/, "") || "0");
  function el(tag, cls, ...kids) {  // kids are elements or strings; strings become text nodes, never markup
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    e.append(...kids);
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }
  function fill(select, options) {  // options: [value, label] pairs
    select.replaceChildren(...options.map(([value, label]) => Object.assign(el("option", "", label), { value })));
  }

  function drawCell(g, style, sym, x, y, S) {  // one square, plus what stands on it (sizes for S = 30, scaled by k)
    const [colour, thing] = style[sym] || ["#ffffff", ""], m = S / 2, k = S / 30, C = DATA.thing_colours;
    g.append(svg("rect", { x, y, width: S, height: S, fill: colour, stroke: "#ffffff", "stroke-width": 1 }));
    if (thing.includes("target"))
      g.append(svg("circle", { cx: x + m, cy: y + m, r: 9 * k, fill: "none", stroke: C.target,
                               "stroke-width": 2.5 * k }));
    if (thing.startsWith("box"))
      g.append(svg("rect", { x: x + 5 * k, y: y + 5 * k, width: S - 10 * k, height: S - 10 * k, rx: 3 * k,
                             fill: C[thing] }));
    if (thing.startsWith("player") || thing === "fallen")
      g.append(svg("circle", { cx: x + m, cy: y + m, r: 8 * k, fill: C[thing] || C.player }));
  }

  function drawGrid(grid) {  // the state as coloured cells, with a legend
    const S = 30, style = grid.style, width = Math.max(...grid.rows.map((r) => r.length));
    const g = svg("svg", { width: width * S, height: grid.rows.length * S, class: "grid-board" });
    grid.rows.forEach((row, r) => row.forEach((sym, c) => drawCell(g, style, sym, c * S, r * S, S)));
    const legend = el("div", "legend-row");
    for (const [sym, name] of Object.entries(grid.legend)) {
      const swatch = svg("svg", { width: 14, height: 14 });
      drawCell(swatch, style, sym, 0, 0, 14);
      legend.append(el("span", "", swatch, ` ${sym} ${name}`));
    }
    return el("div", "", g, legend);
  }

  function drawArms(arms, turn) {  // the bandit: two cards, the chosen one highlighted
    const choice = (turn.actions[0] || turn.answer || "").trim().toLowerCase(), high = arms.high;
    const box = el("div");
    for (const name of arms.names) {
      const risk = !high ? "arm" : name.toLowerCase() === high.toLowerCase() ? "high-risk arm" : "low-risk arm";
      const chosen = name.toLowerCase() === choice ? " chosen" : "";
      box.append(el("div", "arm" + chosen, el("b", "", name), el("span", "", risk)));
    }
    if (!arms.names.some((a) => a.toLowerCase() === choice)) box.append(el("div", "bad", "no valid arm chosen"));
    return box;
  }

  function highlight(text) {  // the raw reply with its <think> and <answer> parts marked
    const out = el("div", "reply");
    for (const part of text.split(/(<think>[\s\S]*?<\/think>|<answer>[\s\S]*?<\/answer>)/)) {
      const cls = part.startsWith("<think>") ? "think" : part.startsWith("<answer>") ? "answer" : "";
      if (part) out.append(cls ? el("span", cls, part) : part);
    }
    return out;
  }

  function drawTurn(turn, i) {
    const board = el("div", "board");
    if (turn.grid) board.append(drawGrid(turn.grid));
    else if (turn.arms) board.append(drawArms(turn.arms, turn));
    else board.append(el("div", "muted", "no grid in this state"));
    const answer = el("div", "", "answer: ",
      turn.answer === null ? el("span", "bad", "none (not well formed)") : el("b", "", turn.answer));
    const slip = () => Object.assign(el("small", "slipped", "slipped"), { title: "the ice sent this move another way" });
    const chips = turn.actions.length ? turn.actions.map((a, j) => el("span", "chip", a, ...(turn.slipped[j] ? [slip()] : [])))
                                      : [el("span", "bad", "none")];
    const rubric = el("table", "rubric");
    for (const [k, v] of Object.entries(turn.rubric))
      rubric.append(el("tr", "", el("td", "", k), el("td", "", num(v))));
    const state = el("details", "", el("summary", "", "state shown to the model"), el("pre", "state", turn.state));
    const talk = el("div", "talk", highlight(turn.text), answer, el("div", "", "actions: ", ...chips), rubric, state);
    return el("div", "turn", el("h3", "", `Turn ${i + 1} · env reward ${num(turn.env_reward)} · rubric score ${num(turn.score)}`),
              el("div", "turn-body", board, talk));
  }

  const rollouts = DATA.rollouts, view = $("trajectory");
  function showTrajectory() {
    const r = rollouts[+$("traj").value];
    if (!r) return view.replaceChildren(el("p", "muted", "no trajectory matches"));
    const outcome = el("b", r.success ? "ok" : "bad", r.success ? "success" : "failure");
    view.replaceChildren(el("p", "", `${r.split} · step ${r.step} · seed ${r.seed} · `, outcome,
                            ` · rubric score ${num(r.score)} · env reward ${num(r.env_reward)} · ${r.turns.length} turn(s)`),
                         ...r.turns.map((t, i) => drawTurn(t, i)),
                         ...(r.final_grid ? [el("div", "turn", el("h3", "", "After the last move"),
                                                el("div", "turn-body", el("div", "board", drawGrid(r.final_grid))))] : []));
  }
  function showList() {  // the trajectories of the chosen split and step, filtered by outcome
    const want = $("outcome").value;
    const list = rollouts.filter((r) => r.split === $("split").value && String(r.step) === $("step").value &&
                                        (want === "all" || r.success === (want === "success")));
    fill($("traj"), list.map((r) => [String(rollouts.indexOf(r)),
                                     `seed ${r.seed} · ${r.success ? "✓" : "✗"} · score ${num(r.score)}`]));
    showTrajectory();
  }
  function showSteps() {  // the steps of the chosen split; the latest is selected
    const steps = [...new Set(rollouts.filter((r) => r.split === $("split").value).map((r) => r.step))];
    steps.sort((a, b) => a - b);
    fill($("step"), steps.map((s) => [String(s), `step ${s}`]));
    $("step").value = String(steps[steps.length - 1]);
    showList();
  }
  if (rollouts.length) {
    const splits = [...new Set(rollouts.map((r) => r.split))].sort().reverse();  // val first: it has every eval step
    fill($("split"), splits.map((s) => [s, s]));
    $("split").addEventListener("change", showSteps);
    $("step").addEventListener("change", showList);
    $("outcome").addEventListener("change", showList);
    $("traj").addEventListener("change", showTrajectory);
    showSteps();
  } else {
    $("controls").hidden = true;
    view.replaceChildren(el("p", "muted", "No rollouts logged yet (rollouts.jsonl is missing or empty)."));
  }
  const groups = DATA.groups;
  function showGroups() {  // the picked step: every group's statistic as a bar, the kept groups coloured
    const g = groups.find((r) => String(r.step) === $("group-step").value), n = g.values.length, kept = new Set(g.kept);
    const W = 420, H = 190, L = 44, T = 12, B = 22, bw = (W - L - 8) / Math.max(n, 1);
    const top = Math.max(...g.values.map((v) => v || 0), 1e-9), y = (v) => H - B - (H - T - B) * v / top;
    const box = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
    for (const v of [0, top]) {
      box.append(svg("line", { x1: L, x2: W - 8, y1: y(v), y2: y(v), class: v ? "grid" : "axis" }));
      box.append(Object.assign(svg("text", { x: L - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }),
                               { textContent: num(v) }));
    }
    g.values.forEach((v, i) => {
      const h = Math.max(y(0) - y(v || 0), 1.5);  // a zero still shows as a sliver
      const bar = svg("rect", { x: L + i * bw + 1, y: y(0) - h, width: Math.max(bw - 2, 1), height: h,
                                class: kept.has(i) ? "bar kept" : "bar" });
      bar.append(Object.assign(svg("title", {}), { textContent: `group ${i}: ${g.stat} ${num(v)}${kept.has(i) ? " · kept" : ""}` }));
      box.append(bar);
      if (n <= 32) box.append(Object.assign(svg("text", { x: L + (i + 0.5) * bw, y: H - 8, class: "tick",
                                                           "text-anchor": "middle" }), { textContent: String(i) }));
    });
    $("group-caption").textContent = `Step ${g.step}: ${g.stat} of each group's rewards · ${g.strategy} ${g.value} · ` +
      (g.kept.length ? `kept ${g.kept.length} of ${n}` : `nothing kept: the step was skipped`);
    $("group-bars").replaceChildren(box);
  }
  if (groups.length) {
    fill($("group-step"), groups.map((r) => [String(r.step), `step ${r.step}`]));
    $("group-step").value = String(groups[groups.length - 1].step);
    $("group-step").addEventListener("change", showGroups);
    showGroups();
  }
  if (root.dataset.reportStatus !== "error") root.dataset.reportStatus = "ok";  // read by the browser test
})();
"""


def render_page(run_dir: Path) -> str:
    config, metrics, rollouts, groups, collapse = load_run(run_dir)
    task = infer_task(config, rollouts, run_dir)
    kept, total = viewer_rollouts(rollouts)
    data = dict(rollouts=kept, thing_colours=THING_COLOURS, groups=group_rows(groups))
    # Only this exact script may run: a reply that somehow reached the page as markup could not execute anything.
    script_hash = base64.b64encode(hashlib.sha256(JS.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    note = f"{len(kept)} of {total} logged trajectories embedded" if total else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<title>{esc(task)} · {esc(config.get("algo", "run"))} · {esc(run_dir.resolve().name)}</title>
<style>{CSS}</style></head><body><main>
{header(config, metrics, task, run_dir)}
<h2>Curves</h2><div class="charts">
{chr(10).join(charts(metrics, config))}
</div>
{filter_section(metrics, groups)}
{collapse_section(collapse)}
<h2>Rollouts <small class="muted">{esc(note)}</small></h2>
<div class="controls" id="controls"><label>split <select id="split"></select></label>
<label>step <select id="step"></select></label>
<label>outcome <select id="outcome"><option value="all">all</option><option value="success">success</option>
<option value="failure">failure</option></select></label><label>trajectory <select id="traj"></select></label></div>
<div id="trajectory"><noscript>The rollout viewer needs JavaScript.</noscript></div>
<p class="muted">Rebuild: <code>python -m plumbing.report {esc(run_dir)}</code> · written {time.strftime("%Y-%m-%d %H:%M")}</p>
</main>
<script type="application/json" id="report-data">{json_for_script(data)}</script>
<script>{JS}</script>
</body></html>
"""


def build_report(run_dir) -> Path:
    """Write run_dir/report.html atomically (a temporary file, then os.replace) and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotADirectoryError(f"not a run directory: {run_dir}")
    out = run_dir / "report.html"
    tmp = run_dir / f".report.html.{os.getpid()}.tmp"
    tmp.write_text(render_page(run_dir), encoding="utf-8")
    os.replace(tmp, out)  # readers see the old page or the new one, never half of one
    return out


USAGE = "usage: python -m plumbing.report RUN_DIR   (rebuilds RUN_DIR/report.html)"
HELP = f"""{USAGE}

Builds (or rebuilds) the self-contained HTML report of one run directory, as the training scripts do at every
evaluation, and prints the path of the page written. RUN_DIR is a script's --output-dir (for example
runs/bandit-starpo-s-gae-s0); it must hold at least one of config.json, metrics.jsonl or rollouts.jsonl.

options:
  -h, --help  show this help and exit
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(HELP, end="")
        return 0
    options = [a for a in argv if a.startswith("-")]
    if options or len(argv) != 1:
        why = f"unknown option {options[0]}" if options else f"expected one RUN_DIR, got {len(argv)} arguments"
        print(f"report: {why}; usage: python -m plumbing.report RUN_DIR (--help for more)", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    files = ("config.json", "metrics.jsonl", "rollouts.jsonl")
    if not run_dir.is_dir() or not any((run_dir / f).is_file() for f in files):
        print(f"report: {run_dir} is not a run directory (none of {', '.join(files)})", file=sys.stderr)
        return 2
    print(build_report(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
