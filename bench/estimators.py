"""Multi-turn credit on a laptop: the tiny preset's turn-grpo against GiGPO, and rollout freshness (RAGEN's Online-k).

    python bench/estimators.py frozenlake --seeds 0 1 2     # 3 estimators x 3 seeds of `python starpo_frozenlake.py`
    python bench/estimators.py sokoban --seeds 0 --estimators gigpo   # some of them
    python bench/estimators.py frozenlake --sweep freshness --seeds 0   # --rollout-reuse 1, 2, 4 instead
    python bench/estimators.py frozenlake --seeds --merge /tmp/a.json /tmp/b.json   # add runs measured elsewhere

Each run is the task's default command (the tiny preset, warm model cache) with the variant's flags added:
`turn-grpo` = the command as it is (the tiny preset's estimator), `gigpo` = --estimator gigpo (GiGPO's anchor: the
observation alone; gamma 0.95, omega 1, mean_norm, the paper's), `gigpo-h2` = the same with --gigpo-history 2 (the
anchor adds the last two moves: HGPO's guard against pooling turns whose prompts differ). The freshness sweep
trains the default command with --rollout-reuse 1, 2 and 4 at the same number of steps (updates). Writes
bench/results/estimators_<task>.json or freshness_<task>.json in bench/filters.py's schema (per run: val/success by
step and wall time, ...; per variant under "by_variant": the mean over seeds).
"""

from __future__ import annotations

import argparse
import sys

import filters

ESTIMATORS = {
    "turn-grpo": [],
    "gigpo": ["--estimator", "gigpo"],
    "gigpo-h2": ["--estimator", "gigpo", "--gigpo-history", "2"],
}
FRESHNESS = {"reuse1": [], "reuse2": ["--rollout-reuse", "2"], "reuse4": ["--rollout-reuse", "4"]}

SWEEPS = {"estimators": ESTIMATORS, "freshness": FRESHNESS}


def main(argv=None) -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--sweep", choices=list(SWEEPS), default="estimators")
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    filters.main(rest, SWEEPS[known.sweep], known.sweep, __doc__)


if __name__ == "__main__":
    main()
