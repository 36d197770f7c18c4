"""plumbing/report.py: the run report on synthetic run directories, escaping of model text, and a headless-Chromium check."""

import base64
import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from plumbing import report
from conftest import ROOT

EVIL = "<script>alert(1)</script> </script><img src=x onerror=alert(2)> \"quotes\" 'single' & <!-- \u2028\u2029 end"


def env_states() -> dict:
    """task -> (observation text, env.describe()), from the scripts' own environments: what a real run logs."""
    import starpo_bandit as sb
    import starpo_frozenlake as fl
    import starpo_sokoban as ss

    room = ss.SokobanEnv()
    room_obs = room.load("######\n#__O_#\n#_X__#\n#P_√X#\n##O###\n######")
    lake = fl.FrozenLakeEnv(desc=["SFFF", "FHFH", "FFFH", "HFFG"])
    lake_obs = lake.reset(0)
    arms = sb.BanditEnv()
    arms_obs = arms.reset(0)
    return {
        "sokoban": (room_obs, room.describe()),
        "frozenlake": (lake_obs, lake.describe()),
        "bandit": (arms_obs, arms.describe()),
    }


STATES = env_states()
SOKOBAN_STATE = STATES["sokoban"][0]
BASE_CHARTS = [
    "Success",
    "Reward",
    "In-group reward std",
    "Entropy",
    "Gradient norm",
    "Response and think length",
    "Clip fractions",
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_run(
    run_dir,
    task="sokoban",
    steps=6,
    eval_every=2,
    baselines=True,
    warn=None,
    rubric=("env", "format"),
    text="<think> go down </think> <answer> Down </answer>",
    rollouts=True,
    config=True,
):
    """A run directory shaped like the scripts' output: config.json, metrics.jsonl, rollouts.jsonl.
    warn: {kind: steps} where warn/<kind> is 1."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if config:
        config = dict(
            algo="starpo-s",
            estimator="gae",
            model="tiny",
            steps=steps,
            n_groups=2,
            group_size=4,
            lr=1e-4,
            high_arm_name="Dragon",
        )
        (run_dir / "config.json").write_text(json.dumps(config))
    metrics = []
    for step in range(steps + 1):
        m = {"step": step, "time_s": 3.0 * step}
        if step:
            m.update(
                {
                    "train/success": step / (steps + 1),
                    "train/reward": 0.1 * step,
                    "rollout/in_group_std": 0.3,
                    "rollout/chosen_in_group_std": 0.5,
                    "actor/entropy": 1.0 - 0.1 * step,
                    "actor/grad_norm": 1.0,
                    "response_length/mean": 20.0,
                    "think_length/mean": 40.0,
                    "actor/pg_clipfrac": 0.01,
                    "actor/pg_clipfrac_lower": 0.0,
                    **{f"rubric/{r}": 0.5 for r in rubric},
                }
            )
        for kind, steps_fired in (warn or {}).items():
            if step in steps_fired:
                m[f"warn/{kind}"] = 1
        if step % eval_every == 0 or step == steps:
            m.update({"val/success": 0.2 + 0.1 * step, "val/reward": 0.3})
            if baselines:
                m.update({"val/random_success": 0.23, "val/optimal_success": 0.91})
        metrics.append(m)
    write_jsonl(run_dir / "metrics.jsonl", metrics)
    if rollouts:
        rows = []
        for step in range(0, steps + 1, eval_every):
            for i in range(3):
                state, view = STATES[task]
                turn = dict(
                    state=state,
                    view=view,
                    text=text,
                    think="go down",
                    answer="Down",
                    actions=["Down"],
                    env_reward=-0.1,
                    score=-0.1,
                    rubric={r: 0.5 for r in rubric},
                )
                rows.append(
                    dict(
                        step=step,
                        split="val",
                        task=task,
                        seed=100 + i,
                        success=i == 0,
                        score=1.0 - i,
                        env_reward=1.0 - i,
                        turns=[turn, turn],
                        final_view=None if task == "bandit" else view,
                    )
                )
        write_jsonl(run_dir / "rollouts.jsonl", rows)
    return run_dir


COLLAPSE_CHARTS = ["Mutual information", "MI z-score", "Retrieval accuracy", "Reasoning entropy", "Valid thinking"]
GROUP_VALUES = [0.0, 0.48, 0.1, 0.5, 0.3, 0.52, 0.0, 0.2]  # 8 groups' reward std


def add_metrics(run_dir, per_step):
    """Merge per_step(step) (a dict) into every training step's line of metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    write_jsonl(run_dir / "metrics.jsonl", [{**r, **(per_step(r["step"]) if r["step"] else {})} for r in rows])
    return run_dir


def with_groups(run_dir, skipped=(4,)):
    """What the scripts log about the filter: its metrics and groups.jsonl; the steps in skipped kept nothing."""
    add_metrics(
        run_dir,
        lambda s: {
            "rollout/filter_kept_ratio": 0.0 if s in skipped else 0.375,
            "rollout/empty_after_filter": int(s in skipped),
            "rollout/consecutive_empty_after_filter_steps": int(s in skipped),
        },
    )
    rows = []
    for s in range(1, 7):
        values = [0.0] * 8 if s in skipped else [v + 0.01 * s for v in GROUP_VALUES]
        kept = [] if s in skipped else [1, 3, 5]
        rows.append(dict(step=s, stat="std", strategy="top_p", value=0.9, values=values, kept=kept))
    write_jsonl(run_dir / "groups.jsonl", rows)
    return run_dir


def collapse_row(step, rows=6, cols=3):
    """One collapse.jsonl line: reasoning r came from prompt r % cols and scores best there, except the last row."""
    matrix = [[-1.0 - 0.5 * ((r % cols) != c) - 0.1 * r for c in range(cols)] for r in range(rows)]
    matrix[-1] = matrix[-1][::-1]
    return dict(
        step=step, matrix=matrix, cols=[r % cols for r in range(rows)], prompts=[f"map {c}" for c in range(cols)]
    )


def with_collapse(run_dir, every=2):
    """The collapse/* metrics every `every` steps, and collapse.jsonl on those steps."""
    keys = ["mi_estimate", "mi_seq_estimate", "mi_upper_bound", "mi_zscore", "mi_zscore_ema", "retrieval_accuracy"]
    keys += ["retrieval_chance_level", "conditional_entropy_est", "reasoning_entropy_est", "valid_thinking_rate"]
    add_metrics(run_dir, lambda s: {f"collapse/{k}": 0.1 * s + i for i, k in enumerate(keys)} if s % every == 0 else {})
    steps = sorted(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    write_jsonl(run_dir / "collapse.jsonl", [collapse_row(s) for s in steps if s and s % every == 0])
    return run_dir


def build(run_dir) -> str:
    path = report.build_report(run_dir)
    assert path == run_dir / "report.html"
    return path.read_text(encoding="utf-8")


def figure(page: str, title: str) -> str:
    """The <figure> of one chart."""
    pattern = r'<figure class="chart"[^>]*><figcaption>' + re.escape(title) + r"</figcaption>.*?</figure>"
    m = re.search(pattern, page, re.S)
    assert m, f"chart {title!r} missing"
    return m.group(0)


def embedded_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


# ---- charts -----------------------------------------------------------------------------------------------------


def test_every_chart_present_with_axes_and_lines(tmp_path):
    page = build(make_run(tmp_path / "run", rubric=("env_reward", "format_reward", "invalid_answer_penalty")))
    for title in BASE_CHARTS + ["rubric/env_reward", "rubric/format_reward", "rubric/invalid_answer_penalty"]:
        fig = figure(page, title)
        assert "<svg" in fig and "<polyline" in fig and 'class="axis"' in fig and 'class="tick"' in fig, title
        assert ">step</text>" in fig  # x-axis label
    assert page.count('<figure class="chart"') == len(BASE_CHARTS) + 3
    assert "no data yet" not in page


def test_rubric_chart_per_component(tmp_path):
    page = build(make_run(tmp_path / "run", rubric=("a", "b", "c", "d")))
    titles = re.findall(r"<figcaption>(rubric/[^<]*)</figcaption>", page)
    assert titles == ["rubric/a", "rubric/b", "rubric/c", "rubric/d"]


def test_baselines_drawn_dashed_when_logged(tmp_path):
    fig = figure(build(make_run(tmp_path / "with", task="frozenlake")), "Success")
    baselines = re.findall(r'<line class="baseline"[^>]*>', fig)
    assert len(baselines) == 2 and all('stroke-dasharray="6 4"' in b for b in baselines)
    assert ">random</text>" in fig and ">optimal</text>" in fig  # legend entries
    assert "random 0.23" in fig and "optimal 0.91" in fig  # hover titles carry the values
    assert 'class="baseline"' not in build(make_run(tmp_path / "without", baselines=False))


def marked(page: str, kind: str) -> list[str]:
    """The titles of the charts that carry a marker of this kind (a warning kind, or "skipped-step")."""
    figures = re.findall(r'<figure class="chart"[^>]*><figcaption>([^<]*)</figcaption>(.*?)</figure>', page, re.S)
    return [title for title, body in figures if f'data-mark="{kind}"' in body]


def test_each_warning_marks_only_the_charts_it_concerns(tmp_path):
    page = build(make_run(tmp_path / "echo", warn={"echo_trap": (3, 5)}))
    assert marked(page, "echo-trap") == ["Success", "In-group reward std", "Entropy"]
    assert figure(page, "Entropy").count('data-mark="echo-trap"') == 2 and "echo trap at step 3" in page
    assert "echo trap: step 3, step 5" in page  # listed in the header
    assert 'class="mark"' not in build(make_run(tmp_path / "calm")) and ">none</b>" in build(make_run(tmp_path / "c2"))


def test_a_gradient_spike_alone_marks_only_the_gradient_norm(tmp_path):
    """The FrozenLake run: one spike at step 69 while val/success held drew a marker on all 13 charts."""
    page = build(make_run(tmp_path / "run", steps=80, eval_every=10, warn={"gradient_spike": (69,)}))
    assert marked(page, "gradient-spike") == ["Gradient norm"] and page.count('class="mark"') == 1
    fig = figure(page, "Gradient norm")
    assert "gradient spike at step 69" in fig and ">gradient spike</text>" in fig  # hover title, legend entry
    assert f'stroke="{report.WARNINGS["gradient_spike"]}"' in fig
    assert "gradient spike: step 69" in page and "echo trap:" not in page


def test_template_collapse_marks_the_collapse_charts_and_entropy(tmp_path):
    run = with_collapse(make_run(tmp_path / "run", warn={"template_collapse": (5,)}))
    assert marked(build(run), "template-collapse") == ["Entropy", *COLLAPSE_CHARTS]


def test_flat_zero_clip_fractions_say_why(tmp_path):
    run = make_run(tmp_path / "zero")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if "actor/pg_clipfrac" in r:
            r["actor/pg_clipfrac"] = 0.0
    write_jsonl(run / "metrics.jsonl", rows)
    assert "one PPO epoch, one mini-batch" in figure(build(run), "Clip fractions")
    assert 'class="note"' not in build(make_run(tmp_path / "some"))  # 0.01 clipped: no note


def test_nan_breaks_the_line_and_never_reaches_the_json(tmp_path):
    run = make_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[3] = lines[3].replace('"actor/grad_norm": 1.0', '"actor/grad_norm": NaN')
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rows = (run / "rollouts.jsonl").read_text().replace('"env_reward": -0.1', '"env_reward": Infinity')
    (run / "rollouts.jsonl").write_text(rows)
    page = build(run)
    assert figure(page, "Gradient norm").count("<polyline") == 2  # steps 1-2, then 4-6
    assert embedded_data(page)["rollouts"][0]["turns"][0]["env_reward"] is None


def test_header_facts(tmp_path):
    page = build(make_run(tmp_path / "run", steps=6, eval_every=2))
    assert "sokoban" in page and "starpo-s / gae" in page and "6 of 6" in page and "0:00:18" in page
    assert "0.800 (step 6)" in page  # best and last val/success: 0.2 + 0.1 * 6
    assert "random success" in page and "0.230" in page


# ---- the filter view, the collapse view, rubric weights, slipped moves ------------------------------------------


def captions(page: str) -> list[str]:
    return re.findall(r'<figure class="chart"[^>]*><figcaption>([^<]*)</figcaption>', page)


def test_filter_view_shows_every_group_and_marks_the_kept_ones(tmp_path):
    page = build(with_groups(make_run(tmp_path / "run")))
    assert '<h2 id="filter">' in page and 'id="group-step"' in page and 'id="group-bars"' in page
    groups = embedded_data(page)["groups"]  # the page's script draws the picked step's bars from these
    assert [g["step"] for g in groups] == [1, 2, 3, 4, 5, 6]
    last = groups[-1]
    assert last["values"] == [round(v + 0.06, 4) for v in GROUP_VALUES] and last["kept"] == [1, 3, 5]
    assert (last["stat"], last["strategy"], last["value"]) == ("std", "top_p", "0.9")
    assert groups[3]["kept"] == [] and groups[3]["values"] == [0.0] * 8  # the skipped step
    assert report.KEPT_COLOUR in page and "kept (trained on)" in page
    for title in ("Kept groups", "Empty after filter"):  # over training, the skipped step marked
        assert "<polyline" in figure(page, title) and "skipped step at step 4" in figure(page, title)
    assert marked(page, "skipped-step") == ["Kept groups", "Empty after filter"]


def test_filter_view_tolerates_odd_rows(tmp_path):
    run = make_run(tmp_path / "run")
    bad = [dict(step=1, values="no"), dict(step=2, values=[1, "x", None, float("nan")], kept=[0, 9, "1", 3])]
    write_jsonl(run / "groups.jsonl", bad)
    groups = embedded_data(build(run))["groups"]
    assert groups == [dict(step=2, values=[1.0, None, None, None], kept=[0, 3], stat="?", strategy="?", value="?")]


def test_collapse_charts_beside_entropy_and_the_latest_matrix_as_a_heatmap(tmp_path):
    page = build(with_collapse(make_run(tmp_path / "run")))
    titles = captions(page)
    assert titles[titles.index("Entropy") + 1 :][:5] == COLLAPSE_CHARTS
    assert not any(t.startswith("collapse/") for t in titles)  # the other collapse/* numbers get no chart each
    fig = figure(page, "Retrieval accuracy")
    assert fig.count("<polyline") == 2 and ">chance</text>" in fig  # the chance level, a second line
    assert ">H(R | prompt)</text>" in figure(page, "Reasoning entropy")
    assert '<h2 id="collapse">' in page
    heat = re.search(r'<figure class="chart heatmap">.*?</figure>', page, re.S).group(0)
    assert "step 6</figcaption>" in heat  # the latest line of collapse.jsonl
    assert heat.count("<rect x=") == 6 * 3 + 10  # a cell per (reasoning, prompt), then the colour scale's 10
    assert heat.count('class="own"') == 6 and f'stroke="{report.OWN_COLOUR}"' in heat  # each row's own prompt
    assert heat.count("<circle") == 6 and "5 of 6 rows pick their own prompt" in heat  # the best cell of each row
    assert ">map 2</text>" in heat and ">log-prob</text>" in heat and "reasoning 5 (from map 2) under map 0" in heat


@pytest.mark.parametrize("row", [dict(step=3), dict(step=3, matrix=[]), dict(step=3, matrix=[[1, 2], [3]])])
def test_a_malformed_matrix_leaves_the_collapse_section_out(tmp_path, row):
    run = make_run(tmp_path / "run")
    write_jsonl(run / "collapse.jsonl", [row])
    assert 'id="collapse"' not in build(run)


def test_a_run_without_groups_or_collapse_has_no_such_sections(tmp_path):
    page = build(make_run(tmp_path / "run"))
    for absent in ('id="filter"', 'id="group-step"', 'id="collapse"', "heatmap", "Kept groups", "Mutual information"):
        assert absent not in page, absent
    assert embedded_data(page)["groups"] == [] and captions(page) == BASE_CHARTS + ["rubric/env", "rubric/format"]


def test_rubric_charts_carry_their_weight(tmp_path):
    run = make_run(tmp_path / "run", rubric=("format_reward", "progress", "hole_penalty"))
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "component_weights": {"format_reward": 1.0, "progress": 0.5}}))
    titles = [t for t in captions(build(run)) if t.startswith("rubric/")]
    assert titles == ["rubric/format_reward  (weight 1)", "rubric/hole_penalty", "rubric/progress  (weight 0.5)"]


