"""The recipe in docs/ADD_ENVIRONMENT.md, done by a test: copy starpo_frozenlake.py, replace its ENVIRONMENT
section (and the task's name and rules) with a toy corridor, and train it for one step. Nothing else is edited:
rollout, the update, the report and the copies check must work for a task they have never seen."""

import json
import shutil
import sys

import plumbing.tiny
import starpo_frozenlake as fl
from conftest import ROOT, run_script_file

BANNER = "#" * 120 + "\n"
CORRIDOR = '''########################################################################################################################
# ENVIRONMENT
########################################################################################################################

ACTIONS = ["Left", "Right"]  # the move words parse_actions accepts


class CorridorEnv:
    """A 1 x size corridor: walk Right to the goal at the far end. Reward 1 on the goal."""

    def __init__(self, size: int = 4):
        self.size, self.pos = size, 0

    def reset(self, seed: int) -> str:
        self.pos = seed % (self.size - 1)
        return self.render()

    def render(self) -> str:
        return " ".join("P" if i == self.pos else "G" if i == self.size - 1 else "_" for i in range(self.size))

    def describe(self) -> dict:
        return dict(grid=[self.render().split(" ")], legend={"P": "player", "_": "floor", "G": "goal"}, player=[0, self.pos])

    def step(self, action: str):
        move = {"left": -1, "right": 1}.get(action.strip().lower())
        before = self.pos
        self.pos = min(max(self.pos + (move or 0), 0), self.size - 1)
        done = self.pos == self.size - 1
        info = {"success": done, "action_is_valid": move is not None, "action_is_effective": self.pos != before}
        return self.render(), float(done), done, info


SIZE = 4  # the corridor's length (a constant of the file, as FrozenLake's lake size)


def make_env(args: Args) -> CorridorEnv:
    return CorridorEnv(SIZE)


def baselines(args: Args) -> dict:
    return {"val/random_success": float("nan"), "val/optimal_success": 1.0}


'''


def make_corridor_script(folder):
    text = (ROOT / "starpo_frozenlake.py").read_text()
    start, end = text.index(BANNER + "# ENVIRONMENT"), text.index(BANNER + "# RUBRIC")
    text = text[:start] + CORRIDOR + text[end:]  # step 1: the ENVIRONMENT section
    text = text.replace('TASK = "frozenlake"', 'TASK = "corridor"')  # step 2: the task's name
    old_rules = text[text.index("RULES = (") : text.index("FORMAT_PROMPT = ")]
    text = text.replace(
        old_rules, 'RULES = "Corridor: reach G. Moves: Left, Right. Up to {per_turn} a turn, {per_traj} in all."\n'
    )
    (folder / "starpo_corridor.py").write_text(text)
    for name in ("common.py", "starpo_sokoban.py", "starpo_bandit.py"):  # the maths, the copies' sources
        shutil.copy(ROOT / name, folder / name)
    shutil.copytree(ROOT / "plumbing", folder / "plumbing")
    shutil.copytree(ROOT / "tools", folder / "tools")


def test_the_recipe_trains_a_new_environment_for_one_step(tmp_path):
    folder = tmp_path / "fork"
    folder.mkdir()
    make_corridor_script(folder)
    model = plumbing.tiny.build_tiny_model(
        "frozenlake", fl.tiny_warmup_examples(fl.Args(**fl.PRESETS["tiny"])), **fl.TINY_BUILD
    )  # cached
    out = tmp_path / "run"
    r = run_script_file(
        str(folder / "starpo_corridor.py"),
        "--model",
        str(model),
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--val-size",
        "4",
        "--n-groups",
        "2",
        "--group-size",
        "3",
        "--eval-every",
        "1",
        "--sample-every",
        "1",
        "--output-dir",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1] and rows[0]["val/optimal_success"] == 1.0
    assert {"train/success", "train/action_is_effective", "actor/pg_loss", "response_length/mean"} <= set(rows[1])
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rollouts} == {"corridor"}
    view = rollouts[0]["turns"][0]["view"]
    assert len(view["grid"]) == 1 and view["legend"]["G"] == "goal"
    html = (out / "report.html").read_text()
    assert '"legend": {"P": "player", "_": "floor", "G": "goal"}' in html  # the viewer draws the corridor
    # the fork's copies are still exact copies, so the check keeps guarding them
    sys.path.insert(0, str(folder / "tools"))
    import check_copies

    assert check_copies.check(folder) == []
