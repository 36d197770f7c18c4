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
    warn_at=(),
    rubric=("env", "format"),
    text="<think> go down </think> <answer> Down </answer>",
    rollouts=True,
    config=True,
):
    """A run directory shaped like the scripts' output: config.json, metrics.jsonl, rollouts.jsonl."""
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
        if step in warn_at:
            m["warn/echo_trap"] = 1
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


def test_echo_trap_markers_on_every_chart(tmp_path):
    page = build(make_run(tmp_path / "run", warn_at=(3, 5)))
    n_charts = page.count('<figure class="chart"')
    assert page.count('<g class="echo-trap">') == 2 * n_charts
    assert "echo-trap warning at step 3" in figure(page, "Entropy") and "echo-trap warning at step 5" in page
    assert "step 3, step 5" in page  # listed in the header
    assert 'class="echo-trap"' not in build(make_run(tmp_path / "calm"))


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
    run = make_run(tmp_path / "run", text=EVIL, warn_at=(3,))
    dom, img = open_in_chromium(report.build_report(run), tmp_path)
    assert 'class="grid-board"' in dom and "alert(1)" in dom  # the reply is shown, as text
    assert pixels_of(img, report.CELL_STYLE["wall"][0]) > 15 * 28 * 28  # the walls: 23 cells of 30 x 30 px per turn
    assert pixels_of(img, report.THING_COLOURS["box"]) > 100  # a box
    assert pixels_of(img, report.COLOURS[0]) > 500 and pixels_of(img, report.COLOURS[1]) > 200  # train and val lines
    assert pixels_of(img, report.WARN_COLOUR) > 50  # the echo-trap markers


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