def test_a_slipped_move_is_carried_to_the_viewer(tmp_path):
    run = make_run(tmp_path / "run", task="frozenlake")
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for r in rows:
        r["turns"][0].update(actions=["Down", "Right"], slipped=[False, True])
    write_jsonl(run / "rollouts.jsonl", rows)
    page = build(run)
    turns = embedded_data(page)["rollouts"][0]["turns"]
    assert turns[0]["slipped"] == [False, True] and turns[1]["slipped"] == []  # a turn without slips: none marked
    assert '"slipped"' in re.search(r"<script>(.*?)</script>", page, re.S).group(1)  # the viewer draws the badge


def test_rollout_record_keeps_the_slips_only_where_a_move_slipped():
    def turn(*slips):
        infos = [dict(success=False, slipped=x) for x in slips]
        return SimpleNamespace(
            state="s",
            before={},
            text="t",
            think=None,
            world="",
            answer="a",
            payout=0.0,
            reward=0.0,
            parts={},
            actions=["Down"] * len(slips),
            infos=infos,
            after={},
        )

    t = SimpleNamespace(seed=0, success=False, score=0.0, turns=[turn(False, True, False), turn(False), turn()])
    rec = report.rollout_record(t, 1, "train", "frozenlake")
    assert rec["turns"][0]["slipped"] == [False, True, False]
    assert "slipped" not in rec["turns"][1] and "slipped" not in rec["turns"][2]  # the README's schema otherwise
    json.dumps(rec)


