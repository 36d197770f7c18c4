"""LM judges in the rubric: a component that asks a judge a yes/no question about a turn, and the judges that answer.

A script's rubric shows the question and the weight; the client lives here. The shape of a step:

    helpful = Component("helpful_think", "Does the reasoning name the move it plays?", render=lambda t: t.text,
                        truth=lambda t: t.pick_is_honest)          # truth: optional, the exact answer when known
    metrics = prefetch(judge, [helpful], turns)   # one batch: every (component, turn) prompt, asked at once
    helpful(turn)                                  # -> the stored score in [0, 1], or None: that judgement failed

Scoring (JUDGES-SPEC.md sections 2-4): score = P(yes) / (P(yes) + P(no)), the judge's next-token probabilities of
the two answer words after the question, read without sampling. Two backends with the same `.score(prompts)`:
  LocalJudge  any local causal LM directory (or a loaded model): one teacher-forced forward pass per batch, no
              generation.
  HTTPJudge   any OpenAI-compatible /v1/chat/completions endpoint (vLLM's serve, llama.cpp's server, a hosted API),
              standard library only: P(yes) from the first token's top log-probs, else the reply parsed as a verdict.
A failed judgement (timeout, HTTP error, unparsable reply) is None, never 0 or 1: the caller leaves that component out
of that sample's sum and counts it (judge/fail_frac). `CachedJudge` + `Cache` keep successful verdicts in
judge_cache.jsonl, keyed by everything that decides the verdict, so a resumed run asks again only what it lacks.

torch and transformers are imported by LocalJudge alone: the module imports in milliseconds.
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import http.client
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Callable

# Bump when TEMPLATE's wording changes: the version is part of every cache key, so old verdicts are not reused.
TEMPLATE_VERSION = 1
TEMPLATE = (
    "You are a strict judge. Read the text below, then answer the question about it with one word: yes or no.\n"
    "\n"
    "Text:\n"
    "{context}\n"
    "\n"
    "Question: {question}\n"
    "Answer with one word, yes or no."
)
# The answer words' spellings a judge may use for its first token. LocalJudge takes the best-scoring one among those
# its tokenizer has as a single token; HTTPJudge matches the server's tokens against them, case and spaces ignored.
YES = ("yes", "Yes", " yes", " Yes", "YES")
NO = ("no", "No", " no", " No", "NO")
# How `--judge URL` reads a reply: the answer words looked for among the first token's top log-probs. A judge whose
# tokenizer splits "yes" needs its first piece here (tests/test_judge_server.py sets it for the tiny models).
HTTP_READING = dict(top_logprobs=20, yes=YES, no=NO)


def render_prompt(question: str, context: str) -> str:
    """The full judge prompt for one question and one turn's context (TEMPLATE, version TEMPLATE_VERSION)."""
    return TEMPLATE.format(question=question.strip(), context=context)


def _p_yes(logp_yes: float, logp_no: float) -> float | None:
    """P(yes) / (P(yes) + P(no)) from the two log-probs, without overflow; None when neither word has any mass."""
    if logp_yes == -math.inf and logp_no == -math.inf or math.isnan(logp_yes) or math.isnan(logp_no):
        return None
    d = logp_no - logp_yes
    return 1.0 / (1.0 + math.exp(d)) if d < 700 else 0.0


########################################################################################################################
# The rubric component and the batch that fills it
########################################################################################################################


