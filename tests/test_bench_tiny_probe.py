"""bench/tiny_probe.py: its labels are shortest-solution first moves, the copy prompt states them, and it runs."""

import json
import os
import subprocess
import sys


import starpo_frozenlake as fl
import starpo_sokoban as sk
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import tiny_probe  # noqa: E402
import plumbing.tiny


def test_frozenlake_labels_step_onto_a_shortest_path():
    import random

    for messages, thought, label in tiny_probe.frozenlake_states(40, 10**6, random.Random(1)):
        lake = [row.replace(" ", "") for row in messages[-1]["content"].split("State:\n")[1].split("\n")[:4]]
        desc = ["".join({"P": "F", "_": "F", "O": "H", "G": "G"}[ch] for ch in row) for row in lake]
        start = next((r, row.index("P")) for r, row in enumerate(lake) if "P" in row)

        def dist(cell):  # independent breadth-first search, from the cell to the goal
            seen, frontier, d = {cell}, [cell], 0
            while frontier:
                if any(desc[r][c] == "G" for r, c in frontier):
                    return d
                nxt = []
                for r, c in frontier:
                    for dr, dc in fl.MOVES:
                        n = (r + dr, c + dc)
                        if 0 <= n[0] < 4 and 0 <= n[1] < 4 and desc[n[0]][n[1]] != "H" and n not in seen:
                            seen.add(n)
                            nxt.append(n)
                frontier, d = nxt, d + 1
            return None

        dr, dc = fl.MOVES[fl.ACTIONS.index(label)]
        after = (start[0] + dr, start[1] + dc)
        assert 0 <= after[0] < 4 and 0 <= after[1] < 4 and desc[after[0]][after[1]] != "H"
        assert dist(after) == dist(start) - 1, (lake, label)
        cells = [list(row) for row in desc]
        cells[start[0]][start[1]] = "S"
        env = fl.FrozenLakeEnv(desc=["".join(row) for row in cells], slippery=False)
        env.reset(0)
        assert thought == fl.world_model_think(env)  # the world model's correct thought about this very state


def test_sokoban_labels_start_a_shortest_solution():
    import random

    states = tiny_probe.sokoban_states(3, 10**6, random.Random(1))
    assert all(label in sk.ACTIONS and thought.startswith("at ") for _, thought, label in states)
    env, seed = sk.SokobanEnv(), 10**6
    obs, path = env.reset(seed), sk.solve(env)
    while not path:  # the probe skips rooms the solver cannot solve (or that start solved)
        seed += 1
        obs, path = env.reset(seed), sk.solve(env)
    assert states[0][2] == path[0] and obs in states[0][0][-1]["content"]
    env.step(path[0])
    assert len(sk.solve(env)) == len(path) - 1  # one move shorter after the label: it starts a shortest solution


def test_copy_prompt_states_the_label_and_grid_prompt_does_not():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "lake"}]
    hinted = tiny_probe.with_hint(messages, "Down")
    assert hinted[-1]["content"] == "lake\nBest move: Down." and messages[-1]["content"] == "lake"
    assert hinted[0] == messages[0]


def test_probe_runs_and_writes_its_result(tmp_path):
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "tiny_probe.py"),
            "--tasks",
            "frozenlake",
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--train-size",
            "16",
            "--test-size",
            "6",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["task"], r["prompt"]) for r in result["runs"]] == [("frozenlake", "grid"), ("frozenlake", "copy")]
    for r in result["runs"]:
        assert [s for s, _ in r["curve"]] == [0, 1, 2]
        assert all(0 <= a <= 1 for _, a in r["curve"]) and 0 < r["majority_accuracy"] <= 1
        assert r["majority_class"] in fl.ACTIONS
    assert set(result["learned"]) == {"frozenlake/grid", "frozenlake/copy"}


def test_world_probe_scores_a_given_model_against_the_outcomes_think():
    """--world --outcomes --model DIR: the think's facts are the Moves line's four words, one per move."""

    path = plumbing.tiny.build_tiny_model(
        "frozenlake", fl.tiny_warmup_examples(fl.Args(**fl.PRESETS["tiny"])), **fl.TINY_BUILD
    )  # shipped
    r = tiny_probe.world_probe("frozenlake", 4, 0, outcomes=True, model_dir=str(path))
    assert r["outcomes"] and set(r["facts"]) == set(fl.ACTIONS) and r["test_size"] == 4
    assert all(0 <= r[k] <= 1 for k in ("pick_consistent", "answer_copies_pick", "pick_to_or_goal"))
    assert r["pick_to_or_goal"] <= r["pick_consistent"]
    assert all(0 <= v <= 1 for v in r["facts"].values()) and 0 <= r["exact_think"] <= 1
    env = fl.FrozenLakeEnv(outcomes=True)
    env.reset(9 * 10**8)  # the probe's first held-out map
    line = env.observation().split("\nMoves: ")[1][:-1]  # "Left ice, Down to, ..."
    assert (
        r["example"]["truth"]
        == fl.world_model_think(env)
        == ", ".join(" ".join(p.split()[::-1]) for p in line.split(", "))
    )