# ---- empty, partial and odd runs ----------------------------------------------------------------------------------


def test_empty_run_builds(tmp_path):
    (tmp_path / "run").mkdir()
    page = build(tmp_path / "run")
    for title in BASE_CHARTS:
        assert "no data yet" in figure(page, title)
    assert embedded_data(page)["rollouts"] == []


def test_config_only_and_missing_rollouts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algo": "starpo", "steps": 10}))
    assert "0 of 10" in build(run)
    page = build(make_run(tmp_path / "no-rollouts", rollouts=False))
    assert "<polyline" in figure(page, "Success") and embedded_data(page)["rollouts"] == []


def test_one_step_run(tmp_path):
    run = make_run(tmp_path / "bandit-starpo-s-gae-s0", task="bandit", steps=0, config=False, baselines=False)
    page = build(run)
    fig = figure(page, "Success")
    assert fig.count("<circle") == 1 and "val step 0: 0.2" in fig  # one point, drawn as a dot
    assert "no data yet" in figure(page, "Entropy")
    assert "<title>bandit" in page  # the task, from rollouts.jsonl (no config.json)
    (run / "rollouts.jsonl").unlink()
    assert "<title>bandit" in build(run)  # ... else from the directory name


def test_broken_last_line_and_repeated_steps(tmp_path):
    run = make_run(tmp_path / "run", steps=6)
    with open(run / "metrics.jsonl", "a") as f:  # steps 5-6 logged again (a resume that did not truncate), then torn
        f.write(json.dumps({"step": 5, "train/success": 0.0}) + "\n")
        f.write(json.dumps({"step": 6, "val/success": 0.05, "time_s": 99.0}) + "\n" + '{"step": 7, "train/succ')
    with open(run / "rollouts.jsonl", "a") as f:  # the evaluations of steps 4 and 6 logged again
        for s in (4, 6):
            f.write(json.dumps(dict(step=s, split="val", task="sokoban", seed=s, success=True, score=2.0, turns=[])))
            f.write("\n")
    page = build(run)
    assert "0.050 (step 6)" in page and "6 of 6" in page and "0:01:39" in page  # the later lines won
    assert "0.600 (step 4)" in page  # ... and the earlier steps are still there (best val/success)
    assert figure(page, "Success").count("train step 5: 0<") == 1
    assert [(r["step"], r["seed"]) for r in embedded_data(page)["rollouts"]] == [
        (0, 100),
        (0, 101),
        (0, 102),
        (2, 100),
        (2, 101),
        (2, 102),
        (4, 4),
        (6, 6),
    ]