class Component:
    """A rubric entry whose value is a judge's answer to `question` about one turn.

    render(turn) -> the turn-specific text the judge reads (the reply, the state, ...); the judge sees
    render_prompt(question, render(turn)). truth(turn) -> bool, optional: the exact answer where the task knows it;
    prefetch then reports how often the judge agrees. Calling the component never asks a model: it returns the score
    `prefetch` stored for this very turn object (None: the judgement failed, or the turn was never judged).
    `__name__` is `name`, the metric key the scripts' rubric code logs it under (rubric/<name>). gate(turn) -> bool,
    optional: a verifiable fact the judge's score counts only with (false: the component is 0, whatever the judge said;
    the judge is still asked, so judge/* still measures it).
    """

    def __init__(
        self,
        name: str,
        question: str,
        render: Callable[[object], str],
        truth: Callable[[object], bool] | None = None,
        gate: Callable[[object], bool] | None = None,
    ):
        if not name.isidentifier():
            raise ValueError(f"a component's name is a metric key and must be an identifier, not {name!r}")
        self.__name__ = name
        self.question = question
        self.render = render
        self.truth, self.gate = truth, gate
        self.scores: dict[int, float | None] = {}  # id(turn) -> score, for the last prefetch's turns only
        self.judge, self.pending = None, []  # `attach` sets the judge; a component without one is never asked

    def prompt(self, turn) -> str:
        return render_prompt(self.question, self.render(turn))

    def __call__(self, turn) -> float | None:
        score = self.scores.get(id(turn))
        return 0.0 if score is not None and self.gate is not None and not self.gate(turn) else score

    def __repr__(self) -> str:
        return f"Component({self.__name__!r}, {self.question!r})"


def prefetch(judge, components: list[Component], turns: list) -> dict:
    """Ask `judge` every (component, turn) question in one batch; store each score on its component; return metrics.

    Call it on the very turn objects the rubric then scores (scores are keyed by id(turn); each call first forgets
    the previous call's, so memory stays bounded). The returned dict holds, for the components with a truth,
    judge/agreement (share of successful verdicts on the truth's side of 0.5), judge/false_positive and
    judge/false_negative (shares of successful verdicts that said yes to a no, no to a yes), and over all components
    judge/fail_frac (failed / asked), judge/cached_frac (answered by the cache / asked) and judge/latency_s (this
    batch's wall time); with several components the same per component as judge/<name>/... (the cache's share only
    over all); a rate with nothing to count is left out. The raw counts come too
    (judge/n_asked, n_failed, n_checked, n_agree, n_false_positive, n_false_negative, n_cached): `combine` sums
    several batches' dicts into one step's metrics.
    """
    for c in components:
        c.scores = {}
    prompts = [c.prompt(t) for c in components for t in turns]
    hits_before = getattr(judge, "hits", 0)
    start = time.perf_counter()
    scores = list(judge.score(prompts)) if prompts else []
    latency = time.perf_counter() - start
    if len(scores) != len(prompts):
        raise RuntimeError(f"the judge returned {len(scores)} scores for {len(prompts)} prompts")
    counts: dict[str, float] = Counter()
    for i, c in enumerate(components):
        prefixes = ["judge"] + ([f"judge/{c.__name__}"] if len(components) > 1 else [])
        for turn, s in zip(turns, scores[i * len(turns) : (i + 1) * len(turns)]):
            if s is not None and not (isinstance(s, (int, float)) and math.isfinite(s) and 0.0 <= s <= 1.0):
                s = None  # a backend's bug must not become a reward
            c.scores[id(turn)] = s
            for p in prefixes:
                counts[f"{p}/n_asked"] += 1
                counts[f"{p}/n_failed"] += s is None
            if s is None or c.truth is None:
                continue
            said, truth = s >= 0.5, bool(c.truth(turn))
            for p in prefixes:
                counts[f"{p}/n_checked"] += 1
                counts[f"{p}/n_agree"] += said == truth
                counts[f"{p}/n_false_positive"] += said and not truth
                counts[f"{p}/n_false_negative"] += truth and not said
    counts["judge/n_cached"] = getattr(judge, "hits", 0) - hits_before
    counts["judge/latency_s"] = latency
    return combine(dict(counts))


