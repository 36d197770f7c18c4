"""Benchmark: can the embedded tiny model even represent a FrozenLake or Sokoban policy? A supervised probe, not RL.

RL on these tasks is only as good as the model's ability to turn what it reads in the prompt into a move. This probe
asks that question directly, with the easiest possible teacher: it fine-tunes each script's own tiny model (built
exactly as the script builds it, from the same cache) on clean labels, the first move of a shortest solution, and
measures how often its first answer word is that move on held-out states, next to the majority-class baseline
(always answering the most common label). Labels come from a solver here only: no training script ever sees them.

Two prompts per task, each built with the script's own prompt functions:
  grid  the script's observation, as RL sees it;
  copy  the same, plus a last line "Best move: X." that states the label: the model only has to copy one word.

If a few hundred clean supervised steps do not lift `copy` above the majority class, the few hundred noisy RL steps
a CPU affords within the issues' time targets cannot teach `grid` either: the model lacks in-context reading, and
the fix is a model that has it (a pretrained one), not a different RL setting.

    python bench/tiny_probe.py                        # both tasks, both prompts; writes bench/results/tiny_probe.json
    python bench/tiny_probe.py --steps 4 --eval-every 2 --train-size 32 --test-size 8 --out /tmp/probe.json  # plumbing
"""

import argparse
import json
import random
import re
import sys
import time
from collections import Counter, deque
from pathlib import Path

import harness

sys.path.insert(0, str(harness.ROOT))

import torch  # noqa: E402

import plumbing.cpu  # noqa: E402
import plumbing.engine  # noqa: E402
import plumbing.tiny  # noqa: E402
import starpo_frozenlake as fl  # noqa: E402
import starpo_sokoban as sk  # noqa: E402


def frozenlake_states(n: int, first_seed: int, rng: random.Random) -> list[tuple[list[dict], str, str]]:
    """(messages, thought, label): a random map, the player on a random frozen cell from which the goal can be
    reached, and the first move of a shortest hole-free path (ties: the script's ACTIONS order)."""
    args, out, seed = fl.Args(), [], first_seed
    while len(out) < n:
        env = fl.FrozenLakeEnv(slippery=False)
        env.reset(seed)
        seed += 1
        goal, size = fl.find(env.desc, "G"), len(env.desc)
        dist, queue = {goal: 0}, deque([goal])  # breadth-first search from the goal over non-hole cells
        while queue:
            r, c = queue.popleft()
            for dr, dc in fl.MOVES:
                cell = (r + dr, c + dc)
                if (
                    0 <= cell[0] < size
                    and 0 <= cell[1] < size
                    and env.desc[cell[0]][cell[1]] != "H"
                    and cell not in dist
                ):
                    dist[cell] = dist[(r, c)] + 1
                    queue.append(cell)
        cells = [cell for cell, d in dist.items() if d > 0]
        env.pos = rng.choice(sorted(cells))
        step = lambda a: (env.pos[0] + fl.MOVES[a][0], env.pos[1] + fl.MOVES[a][1])  # noqa: E731
        best = min(range(4), key=lambda a: dist.get(step(a), 99))
        messages = fl.first_messages(env.observation(), args)
        out.append((messages, fl.world_model_think(env), fl.ACTIONS[best]))
    return out


def sokoban_states(n: int, first_seed: int, rng: random.Random) -> list[tuple[list[dict], str, str]]:
    """(messages, thought, label): a generated room, the world model's correct thought about it, and the first move
    of the solver's shortest solution."""
    args, out, seed = sk.Args(), [], first_seed
    env = sk.make_env(args)
    while len(out) < n:
        obs = env.reset(seed)
        seed += 1
        path = sk.solve(env)
        if path:
            out.append((sk.first_messages(obs, args), sk.world_model_think(env), path[0]))
    return out


TASKS = {
    "frozenlake": dict(script=fl, states=frozenlake_states, actions=fl.ACTIONS),
    "sokoban": dict(script=sk, states=sokoban_states, actions=list(sk.ACTIONS)),
}


def with_hint(messages: list[dict], label: str) -> list[dict]:
    """The `copy` prompt: the last user message ends with a line that states the label."""
    last = dict(messages[-1], content=messages[-1]["content"] + f"\nBest move: {label}.")
    return messages[:-1] + [last]