def test_viewer_caps_rollouts_and_keeps_first_and_last_step(tmp_path):
    run = make_run(tmp_path / "run", rollouts=False)
    rows = [
        dict(step=s, split=sp, task="sokoban", seed=i, success=False, score=0.0, turns=[])
        for s in range(0, 100, 2)
        for sp in ("train", "val")
        for i in range(64)
    ]
    write_jsonl(run / "rollouts.jsonl", rows)
    kept = embedded_data(build(run))["rollouts"]
    for split in ("train", "val"):
        steps = sorted({r["step"] for r in kept if r["split"] == split})
        assert len([r for r in kept if r["split"] == split]) <= report.MAX_ROLLOUTS_PER_SPLIT
        assert steps[0] == 0 and steps[-1] == 98 and len(steps) >= 5


def test_long_text_is_clipped(tmp_path):
    page = build(make_run(tmp_path / "run", text="x" * 50_000))
    assert "more characters]" in embedded_data(page)["rollouts"][0]["turns"][0]["text"]
    assert len(page) < 400_000


# ---- escaping ---------------------------------------------------------------------------------------------------


class TagCollector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.handlers = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.handlers += [name for name, _ in attrs if name.startswith("on")]


def test_model_text_is_escaped_everywhere(tmp_path):
    run = make_run(tmp_path / "run", text=EVIL, rubric=("env", EVIL))
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "algo": EVIL, "note": EVIL}))
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for r in rows:
        r["turns"][0].update(state=EVIL + "\n" + SOKOBAN_STATE, answer=EVIL, actions=[EVIL])
        r["seed"] = EVIL
    write_jsonl(run / "rollouts.jsonl", rows)
    write_jsonl(run / "collapse.jsonl", [{**collapse_row(6), "prompts": [EVIL, EVIL, EVIL]}])  # drawn in Python
    write_jsonl(run / "groups.jsonl", [dict(step=6, stat=EVIL, strategy=EVIL, value=EVIL, values=[1.0], kept=[0])])
    page = build(run)

    for bad in ("<script>alert", "<img", "<!--", "\u2028", "\u2029", "onerror=alert(2)>"):
        assert bad not in page, bad
    assert len(re.findall(r"</script", page, re.I)) == 2  # only the page's own two script blocks
    parser = TagCollector()
    parser.feed(page)
    assert parser.tags.count("script") == 2 and "img" not in parser.tags and parser.handlers == []
    # ... and nothing is lost: the viewer gets the exact text back
    turn = embedded_data(page)["rollouts"][0]["turns"][0]
    assert turn["text"] == EVIL and turn["answer"] == EVIL and turn["actions"] == [EVIL]
    assert embedded_data(page)["groups"][0]["stat"] == EVIL  # drawn by the script, as text
    assert turn["state"].startswith(EVIL) and turn["grid"]["legend"]["#"] == "wall"  # the grid comes from the view
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the config value and rubric title, html-escaped