def combine(*batches: dict) -> dict:
    """Several `prefetch` results (a step's batches) as one: the counts and latencies summed, the rates recomputed."""
    total: dict[str, float] = Counter()
    for b in batches:
        for k, v in b.items():
            if "/n_" in k or k.endswith("/latency_s"):
                total[k] += v
    out = {k: int(v) if "/n_" in k else v for k, v in total.items()}
    for p in sorted({k.rsplit("/n_", 1)[0] for k in total if "/n_" in k}):
        if total[f"{p}/n_asked"]:
            out[f"{p}/fail_frac"] = total[f"{p}/n_failed"] / total[f"{p}/n_asked"]
            if p == "judge":  # the cache counts prompts of every component
                out["judge/cached_frac"] = total["judge/n_cached"] / total["judge/n_asked"]
        if total[f"{p}/n_checked"]:
            for rate, n in (("agreement", "agree"), ("false_positive",) * 2, ("false_negative",) * 2):
                out[f"{p}/{rate}"] = total[f"{p}/n_{n}"] / total[f"{p}/n_checked"]
    return out


########################################################################################################################
# In process: a local causal LM, one forward pass per batch
########################################################################################################################


class LocalJudge:
    """A local causal LM as a judge: score = P(yes) / (P(yes) + P(no)) of its next token after the chat-formatted
    prompt (user message = prompt, then the assistant's turn opens). No generation: one teacher-forced forward pass
    per batch of `batch_size` prompts, left-padded with an attention mask and position ids that skip the padding, so a
    prompt's score does not depend on its batch. float32, eval mode, no gradients.

    The answer words: for each of yes and no, the best-scoring spelling among `yes` / `no` (default YES / NO) that
    the tokenizer has as a single token. A word with no single-token spelling (the tiny models' tokenizer splits "yes" into "y" + "es") is
    scored as its first spelling's token sequence, log P(y) + log P(es | y), in the same pass: its tokens
    but the last are appended to the prompt (a causal model's next-token log-probs after the prompt are unchanged).
    If neither word has a single-token spelling, each prompt takes two rows of the batch.

    path_or_model: a model directory (or hub id; trust_remote_code stays off) or a loaded model, then with its
    tokenizer. model_id: the cache key's name for the weights (default: the path, or the model's name_or_path).
    Prompts longer than the model's context fail (None) rather than lose their start (the question's context).
    """

    def __init__(
        self,
        path_or_model,
        tokenizer=None,
        device: str = "cpu",
        batch_size: int = 32,
        model_id: str | None = None,
        yes: tuple = YES,
        no: tuple = NO,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from plumbing.engine import attention_implementation

        if isinstance(path_or_model, (str, os.PathLike)):
            self.model = AutoModelForCausalLM.from_pretrained(
                str(path_or_model), dtype=torch.float32, attn_implementation=attention_implementation(device)
            ).to(device)
            self.tok = tokenizer or AutoTokenizer.from_pretrained(str(path_or_model))
            self.model_id = str(model_id or path_or_model)
        else:
            if tokenizer is None:
                raise ValueError("LocalJudge: a loaded model needs its tokenizer (tokenizer=...)")
            self.model, self.tok = path_or_model, tokenizer
            self.model_id = str(model_id or getattr(path_or_model, "name_or_path", "") or type(path_or_model).__name__)
        self.model.eval()
        self.device = str(next(self.model.parameters()).device)
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.batch_size = batch_size
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.pad_id = pad if pad is not None else 0
        # Per word: the single-token ids of its spellings, or (none) the token sequence of its bare spelling
        self.single, self.multi = {}, {}
        for word, spellings in (("yes", yes), ("no", no)):
            ids = [self._encode(s) for s in spellings]
            self.single[word] = sorted({i[0] for i in ids if len(i) == 1})
            if not self.single[word]:
                self.multi[word] = ids[0]
        self.rows = [self.multi[w][:-1] for w in self.multi] or [[]]  # what each prompt's rows append to it
        self.decoding = {
            "method": "next-token log-probs",
            "dtype": self.dtype,
            "yes": self._words("yes"),
            "no": self._words("no"),
            "max_tokens": 0,
            "temperature": 1.0,
        }

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _words(self, word: str) -> str:
        if self.single[word]:
            return "best of " + "/".join(repr(self.tok.decode([i])) for i in self.single[word])
        return "+".join(repr(self.tok.decode([i])) for i in self.multi[word])

    def describe(self) -> str:
        return (
            f"local judge {self.model_id} ({self.device}, {self.dtype}): P(yes)/(P(yes)+P(no)) from one forward pass; "
            f"yes = {self._words('yes')}, no = {self._words('no')}"
        )

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids the judge reads for one prompt: the chat template, user message = prompt, assistant turn."""
        messages = [{"role": "user", "content": prompt}]
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._encode(text)

    def score(self, prompts: list[str]) -> list[float | None]:
        ids = [self.prompt_ids(p) for p in prompts]
        out: list[float | None] = [None] * len(prompts)
        longest = max(len(r) for r in self.rows)
        fits = [i for i, p in enumerate(ids) if self.max_len is None or len(p) + longest <= self.max_len]
        fits.sort(key=lambda i: len(ids[i]))  # like lengths together: less padding (the scores do not depend on it)
        for start in range(0, len(fits), self.batch_size):
            chunk = fits[start : start + self.batch_size]
            for i, s in zip(chunk, self._score_ids([ids[i] for i in chunk])):
                out[i] = s
        return out

    def _score_ids(self, prompts: list[list[int]]) -> list[float | None]:
        import torch

        rows = [p + extra for p in prompts for extra in self.rows]  # len(self.rows) rows per prompt
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (R, W), left-padded
        attn = torch.zeros((len(rows), width), dtype=torch.long)  # (R, W)
        for j, r in enumerate(rows):
            input_ids[j, width - len(r) :] = torch.tensor(r)
            attn[j, width - len(r) :] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)  # (R, W): padding must not shift positions
        keep = max(len(r) for r in self.rows) + 1  # the last positions: the answer's first token and the appended ones
        with torch.no_grad():
            logits = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attn.to(self.device),
                position_ids=positions.to(self.device),
                logits_to_keep=keep,
            ).logits  # (R, keep, V)
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()  # (R, keep, V)
        out = []
        n = len(self.rows)
        for i in range(len(prompts)):
            word_logp = {}
            for word in ("yes", "no"):
                if self.single[word]:
                    # the next token after the prompt, read from the prompt's first row
                    first = logp[i * n, keep - len(self.rows[0]) - 1]  # (V,)
                    word_logp[word] = first[self.single[word]].max().item()
                else:
                    seq = self.multi[word]  # its own row: prompt + seq[:-1]; positions keep - len(seq) .. keep - 1
                    row = logp[i * n + list(self.multi).index(word), keep - len(seq) :]  # (len(seq), V)
                    word_logp[word] = row.gather(-1, torch.tensor(seq)[:, None]).sum().item()
            out.append(_p_yes(word_logp["yes"], word_logp["no"]))
        return out


########################################################################################################################
# Over HTTP: any OpenAI-compatible endpoint, standard library only
########################################################################################################################


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a failure, not a hop: the Authorization header must never follow it to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _Retryable(Exception):
    pass


class HTTPJudge:
    """An OpenAI-compatible chat endpoint as a judge: POST {base_url}/v1/chat/completions (a base_url that already
    ends in /v1 is used as is), one request per prompt, user message = prompt, temperature 0, logprobs with the
    first token's `top_logprobs` alternatives (the OpenAI API allows 20; vLLM also -1, the whole vocabulary, when
    the server runs with --max-logprobs -1).

    The score: P(yes) / (P(yes) + P(no)) from the first reply token's top log-probs, each word's best-scoring token
    among those whose text, stripped of spaces, is one of `yes` / `no` (case counts; the spellings LocalJudge
    reads). If the server gives no log-probs, or either word is not among them, the reply is parsed as a
    verdict instead: its first word yes -> 1.0, no -> 0.0 (any case), anything else is a failure. A served model
    whose tokenizer splits a word ("y" + "es", the tiny models) has no first token to match: pass its first piece
    (yes=("y",): P(first piece) bounds P(yes) from above; LocalJudge scores the whole sequence) or give
    max_tokens the budget for a parsed verdict.

    Bounded: `timeout_s` per request; `retries` more tries with exponential back-off (backoff_s, 2 backoff_s, ...)
    after a connection error, a timeout, a 5xx, a 408 or a 429, none after any other 4xx or a malformed reply; at
    most `max_in_flight` requests at once. Once one request has used up its retries on a connection error or a
    timeout, the rest of that batch fails at once (the server is down: no batch waits out every prompt's retries);
    the next call tries again. A failure is None, never an exception; `errors` counts them by reason.

    The API key is read from the environment variable `api_key_env` at each request and sent as a Bearer token; it
    never appears in describe(), config.json, an error or a log line.
    """

    def __init__(
        self,
        base_url: str,
        model_id: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 30,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_in_flight: int = 4,
        max_tokens: int = 1,
        top_logprobs: int = 20,
        yes: tuple = YES,
        no: tuple = NO,
    ):
        base = base_url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model_id = model_id
        self.api_key_env = api_key_env
        self.timeout_s, self.retries, self.backoff_s, self.max_in_flight = timeout_s, retries, backoff_s, max_in_flight
        # Every field of the request but the model and the message, and how the reply is read: the cache key
        self.request = {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": True, "top_logprobs": top_logprobs}
        self.words = {"yes": sorted({t.strip() for t in yes}), "no": sorted({t.strip() for t in no})}
        self.decoding = {**self.request, "yes": self.words["yes"], "no": self.words["no"]}
        self.errors: Counter = Counter()
        self._opener = urllib.request.build_opener(_NoRedirect)
        self._lock = threading.Lock()

    def describe(self) -> str:
        key = "set" if os.environ.get(self.api_key_env) else "not set"
        return (
            f"HTTP judge {self.model_id} at {self.url} (API key from ${self.api_key_env}: {key}; timeout "
            f"{self.timeout_s:g} s, {self.retries} retries, {self.max_in_flight} in flight, max_tokens "
            f"{self.decoding['max_tokens']}): P(yes)/(P(yes)+P(no)) from the first token's log-probs, else the verdict"
        )

    def score(self, prompts: list[str]) -> list[float | None]:
        down = threading.Event()  # set once the server looks unreachable: the batch's remaining requests fail fast
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.max_in_flight)) as pool:
            return list(pool.map(lambda p: self._score_one(p, down), prompts))

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1

    def _score_one(self, prompt: str, down: threading.Event) -> float | None:
        body = json.dumps(
            {"model": self.model_id, "messages": [{"role": "user", "content": prompt}], **self.request}
        ).encode()
        for attempt in range(self.retries + 1):
            if down.is_set():
                self._fail("server down (skipped)")
                return None
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                reply = self._post(body)
            except _Retryable as e:
                reason = str(e)
                continue
            except Exception as e:  # noqa: BLE001 - a 4xx, a malformed reply: trying again would not help
                self._fail(str(e) if isinstance(e, ValueError) else type(e).__name__)
                return None
            s = self._verdict(reply)
            if s is None:
                self._fail("unparsable reply")
            return s
        self._fail(reason)
        if reason in ("connection error", "timeout"):
            down.set()
        return None

    def _post(self, body: bytes) -> dict:
        """One request. Raises _Retryable (worth another try) or ValueError (not); messages never hold the key."""
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            e.close()
            if e.code >= 500 or e.code in (408, 429):
                raise _Retryable(f"HTTP {e.code}") from None
            raise ValueError(f"HTTP {e.code}") from None
        except TimeoutError:  # (socket.timeout is TimeoutError)
            raise _Retryable("timeout") from None
        except urllib.error.URLError as e:
            timed_out = isinstance(e.reason, TimeoutError)
            raise _Retryable("timeout" if timed_out else "connection error") from None
        except (ConnectionError, http.client.HTTPException):
            raise _Retryable("connection error") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ValueError("malformed reply") from None

    def _verdict(self, reply: dict) -> float | None:
        """The score from one chat completion: the first token's top log-probs, else the reply parsed as a verdict."""
        try:
            choice = reply["choices"][0]
        except (KeyError, IndexError, TypeError):
            return None
        try:
            top = choice["logprobs"]["content"][0]["top_logprobs"]
            best = {"yes": -math.inf, "no": -math.inf}
            for t in top:
                for word, texts in self.words.items():
                    if str(t["token"]).strip() in texts:
                        best[word] = max(best[word], float(t["logprob"]))
            if best["yes"] > -math.inf and best["no"] > -math.inf:
                return _p_yes(best["yes"], best["no"])
        except (KeyError, IndexError, TypeError, ValueError):
            pass  # no log-probs: parse the text
        text = ((choice.get("message") or {}).get("content") or "").strip().lower()
        m = re.match(r"[^a-z]*(yes|no)\b", text)
        return None if m is None else float(m.group(1) == "yes")


########################################################################################################################
# The cache: judge_cache.jsonl in the run directory
########################################################################################################################


def cache_key(model_id: str, prompt: str, decoding: dict, template_version: int = TEMPLATE_VERSION) -> str:
    """sha256 over the judge's model id, the template version, the rendered prompt and every decoding parameter
    (the output budget included: a key without it replays truncated verdicts)."""
    blob = json.dumps([model_id, template_version, prompt, sorted(decoding.items())], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class Cache:
    """Successful verdicts, one JSON object a line ({"key": ..., "score": ...}), appended as they come.

    Opening loads what is there (a resumed run reuses it); a torn last line (a crash mid-write) is skipped, and the
    next append starts on a line of its own. Only finite scores in [0, 1] are ever stored: a failure is not cached.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.scores: dict[str, float] = {}
        self.torn = 0  # lines that did not parse
        needs_newline = False
        if self.path.exists():
            text = self.path.read_text(encoding="utf-8", errors="replace")
            needs_newline = bool(text) and not text.endswith("\n")
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                    self.scores[record["key"]] = float(record["score"])
                except (ValueError, KeyError, TypeError):
                    self.torn += 1
        if needs_newline:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("\n")

    def get(self, key: str) -> float | None:
        return self.scores.get(key)

    def put(self, items: dict[str, float | None]) -> None:
        """Store the successful ones among {key: score}, one write per line (appends from several processes stay
        whole lines)."""
        good = {k: s for k, s in items.items() if isinstance(s, (int, float)) and math.isfinite(s) and 0 <= s <= 1}
        new = {k: float(s) for k, s in good.items() if self.scores.get(k) != s}
        if not new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for k, s in new.items():
                f.write(json.dumps({"key": k, "score": s}) + "\n")
                f.flush()
        self.scores.update(new)

    def __len__(self) -> int:
        return len(self.scores)


class CachedJudge:
    """A judge with a cache in front: asks the backend only for prompts it has no verdict for (each distinct prompt
    once), stores the successful answers. `hits` / `misses` count prompts over its lifetime. Use it only for a frozen
    judge: the key names the model, not its weights, so a judge that is being trained must not be cached."""

    def __init__(self, judge, cache: Cache):
        self.judge, self.cache = judge, cache
        self.model_id, self.decoding = judge.model_id, judge.decoding
        self.hits = self.misses = 0

    def describe(self) -> str:
        return f"{self.judge.describe()}; cache {self.cache.path} ({len(self.cache)} verdicts)"

    def score(self, prompts: list[str]) -> list[float | None]:
        keys = [cache_key(self.model_id, p, self.decoding) for p in prompts]
        known = {k: self.cache.get(k) for k in keys}
        todo = list(dict.fromkeys(p for p, k in zip(prompts, keys) if known[k] is None))  # distinct misses
        self.hits += sum(known[k] is not None for k in keys)
        self.misses += len(keys) - sum(known[k] is not None for k in keys)
        if todo:
            fresh = dict(zip((cache_key(self.model_id, p, self.decoding) for p in todo), self.judge.score(todo)))
            self.cache.put(fresh)
            known.update(fresh)
        return [known[k] for k in keys]


########################################################################################################################
# A script's rubric and its judges: which run, one batch a turn, the step's metrics
########################################################################################################################


def make(spec: str | None, model_id: str | None, policy_path: str, device: str, cache_path: Path):
    """The judge a run asks, from --judge (spec) and --judge-model-id, cached in cache_path (judge_cache.jsonl):
    'policy' or None, the policy's own starting weights (frozen: the judge never learns with the policy); a URL
    (http:// or https://), an OpenAI-compatible server (model_id, else the first model its /v1/models lists; the key
    from $OPENAI_API_KEY); anything else, a local model directory."""
    if spec and spec.startswith(("http://", "https://")):  # 4 reply tokens: a verdict where the first names no word
        backend = HTTPJudge(spec, model_id or served_model(spec), max_tokens=4, **HTTP_READING)
    else:
        path = policy_path if spec in (None, "policy") else spec
        backend = LocalJudge(path, device=device, model_id=None if spec in (None, "policy") else spec)
    return CachedJudge(backend, Cache(cache_path))


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id an OpenAI-compatible server lists (GET /v1/models); SystemExit in one line if none."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.loads(r.read())["data"][0]["id"]
    except Exception as e:  # noqa: BLE001 - unreachable, not JSON, no model: say so and stop
        raise SystemExit(f"error: --judge: no model listed at {url} ({type(e).__name__}); give --judge-model-id") from e


def setup(rubric: list, spec: str | None, model_id: str | None, policy_path: str, device: str, run_dir: Path):
    """The rubric that runs (`running`) with its judge attached, and for config.json (None: no judge component runs)
    the judge's description and the judge components that are rewarded (weight != 0: Run warns when one of them
    rises while the judge's agreement with the truth falls). The judge: `make`, cached in run_dir/judge_cache.jsonl.
    The components that run are copies: the script's RUBRIC itself never holds a judge."""
    rubric = [(copy.copy(fn) if isinstance(fn, Component) else fn, w) for fn, w in running(rubric, spec is not None)]
    if not any(isinstance(fn, Component) for fn, _ in rubric):
        return rubric, None
    from plumbing.run import write_line  # (torch: imported here)

    backend = make(spec, model_id, policy_path, device, Path(run_dir) / "judge_cache.jsonl")
    attach(rubric, backend)
    write_line("judge: " + backend.describe())  # which judge a run asks: the start-up line and config.json
    rewarded = [fn.__name__ for fn, w in rubric if isinstance(fn, Component) and w]  # the reward-hacking warning's
    return rubric, {"judge": backend.describe(), "rewarded": rewarded}


def running(rubric: list, weights_on: bool) -> list:
    """The rubric that runs: a judge component stays when it is weighted or when a judge was asked for (--judge:
    weights_on), else it leaves the rubric (its judge is never called, and nothing of it is logged)."""
    return [(fn, w) for fn, w in rubric if not isinstance(fn, Component) or w or weights_on]


def attach(rubric: list, judge) -> None:
    """Every judge component of the rubric asks `judge` (one judge a run)."""
    for fn, _ in rubric:
        if isinstance(fn, Component):
            fn.judge, fn.pending = judge, []


def prefetch_rubric(rubric: list, turns: list) -> None:
    """Before the rubric scores `turns`: every judge component's questions about them, in one batch (prefetch); the
    batch's metrics wait on the components for `step_metrics`. No judge attached (`setup`): nothing happens, and the
    components score None (not judged, left out of the sum)."""
    components = [fn for fn, _ in rubric if isinstance(fn, Component) and fn.judge is not None]
    if components and turns:
        components[0].pending.append(prefetch(components[0].judge, components, turns))


def step_metrics(rubric: list) -> dict:
    """The judge/* metrics of every batch since the last call (a step's rollout; torchrun: every process's, so every
    process calls it at the same point), rates only; {} without judges or judged turns."""
    from plumbing import dist  # (torch: imported here, so that this module imports in milliseconds)

    components = [fn for fn, _ in rubric if isinstance(fn, Component) and fn.judge is not None]
    if not components:
        return {}
    batches, components[0].pending = dist.gather(components[0].pending), []
    return {k: v for k, v in combine(*batches).items() if "/n_" not in k} if batches else {}
