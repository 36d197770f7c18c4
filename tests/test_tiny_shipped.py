"""The multi-turn tiny models and the bandit's tiny judges shipped in tiny/ are today's builds (their names carry the
key of the scripts' current recipe and warm-up), match tiny/SHA256SUMS, stay under 16 MB, and are what
build_tiny_model returns on an empty cache. After changing a warm-up, TINY_BUILD, the judges' lessons or TINY_VERSION:
`python tools/ship_tiny.py`."""

import json
import sys

import pytest
import torch

import plumbing.tiny
import starpo_bandit as sb
import starpo_frozenlake as fl
import starpo_sokoban as ss
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ship_tiny  # noqa: E402

SCRIPTS = {"frozenlake": fl, "sokoban": ss}


def shipped_torch() -> set:
    return {json.loads(p.read_text())["torch"] for p in plumbing.tiny.SHIPPED_TINY.glob("tiny-*/build_info.json")}


@pytest.fixture(autouse=True)
def same_torch():
    if shipped_torch() != {torch.__version__.split("+")[0]}:  # the key holds torch's version: tiny/'s names are its
        pytest.skip(f"tiny/ holds builds made with torch {sorted(shipped_torch())}; this is torch {torch.__version__}")


@pytest.mark.parametrize("task", ship_tiny.TASKS)
def test_shipped_model_is_todays_build(task, tmp_path):
    examples, recipe = ship_tiny.default_build(task, str(tmp_path / "run"))
    if task in SCRIPTS:  # what the tests' own fixtures ask for, too
        assert examples == SCRIPTS[task].tiny_warmup_examples(SCRIPTS[task].Args(**SCRIPTS[task].PRESETS["tiny"]))
    else:  # what a default bandit run with --judge tiny or tiny-gullible builds
        assert examples == sb.tiny_judge_examples([("Phoenix", "Dragon")], gullible=task.endswith("gullible"))
    name = plumbing.tiny.tiny_model_name(task, examples, **recipe)
    shipped = [p.name for p in ship_tiny.shipped(task, plumbing.tiny.SHIPPED_TINY)]
    assert shipped == [name], f"tiny/ holds {shipped}, today's recipe is {name}: run python tools/ship_tiny.py"
    assert (plumbing.tiny.SHIPPED_TINY / name / "model.safetensors").stat().st_size <= ship_tiny.MAX_MODEL_BYTES


def test_shipped_files_match_their_checksums():
    assert (plumbing.tiny.SHIPPED_TINY / "SHA256SUMS").read_text() == ship_tiny.checksums(plumbing.tiny.SHIPPED_TINY)
    files = ship_tiny.checksums(plumbing.tiny.SHIPPED_TINY).splitlines()
    assert len(files) >= len(ship_tiny.TASKS) * 6  # weights, config, tokenizer, ...


def test_an_empty_cache_gets_the_shipped_model_and_an_edited_prompt_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("STARPO_CACHE", str(tmp_path / "cache"))
    examples = ss.tiny_warmup_examples(ss.Args(**ss.PRESETS["tiny"]))
    assert plumbing.tiny.build_tiny_model("sokoban", examples, **ss.TINY_BUILD).parent == plumbing.tiny.SHIPPED_TINY
    edited = [(messages, reply + " ") for messages, reply in examples]
    assert plumbing.tiny.tiny_model_name("sokoban", edited, **ss.TINY_BUILD) != plumbing.tiny.tiny_model_name(
        "sokoban", examples, **ss.TINY_BUILD
    )
    assert not (tmp_path / "cache").exists()  # nothing was built or copied


def test_another_torch_gets_the_shipped_model_built_with_this_one(tmp_path, monkeypatch):
    """The key holds torch's version, and a GPU machine's torch is rarely the CPU wheel's (vLLM 0.33 pins 2.14.0; the
    lent GPU has 2.11): there the same recipe and data take the shipped build instead of a 30-minute build."""
    monkeypatch.setenv("STARPO_CACHE", str(tmp_path / "cache"))
    shipped_with = torch.__version__.split("+")[0]  # what tiny/'s builds were made with (the fixture checks)
    monkeypatch.setattr(plumbing.tiny.torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(plumbing.tiny, "cached_reading_stage", lambda *a, **k: pytest.fail("it built the model"))
    examples = ss.tiny_warmup_examples(ss.Args(**ss.PRESETS["tiny"]))
    name = plumbing.tiny.tiny_model_name("sokoban", examples, **ss.TINY_BUILD)
    assert not (plumbing.tiny.SHIPPED_TINY / name).exists()  # the key alone would miss it
    lines = []
    found = plumbing.tiny.build_tiny_model("sokoban", examples, **ss.TINY_BUILD, log=lines.append)
    assert found.parent == plumbing.tiny.SHIPPED_TINY and f"torch {shipped_with} (2.11.0 here)" in lines[0]
    edited = [(messages, reply + " ") for messages, reply in examples]  # an edited prompt still builds its own
    with pytest.raises(pytest.fail.Exception, match="built the model"):
        plumbing.tiny.build_tiny_model("sokoban", edited, **ss.TINY_BUILD, log=lines.append)


@pytest.mark.parametrize("task", list(ship_tiny.tiny_probe.TASKS))
def test_shipped_multi_turn_builds_play_their_pick(task, tmp_path):
    """tools/ship_tiny.py ships a FrozenLake or Sokoban build only if its answers play its think's pick (RESULTS
    2026-12-08: a Sokoban build that played it on 0.76 of these turns did not learn RL); the shipped ones do."""
    examples, recipe = ship_tiny.default_build(task, str(tmp_path / "run"))
    model = plumbing.tiny.SHIPPED_TINY / plumbing.tiny.tiny_model_name(task, examples, **recipe)
    assert ship_tiny.plays_pick(task, model) >= ship_tiny.PLAYS_PICK