def test_page_is_offline_and_csp_matches_the_script(tmp_path):
    page = build(make_run(tmp_path / "run"))
    assert not re.search(r"<link|@import|url\(|\bsrc\s*=|https?://(?!www\.w3\.org/2000/svg)", page)
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in page and "default-src 'none'" in page


# ---- grids, arms, atomic write, command line --------------------------------------------------------------------


@pytest.mark.parametrize(
    "task,shape,symbol,name", [("sokoban", (6, 6), "#", "wall"), ("frozenlake", (4, 4), "O", "hole")]
)
def test_grid_comes_from_the_environments_own_view(task, shape, symbol, name):
    grid = report.grid_of(STATES[task][1])
    assert (len(grid["rows"]), len(grid["rows"][0])) == shape and grid["legend"][symbol] == name
    assert grid["style"][symbol] == report.CELL_STYLE[name]


def test_a_new_environment_is_drawn_without_a_table_for_it():
    grid = report.grid_of({"grid": [["A", "b"], ["b", "A"]], "legend": {"A": "lava", "b": "floor"}})
    assert grid["style"]["b"] == report.CELL_STYLE["floor"]  # a known name keeps its colour
    assert grid["style"]["A"][0].startswith("hsl(") and grid["style"]["A"] == report.cell_style("lava")  # stable
    for bad in (None, {}, {"grid": "no"}, {"grid": []}, "text"):
        assert report.grid_of(bad) is None


