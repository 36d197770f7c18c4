"""plumbing/judge.py: the rubric's judge component, its metrics, the local and HTTP judges, the cache. Offline: the
HTTP judge talks to a small fake server on 127.0.0.1; the local judge runs a shipped tiny model."""

import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import ROOT
from plumbing import judge as J


# ---- Component and prefetch -----------------------------------------------------------------------------------------


class Turn:
    def __init__(self, text, label):
        self.text, self.label = text, label


class FakeJudge:
    """Scores each prompt by the turn text it holds: {text: score or None}."""

    model_id = "fake"
    decoding = {"max_tokens": 1}

    def __init__(self, table):
        self.table, self.calls = table, []

    def score(self, prompts):
        self.calls.append(prompts)
        return [next((s for t, s in self.table.items() if f"<<{t}>>" in p), None) for p in prompts]


def test_component_returns_the_stored_score_and_none_is_never_a_number():
    turns = [Turn(f"t{i}", lab) for i, lab in enumerate([True, False, True, False, True, True])]
    scores = {"t0": 0.9, "t1": 0.2, "t2": None, "t3": 0.7, "t4": 0.4, "t5": 0.5}
    fake = FakeJudge(scores)
    moves = J.Component("moves_left", "Does it move Left?", render=lambda t: f"<<{t.text}>>", truth=lambda t: t.label)
    assert moves.__name__ == "moves_left" and moves(turns[0]) is None  # never judged
    m = J.prefetch(fake, [moves], turns)
    assert len(fake.calls) == 1 and len(fake.calls[0]) == 6  # one batch
    assert "Does it move Left?" in fake.calls[0][0] and "<<t0>>" in fake.calls[0][0] and "yes or no" in fake.calls[0][0]
    assert [moves(t) for t in turns] == [0.9, 0.2, None, 0.7, 0.4, 0.5]
    assert moves(Turn("t0", True)) is None  # keyed by the turn object, not its content
    # 5 successful verdicts: yes/T, no/F, yes/F (false positive), no/T (false negative), 0.5 = yes/T
    assert m["judge/agreement"] == pytest.approx(3 / 5)
    assert m["judge/false_positive"] == pytest.approx(1 / 5) and m["judge/false_negative"] == pytest.approx(1 / 5)
    assert m["judge/fail_frac"] == pytest.approx(1 / 6) and m["judge/latency_s"] >= 0
    assert (m["judge/n_asked"], m["judge/n_failed"], m["judge/n_checked"]) == (6, 1, 5)
    assert not any(k.startswith("judge/moves_left") for k in m)  # one component: no per-component keys
    # a new batch forgets the old turns
    new = [Turn("t1", False)]
    J.prefetch(fake, [moves], new)
    assert moves.scores == {id(new[0]): 0.2} and moves(turns[0]) is None


def test_several_components_and_a_step_of_batches():
    turns = [Turn("a", True), Turn("b", False)]
    fake = FakeJudge({"a": 0.8, "b": 0.9, "B": None})
    with_truth = J.Component("c1", "Q1?", render=lambda t: f"<<{t.text}>>", truth=lambda t: t.label)
    no_truth = J.Component("c2", "Q2?", render=lambda t: f"<<{t.text.upper()}>>")
    m = J.prefetch(fake, [with_truth, no_truth], turns)
    assert [no_truth(t) for t in turns] == [None, None]  # "A" is in no prompt of the table either
    assert m["judge/fail_frac"] == pytest.approx(2 / 4) and m["judge/c2/fail_frac"] == 1.0
    assert m["judge/c1/fail_frac"] == 0.0 and m["judge/c1/agreement"] == 0.5 and m["judge/agreement"] == 0.5
    assert m["judge/c1/false_positive"] == 0.5 and "judge/c2/agreement" not in m  # nothing to check it against
    step = J.combine(m, J.prefetch(fake, [with_truth, no_truth], turns[:1]))
    assert step["judge/n_asked"] == 6 and step["judge/fail_frac"] == pytest.approx(3 / 6)
    assert step["judge/c1/agreement"] == pytest.approx(2 / 3)


def test_a_bad_score_from_a_backend_is_a_failure():
    turns = [Turn("a", True), Turn("b", True)]
    c = J.Component("c", "Q?", render=lambda t: f"<<{t.text}>>", truth=lambda t: t.label)
    m = J.prefetch(FakeJudge({"a": float("nan"), "b": 1.5}), [c], turns)
    assert c(turns[0]) is None and c(turns[1]) is None and m["judge/fail_frac"] == 1.0 and "judge/agreement" not in m
    with pytest.raises(ValueError):
        J.Component("not a name", "Q?", render=str)