def probe(
    task: str,
    prompt: str,
    steps: int,
    eval_every: int,
    lr: float,
    batch_size: int,
    train_size: int,
    test_size: int,
    seed: int,
) -> dict:
    spec = TASKS[task]
    script = spec["script"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = plumbing.tiny.build_tiny_model(
        task, script.tiny_warmup_examples(script.Args(**script.PRESETS["tiny"])), **script.TINY_BUILD
    )
    tok = AutoTokenizer.from_pretrained(path)
    plumbing.cpu.seed_everything(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(seed)
    train = spec["states"](train_size, 7 * 10**8, rng)  # seeds no script trains or evaluates on
    test = spec["states"](test_size, 8 * 10**8, rng)
    if prompt == "copy":
        train = [(with_hint(m, y), t, y) for m, t, y in train]
        test = [(with_hint(m, y), t, y) for m, t, y in test]
    word_ids = {a: tok(" " + a, add_special_tokens=False)["input_ids"][0] for a in spec["actions"]}
    assert len(set(word_ids.values())) == len(word_ids), "each move must start with its own token"

    def accuracy() -> float:
        """Share of held-out states whose most likely first answer word (among the moves) is the label."""
        model.eval()
        hits = 0
        with torch.no_grad():
            for messages, thought, label in test:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tok(text + f"<think> {thought} </think> <answer>", add_special_tokens=False, return_tensors="pt")[
                    "input_ids"
                ]
                logits = model(input_ids=ids).logits[0, -1]  # (V,)
                hits += max(word_ids, key=lambda a: logits[word_ids[a]].item()) == label
        model.train()
        return hits / len(test)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve, t0 = [(0, accuracy())], time.time()
    model.train()
    for step in range(1, steps + 1):
        batch = rng.sample(train, batch_size)
        rows = []
        for messages, thought, label in batch:
            p = tok(
                tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )["input_ids"]
            r = tok(f"<think> {thought} </think> <answer> {label} </answer>", add_special_tokens=False)["input_ids"]
            rows.append((p + r + [tok.eos_token_id], len(p)))
        input_ids, labels, attn = plumbing.tiny.sft_batch(rows, tok.pad_token_id)  # (B, T) each: loss on the reply only
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % eval_every == 0 or step == steps:
            curve.append((step, accuracy()))
            print(f"{task:10s} {prompt:4s} step {step:4d}  held-out accuracy {curve[-1][1]:.3f}", flush=True)
    majority = Counter(label for _, _, label in test).most_common(1)[0]
    return {
        "task": task,
        "prompt": prompt,
        "model": path.name,
        "curve": curve,
        "best": max(a for _, a in curve[1:] or curve),
        "majority_class": majority[0],
        "majority_accuracy": majority[1] / len(test),
        "train_seconds": round(time.time() - t0, 1),
    }


def world_probe(
    task: str, test_size: int, seed: int, reading_steps: int = 0, outcomes: bool = False, model_dir: str = ""
) -> dict:
    """After the world-model warm-up, on held-out first turns (seeds no script trains or evaluates on): how often
    the model's own think (greedy) states each fact of world_model_think right: the player's cell, the goal's or
    box's and target's, the offset, and what each move would do; and how often the whole think is right.
    reading_steps > 0: the script's tiny model built with a reading stage first (plumbing.tiny.reading_stage; built into
    $STARPO_CACHE on first use), its copy probe after the reading stage and after the warm-up reported too.
    outcomes: the --outcomes observation (the think restates its Moves line, then picks: the whole think
    counts as right when the restated line is, whatever it picks). model_dir: probe that model
    (e.g. a run's warmup/ folder) instead of building one."""
    script = TASKS[task]["script"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = script.Args(outcomes=True) if outcomes else script.Args()
    build = dict(script.TINY_BUILD, **({"reading_steps": reading_steps} if reading_steps else {}))
    path = (
        Path(model_dir)
        if model_dir
        else plumbing.tiny.build_tiny_model(task, script.tiny_warmup_examples(args), **build)
    )
    info_file = path / "build_info.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, truths, envs = [], [], []
    for i in range(test_size):
        env = script.make_env(args)
        obs = env.reset(9 * 10**8 + i)
        envs.append(env)
        text = tok.apply_chat_template(script.first_messages(obs, args), add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
        truths.append(script.world_model_think(env))
    plumbing.cpu.seed_everything(seed)
    t0 = time.time()
    replies = plumbing.engine.hf_generate(
        model, tok, prompts, 1e-4, 1.0, 128, batch_size=64
    )  # temperature ~0: the model's best guess
    facts, exact, formatted, picks = {}, 0, 0, []
    for (ids, _), truth, env in zip(replies, truths, envs):
        think, answer = script.parse_reply(tok.decode(ids, skip_special_tokens=True))
        if outcomes:  # the pick ("... wall Up. to Down"): its word is what its move reaches; the answer is its move
            word, _, move = (think or "").rsplit(". ", 1)[-1].partition(" ")
            consistent = move in script.ACTIONS and env.outcome(move) == word
            good = ("to", "goal", "push", "target")  # the words of a move toward the goal (FrozenLake) or box/target
            picks.append((consistent, (answer or "").strip() == move, consistent and word in good))
        formatted += think is not None and answer is not None
        exact += think == truth or bool(outcomes and think and think.startswith(truth + ". "))  # (then its pick)
        said = re.split(r"[.,:]\s+", think) if think else []
        for k, fact in enumerate(re.split(r"[.,:]\s+", truth)):
            move = [w for w in fact.split() if w in script.ACTIONS]  # "Left _" or, with --outcomes, "ice Left"
            name = move[0] if len(move) == 1 and len(fact.split()) == 2 else ["player", "second", "third"][min(k, 2)]
            facts.setdefault(name, []).append(k < len(said) and said[k] == fact)
    return {
        "task": task,
        "model": path.name,
        "test_size": test_size,
        "well_formed": formatted / test_size,
        "exact_think": exact / test_size,
        "facts": {k: round(sum(v) / len(v), 3) for k, v in facts.items()},
        "seconds": round(time.time() - t0, 1),
        "outcomes": outcomes,
        **(
            {
                "pick_consistent": sum(p[0] for p in picks) / test_size,  # its word is what its move reaches
                "answer_copies_pick": sum(p[1] for p in picks) / test_size,
                "pick_to_or_goal": sum(p[2] for p in picks) / test_size,  # what RL raises
            }
            if outcomes
            else {}
        ),
        "build_seconds": info.get("build_seconds"),
        "reading_probe": info.get("reading_probe"),
        "example": {"truth": truths[0], "said": tok.decode(replies[0][0], skip_special_tokens=True)},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", action="store_true", help="the world-model probe instead (writes tiny_probe_world.json)")
    ap.add_argument(
        "--reading", type=int, default=0, metavar="STEPS", help="--world: on a build with a reading stage of STEPS"
    )
    ap.add_argument("--outcomes", action="store_true", help="--world: the --outcomes observation and think")
    ap.add_argument("--model", default="", help="--world: probe this model folder instead of building the recipe's")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--prompts", nargs="+", default=["grid", "copy"], choices=["grid", "copy"])
    ap.add_argument("--steps", type=int, default=300, help="supervised steps per probe")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument(
        "--lr", type=float, default=1e-3, help="AdamW learning rate (the warm-up's is 3e-3, RL's 1e-4..2e-4)"
    )
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--train-size", type=int, default=2000, help="distinct labelled states to sample batches from")
    ap.add_argument("--test-size", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "tiny_probe.json"))
    a = ap.parse_args()
    load_start, t0 = harness.os.getloadavg(), time.time()
    if a.world:
        if a.model and len(a.tasks) != 1:
            ap.error("--model probes one task's model: name it with --tasks")
        runs = [world_probe(task, a.test_size, a.seed, a.reading, a.outcomes, a.model) for task in a.tasks]
        for r in runs:
            print(
                f"{r['task']:10s} well formed {r['well_formed']:.3f}  exact think {r['exact_think']:.3f}  {r['facts']}"
                + "".join(
                    f"  {k} {r[k]:.3f}" for k in ("pick_consistent", "answer_copies_pick", "pick_to_or_goal") if k in r
                )
            )
        out = (
            a.out
            if a.out != ap.get_default("out")
            else str(harness.ROOT / "bench" / "results" / "tiny_probe_world.json")
        )
        result = dict(
            benchmark="tiny_probe_world",
            command="python bench/tiny_probe.py " + " ".join(sys.argv[1:]),
            runs=runs,
            wall_seconds=round(time.time() - t0, 1),
            machine=harness.machine(load_start),
        )
        harness.write_result(out, result)
        return
    runs = [
        probe(task, prompt, a.steps, a.eval_every, a.lr, a.batch_size, a.train_size, a.test_size, a.seed)
        for task in a.tasks
        for prompt in a.prompts
    ]
    result = {
        "benchmark": "tiny_probe",
        "command": "python bench/tiny_probe.py " + " ".join(sys.argv[1:]),
        "settings": {
            k: getattr(a, k) for k in ("steps", "eval_every", "lr", "batch_size", "train_size", "test_size", "seed")
        },
        "runs": runs,
        "learned": {f"{r['task']}/{r['prompt']}": r["best"] >= r["majority_accuracy"] + 0.15 for r in runs},
        "wall_seconds": round(time.time() - t0, 1),
        "machine": harness.machine(load_start),
    }
    harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