def test_arms_come_from_the_bandits_view():
    assert report.arms_of(STATES["bandit"][1]) == {"names": STATES["bandit"][1]["arms"], "high": "Dragon"}
    assert report.arms_of({"grid": []}) is None


def test_the_last_state_is_drawn_after_the_last_turn(tmp_path):
    kept = embedded_data(build(make_run(tmp_path / "run")))["rollouts"]
    assert kept[0]["final_grid"]["rows"] == report.grid_of(STATES["sokoban"][1])["rows"]


def test_write_is_atomic_and_overwrites(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "report.html").write_text("old")
    build(run)
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl", "report.html", "rollouts.jsonl"]
    assert (run / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_command_line(tmp_path):
    run = make_run(tmp_path / "run")
    ok = subprocess.run([sys.executable, "-m", "plumbing.report", str(run)], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("report.html")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for bad in ([str(tmp_path / "missing")], [str(tmp_path / "empty")], [str(tmp_path / "file")], []):
        res = subprocess.run([sys.executable, "-m", "plumbing.report", *bad], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    with pytest.raises(NotADirectoryError):
        report.build_report(tmp_path / "missing")


# ---- headless Chromium: no console errors, and the pixels show charts and a grid ----------------------------------


def read_png(path) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) to an (H, W, C) array: zlib plus the five row filters."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk, pos = data[pos + 8 : pos + 8 + length], pos + 12 + length
        if kind == b"IHDR":
            w, h, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and colour in (2, 6) and interlace == 0, "unsupported PNG"
        elif kind == b"IDAT":
            idat.append(chunk)
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, 1 + w * bpp)
    img, prev = np.zeros((h, w * bpp), np.uint8), np.zeros(w * bpp, np.int64)
    for y in range(h):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if kind == 1:  # Sub: a running sum per channel
            line = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) % 256
        elif kind == 2:  # Up
            line = (line + prev) % 256
        elif kind in (3, 4):  # Average, Paeth: depend on the byte to the left, so byte by byte
            out, up = line.tolist(), prev.tolist()
            for i in range(len(out)):
                a = out[i - bpp] if i >= bpp else 0
                b, c = up[i], (up[i - bpp] if i >= bpp else 0)
                if kind == 3:
                    out[i] = (out[i] + (a + b) // 2) % 256
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    out[i] = (out[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) % 256
            line = np.array(out, np.int64)
        img[y] = line
        prev = line
    return img.reshape(h, w, bpp)


def test_read_png_undoes_every_filter(tmp_path):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (10, 7, 3), dtype=np.int64)
    rows, prev = [], np.zeros(21, np.int64)
    for y in range(10):  # encode row y with filter y % 5 (None, Sub, Up, Average, Paeth)
        cur, kind = img[y].reshape(-1), y % 5
        left = np.concatenate([[0, 0, 0], cur[:-3]])
        upleft = np.concatenate([[0, 0, 0], prev[:-3]])
        p = left + prev - upleft
        paeth = np.where(
            (abs(p - left) <= abs(p - prev)) & (abs(p - left) <= abs(p - upleft)),
            left,
            np.where(abs(p - prev) <= abs(p - upleft), prev, upleft),
        )
        pred = [0, left, prev, (left + prev) // 2, paeth][kind]
        rows.append(bytes([kind]) + bytes(((cur - pred) % 256).tolist()))
        prev = cur
    chunk = lambda kind, body: struct.pack(">I", len(body)) + kind + body + b"\0\0\0\0"  # noqa: E731 (CRC unchecked)
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 7, 10, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )
    (tmp_path / "roundtrip.png").write_bytes(png)
    assert (read_png(tmp_path / "roundtrip.png") == img).all()


def pixels_of(img: np.ndarray, hex_colour: str, tol: int = 6) -> int:
    rgb = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(img[..., :3].astype(int) - rgb) <= tol).all(-1).sum())