# ---- LocalJudge on a shipped tiny model ------------------------------------------------------------------------------


TINY = sorted((ROOT / "tiny").glob("tiny-sokoban-*"))[0]
PROMPTS = [
    J.render_prompt(q, c)
    for q in ("Does the reply move Left?", "Is the answer well formed?", "Does the reasoning name the player?")
    for c in ("<think> at 0 1: Left </think> <answer> Left </answer>", "I go Up", "<answer> Down Down </answer>")
]


@pytest.fixture(scope="module")
def local():
    return J.LocalJudge(TINY, batch_size=4)


def reference_score(jd, prompt):
    """Naive: each answer word's log-prob from its own unpadded pass (single token: the best spelling; else the
    whole sequence, teacher-forced)."""
    import torch

    ids = jd.prompt_ids(prompt)
    logp = {}
    for word in ("yes", "no"):
        if jd.single[word]:
            with torch.no_grad():
                lp = torch.log_softmax(jd.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            logp[word] = max(lp[i].item() for i in jd.single[word])
        else:
            seq = jd.multi[word]
            with torch.no_grad():
                lp = torch.log_softmax(jd.model(input_ids=torch.tensor([ids + seq])).logits[0].float(), -1)
            logp[word] = sum(lp[len(ids) - 1 + k, t].item() for k, t in enumerate(seq))
    return 1 / (1 + math.exp(logp["no"] - logp["yes"]))


def test_local_judge_scores_match_one_prompt_at_a_time(local):
    assert local.multi == {"yes": local.tok("yes")["input_ids"]} and len(local.multi["yes"]) == 2  # 'y' + 'es'
    assert local.single["no"] and not local.single["yes"]  # 'no' and ' no' are tokens; no spelling of yes is
    batched = local.score(PROMPTS)
    assert all(0 < s < 1 for s in batched)
    alone = [local.score([p])[0] for p in PROMPTS]
    assert batched == pytest.approx(alone, abs=1e-5)  # left padding and batch-mates change nothing
    assert batched == pytest.approx([reference_score(local, p) for p in PROMPTS], abs=1e-5)
    assert local.score(PROMPTS) == batched  # deterministic
    assert "y" in local.describe() and "tiny-sokoban" in local.describe()


def test_local_judge_with_two_split_words_and_a_loaded_model(local):
    """Neither word a single token ('y'+'es', 'N'+'o'): each prompt takes two rows of the one pass."""
    two = J.LocalJudge(local.model, local.tok, batch_size=5, model_id="tiny", yes=("yes",), no=("No",))
    assert set(two.multi) == {"yes", "no"} and len(two.rows) == 2 and two.model_id == "tiny"
    scores = two.score(PROMPTS)
    assert scores == pytest.approx([reference_score(two, p) for p in PROMPTS], abs=1e-5)
    assert scores != pytest.approx(local.score(PROMPTS), abs=1e-3)  # another answer word, another score
    assert two.decoding != local.decoding  # so another cache key


def test_local_judge_fails_a_prompt_too_long_for_the_model(local):
    long = J.render_prompt("Q?", "word " * 3000)
    assert len(local.prompt_ids(long)) > local.max_len
    assert local.score([PROMPTS[0], long]) == [local.score([PROMPTS[0]])[0], None]


# ---- HTTPJudge against a fake OpenAI-compatible server ---------------------------------------------------------------


def chat_reply(text, top=None):
    """A /v1/chat/completions body: the reply text and, optionally, the first token's top log-probs {token: p}."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    if top is not None:
        entries = [{"token": t, "logprob": math.log(p), "bytes": None} for t, p in top.items()]
        choice["logprobs"] = {"content": [{"token": text, "logprob": entries[0]["logprob"], "top_logprobs": entries}]}
    return {"id": "x", "object": "chat.completion", "choices": [choice]}


class FakeServer:
    """An OpenAI-compatible endpoint on 127.0.0.1: `plan(n, body)` -> (status, reply dict, delay_s) for the n-th
    request. Records each request's path, body and Authorization header, and the most requests in flight at once."""

    def __init__(self, plan):
        self.plan, self.requests, self.in_flight, self.most_in_flight = plan, [], 0, 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    n = len(outer.requests)
                    outer.requests.append((self.path, body, self.headers.get("Authorization")))
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                try:
                    status, reply, delay = outer.plan(n, body)
                    time.sleep(delay)
                    data = json.dumps(reply).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    made = []

    def start(plan):
        made.append(FakeServer(plan))
        return made[-1]

    yield start
    for s in made:
        s.close()


def fast(url, **kw):
    return J.HTTPJudge(url, "judge-model", **{"timeout_s": 2, "retries": 2, "backoff_s": 0.01, **kw})


def test_http_logprobs_path(server):
    s = server(lambda n, body: (200, chat_reply("Yes", {"Yes": 0.6, " no": 0.2, "No": 0.1, "maybe": 0.05}), 0))
    jd = fast(s.url)
    assert jd.score(["Is it?"]) == [pytest.approx(0.6 / (0.6 + 0.2))]  # best spelling of each word
    path, body, _ = s.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge-model"
    assert body["messages"] == [{"role": "user", "content": "Is it?"}]
    assert body["max_tokens"] == 1 and body["temperature"] == 0 and body["logprobs"] is True
    assert body["top_logprobs"] == 20 and "yes" not in body  # how the reply is read stays on this side
    assert fast(s.url + "/v1/").url == s.url + "/v1/chat/completions"  # a base URL with /v1 already


@pytest.mark.parametrize(
    "reply, expected",
    [
        (chat_reply("Yes."), 1.0),
        (chat_reply(" no, because"), 0.0),
        (chat_reply("Perhaps"), None),
        (chat_reply("Yes", {"Yes": 0.9, "Sure": 0.1}), 1.0),  # no among the log-probs: the verdict
        (chat_reply("y", {"y": 0.9, "no": 0.1}), None),  # a split word, not asked for: no verdict either
        ({"choices": []}, None),
    ],
)
def test_http_parsed_verdicts(server, reply, expected):
    s = server(lambda n, body: (200, reply, 0))
    jd = fast(s.url)
    assert jd.score(["Q"]) == [expected] and len(s.requests) == 1  # a reply is never retried
    if expected is None:
        assert jd.errors == {"unparsable reply": 1}


def test_http_split_word_first_piece(server):
    s = server(lambda n, body: (200, chat_reply("y", {"y": 0.6, "no": 0.2}), 0))
    assert fast(s.url, yes=("y",)).score(["Q"]) == [pytest.approx(0.75)]


def test_http_retries_a_500_then_succeeds(server):
    ok = chat_reply("No", {"No": 0.75, "Yes": 0.25})
    s = server(lambda n, body: (500, {"error": "busy"}, 0) if n < 2 else (200, ok, 0))
    jd = fast(s.url)
    assert jd.score(["Q"]) == [pytest.approx(0.25)] and len(s.requests) == 3 and not jd.errors


def test_http_timeout_is_none_after_retries_and_the_rest_of_the_batch_fails_fast(server):
    s = server(lambda n, body: (200, chat_reply("Yes"), 0.6))
    jd = fast(s.url, timeout_s=0.2, retries=1, max_in_flight=1)
    start = time.perf_counter()
    assert jd.score(["a", "b", "c"]) == [None, None, None]
    assert len(s.requests) == 2  # the first prompt's two tries; then the server counts as down for this batch
    assert jd.errors == {"timeout": 1, "server down (skipped)": 2}
    assert time.perf_counter() - start < 2.0


def test_http_a_400_is_not_retried(server):
    s = server(lambda n, body: (400, {"error": "bad request"}, 0))
    jd = fast(s.url)
    assert jd.score(["Q", "R"]) == [None, None] and len(s.requests) == 2 and jd.errors == {"HTTP 400": 2}


def test_http_requests_in_flight_are_bounded(server):
    s = server(lambda n, body: (200, chat_reply("Yes", {"Yes": 0.5, "No": 0.5}), 0.3))
    jd = fast(s.url, max_in_flight=3)
    assert jd.score([f"Q{i}" for i in range(9)]) == [0.5] * 9
    assert s.most_in_flight == 3  # (0.3 s a request: they overlap even on a busy machine)


def test_http_sends_the_key_and_never_shows_it(server, monkeypatch, capsys, caplog):
    secret = "sk-test-DO-NOT-LEAK-1234"
    monkeypatch.setenv("JUDGE_TEST_KEY", secret)
    s = server(lambda n, body: (401, {"error": f"bad key {secret}"}, 0) if n else (200, chat_reply("Yes"), 0))
    jd = fast(s.url, api_key_env="JUDGE_TEST_KEY")
    assert jd.score(["Q"]) == [1.0] and s.requests[0][2] == f"Bearer {secret}"
    assert jd.score(["Q"]) == [None]  # a 401 that echoes the key
    dead = fast("http://127.0.0.1:9", api_key_env="JUDGE_TEST_KEY", retries=0)  # nothing listens on port 9
    assert dead.score(["Q"]) == [None] and dead.errors == {"connection error": 1}
    shown = [jd.describe(), dead.describe(), repr(vars(jd)), repr(vars(dead)), str(jd.errors)]
    shown += [capsys.readouterr().out, capsys.readouterr().err, caplog.text]
    assert not any(secret in text for text in shown)
    assert "JUDGE_TEST_KEY" in jd.describe() and "set" in jd.describe()
    monkeypatch.delenv("JUDGE_TEST_KEY")
    s2 = server(lambda n, body: (200, chat_reply("No"), 0))
    assert fast(s2.url, api_key_env="JUDGE_TEST_KEY").score(["Q"]) == [0.0] and s2.requests[0][2] is None


# ---- the cache -----------------------------------------------------------------------------------------------------


def test_cache_key_names_everything_that_decides_a_verdict():
    base = J.cache_key("m", "prompt", {"max_tokens": 1, "temperature": 0.0})
    assert base == J.cache_key("m", "prompt", {"temperature": 0.0, "max_tokens": 1})  # order does not matter
    assert base != J.cache_key("m", "prompt", {"max_tokens": 2, "temperature": 0.0})
    assert base != J.cache_key("m", "prompt", {"max_tokens": 1, "temperature": 0.0}, J.TEMPLATE_VERSION + 1)
    assert base != J.cache_key("m2", "prompt", {"max_tokens": 1, "temperature": 0.0})
    assert base != J.cache_key("m", "prompt!", {"max_tokens": 1, "temperature": 0.0})


class Counting:
    """A backend that counts the prompts it is asked: {prompt: score}, anything else fails."""

    model_id, decoding = "counting", {"max_tokens": 1, "temperature": 0.0}

    def __init__(self, table):
        self.table, self.asked = table, []

    def score(self, prompts):
        self.asked += prompts
        return [self.table.get(p) for p in prompts]

    def describe(self):
        return "counting judge"


def test_cached_judge_asks_only_for_misses_and_never_caches_a_failure(tmp_path):
    path = tmp_path / "judge_cache.jsonl"
    backend = Counting({"a": 0.25, "b": 1.0})
    cached = J.CachedJudge(backend, J.Cache(path))
    assert cached.score(["a", "b", "x", "a"]) == [0.25, 1.0, None, 0.25]
    assert backend.asked == ["a", "b", "x"] and (cached.hits, cached.misses) == (0, 4)  # each distinct miss once
    assert len(path.read_text().splitlines()) == 2  # "x" failed: not cached
    again = Counting({})  # a resumed run: a new backend, the same file
    resumed = J.CachedJudge(again, J.Cache(path))
    assert resumed.score(["b", "a"]) == [1.0, 0.25] and again.asked == [] and resumed.hits == 2
    assert resumed.score(["x"]) == [None] and again.asked == ["x"]  # the failure is asked again
    c = J.Component("c", "Q?", render=lambda t: t)  # (a turn can be any object)
    resumed.cache.put({J.cache_key("counting", c.prompt("t"), Counting.decoding): 0.5})
    m = J.prefetch(resumed, [c], ["t", "u"])
    assert (m["judge/n_cached"], m["judge/n_failed"]) == (1, 1) and "cache" in resumed.describe()
    assert (m["judge/cached_frac"], m["judge/fail_frac"]) == (0.5, 0.5)


def test_cache_tolerates_a_torn_last_line_and_keeps_appending_whole_lines(tmp_path):
    path = tmp_path / "judge_cache.jsonl"
    c = J.Cache(path)
    c.put({"k1": 0.5, "k2": None, "k3": float("nan"), "k4": 2.0})  # only the success is stored
    assert c.scores == {"k1": 0.5}
    with open(path, "a") as f:
        f.write('{"key": "k5", "sco')  # a crash mid-write
    c2 = J.Cache(path)
    assert c2.scores == {"k1": 0.5} and c2.torn == 1
    c2.put({"k6": 0.75})
    c3 = J.Cache(path)
    assert c3.scores == {"k1": 0.5, "k6": 0.75} and c3.torn == 1


def test_module_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, plumbing.judge; print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    assert r.stdout.split() == ["False", "False"], r.stderr


def test_the_judge_module_never_imports_a_script():
    text = Path(J.__file__).read_text()
    assert "starpo_" not in text and "import common" not in text