def find_chromium():
    candidates = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
    return shutil.which("chromium") or next((p for p in candidates if os.path.exists(p)), None)


def open_in_chromium(page: Path, tmp_path: Path, height: int = 2400) -> tuple[str, np.ndarray]:
    """(the DOM after the page's script ran, the screenshot). Fails on any console message Chromium logs."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium: install Debian's `chromium` package (apt-get install -y chromium; .ci/run does)")
    flags = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--enable-logging=stderr",
        "--v=0",
        f"--window-size=1400,{height}",
    ]
    url = page.resolve().as_uri()
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    png = tmp_path / "screenshot.png"
    shot = subprocess.run(flags + [f"--screenshot={png}", url], capture_output=True, text=True, timeout=120)
    console = [line for line in (dom.stderr + shot.stderr).splitlines() if ":CONSOLE" in line]
    assert console == [], "the page logged to the console:\n" + "\n".join(console)
    status = re.search(r'data-report-status="(\w+)"(?: data-report-error="([^"]*)")?', dom.stdout)
    assert status and status.group(1) == "ok", f"page script did not finish cleanly: {status and status.groups()}"
    assert png.is_file(), shot.stderr[-2000:]
    img = read_png(png)
    assert img.shape[:2] == (height, 1400)
    assert pixels_of(img, "#f8fafc") > 0.2 * img.shape[0] * img.shape[1]  # the page background: the decoder works
    return dom.stdout, img


def test_browser_grid_run(tmp_path):
    """A synthetic Sokoban run: the viewer draws the grid, the charts draw their lines, nothing is logged."""
    run = make_run(tmp_path / "run", text=EVIL, warn={"echo_trap": (3,)})
    dom, img = open_in_chromium(report.build_report(run), tmp_path)
    assert 'class="grid-board"' in dom and "alert(1)" in dom  # the reply is shown, as text
    assert pixels_of(img, report.CELL_STYLE["wall"][0]) > 15 * 28 * 28  # the walls: 23 cells of 30 x 30 px per turn
    assert pixels_of(img, report.THING_COLOURS["box"]) > 100  # a box
    assert pixels_of(img, report.COLOURS[0]) > 500 and pixels_of(img, report.COLOURS[1]) > 200  # train and val lines
    assert pixels_of(img, report.WARN_COLOUR) > 50  # the echo-trap markers


def test_browser_filter_collapse_and_slips(tmp_path):
    """The filter view's bars (the last step, its kept groups coloured), the heatmap, and a slipped move's badge."""
    run = with_collapse(with_groups(make_run(tmp_path / "run", task="frozenlake", steps=6, rubric=("env",))))
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for r in rows:
        r["turns"][0].update(actions=["Down", "Right"], slipped=[False, True])
    write_jsonl(run / "rollouts.jsonl", rows)
    dom, img = open_in_chromium(report.build_report(run), tmp_path)
    assert dom.count('class="bar kept"') == 3 and dom.count('class="bar"') == 5  # 8 groups, 1, 3 and 5 kept
    assert "Step 6: std of each group's rewards · top_p 0.9 · kept 3 of 8" in dom
    assert dom.count('class="slipped"') == 1 and '>Right<small class="slipped"' in dom  # turn 1's second move
    assert pixels_of(img, report.KEPT_COLOUR) > 300 and pixels_of(img, report.OWN_COLOUR) > 200


def test_browser_tiny_bandit_run(tmp_path):
    """A real 2-step run of starpo_bandit.py: its report opens from file:// without errors and shows charts and arms."""
    if find_chromium() is None:
        pytest.skip("no Chromium: install Debian's `chromium` package (apt-get install -y chromium; .ci/run does)")
    run = tmp_path / "bandit"
    cmd = [
        sys.executable,
        str(ROOT / "starpo_bandit.py"),
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--val-size",
        "8",
        "--n-groups",
        "2",
        "--group-size",
        "4",
        "--sample-every",
        "0",
        "--output-dir",
        str(run),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    dom, img = open_in_chromium(report.build_report(run), tmp_path)
    assert dom.count('class="arm') >= 2 and "Phoenix" in dom and "Dragon" in dom
    assert pixels_of(img, report.COLOURS[0]) > 500 and pixels_of(img, report.COLOURS[1]) > 200  # train and val lines
    assert pixels_of(img, report.ARM_CHOSEN_COLOUR) > 4000 or "no valid arm chosen" in dom  # the chosen arm's card
    assert math.isfinite(embedded_data((run / "report.html").read_text())["rollouts"][0]["score"])


def test_help_and_bad_usage():
    for flag in ("--help", "-h"):
        res = subprocess.run([sys.executable, "-m", "plumbing.report", flag], capture_output=True, text=True, cwd=ROOT)
        assert (
            res.returncode == 0 and res.stdout.startswith("usage: python -m plumbing.report RUN_DIR") and not res.stderr
        )
    for bad in (["--bogus"], ["a", "b"], []):
        res = subprocess.run([sys.executable, "-m", "plumbing.report", *bad], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 2 and not res.stdout and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "usage: python -m plumbing.report RUN_DIR" in res.stderr
