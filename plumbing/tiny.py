"""The embedded tiny models: a few-million-parameter Qwen2-architecture causal LM per task, built on this CPU.

A byte-level BPE tokenizer trained on the task's own text and Qwen's chat format (<|im_start|>role ... <|im_end|>),
a reading stage (in-context copying on random token strings, nothing of any task), then a supervised warm-up on
transcripts the script hands in, whose moves are uniformly random: the model learns the format, perception and the
rules of the world, never which move is good; that is left to RL. Saved with save_pretrained, so
AutoModelForCausalLM, AutoTokenizer and vLLM load it like any Hugging Face model. `build_tiny_model` finds a build
in the cache, then one shipped in tiny/ (tools/ship_tiny.py), else builds it. `world_model_warmup` runs the same
kind of warm-up on any model before RL (--warmup-steps). docs/RESULTS.md has each build's story and figures.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from plumbing.cpu import seed_everything
from plumbing.run import write_line


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VERSION = 2  # bump when the recipe changes so stale caches are rebuilt


# The multi-turn tiny models ship with the repository (tiny/, written by `python tools/ship_tiny.py`): their builds
# take 30-40 minutes on two cores; the bandit's, 1.5 minutes, happens on first use. A shipped model is used only
# when its name carries the key of today's recipe and warm-up data (built with any torch), so an edited prompt still
# builds its own.
SHIPPED_TINY = Path(__file__).resolve().parents[1] / "tiny"


def tiny_cache_root() -> Path:
    return Path(os.environ.get("STARPO_CACHE", Path.home() / ".cache" / "starpo"))


def tiny_recipe(
    seed, vocab_size, hidden_size, num_layers, sft_steps, sft_batch_size, sft_lr, reading_steps=0, reading_lr=1e-3
) -> dict:
    """What a tiny model's build depends on besides its warm-up data (TINY_VERSION and torch's version included)."""
    spec = dict(seed=seed, vocab=vocab_size, hidden=hidden_size, layers=num_layers)
    recipe = dict(
        v=TINY_VERSION, **spec, steps=sft_steps, bs=sft_batch_size, lr=sft_lr, torch=torch.__version__.split("+")[0]
    )
    if reading_steps:  # only then: the keys of models built without a reading stage stay what they were
        recipe["reading"] = dict(
            steps=reading_steps,
            bs=READING_BATCH,
            lr=reading_lr,
            len=READING_LEN,
            replay=READING_REPLAY,
            plain=READING_PLAIN,
        )
    return recipe


# The reading stage: before its task warm-up, a tiny model can be pretrained on random token strings that only
# in-context copying answers, so that it can read its prompt at all. A from-scratch model warmed up on the task alone
# learns the reply's shape, not its content: it has no induction heads (no way to say "the token that followed this
# one last time"), and restating a cell or looking up a move needs exactly that. Task-agnostic: strings of random
# ordinary tokens of the model's own vocabulary, never the task's text, its states or its moves.
READING_BATCH, READING_LEN = 32, 160  # strings per step, longest string (tokens)
READING_REPLAY = 16  # reading strings added to every step of the task warm-up that follows
READING_PLAIN = 0.7  # share of the stage's first steps without induction strings (see reading_stage)


def reading_sample(rng: random.Random, vocab: list[int], sep: int, arrow: int, length: int = READING_LEN, kinds=3):
    """One reading string and its 0/1 loss mask (1 exactly where in-context copying determines the next token).

    One of the first `kinds` of READING_KINDS, equally likely: copy, `s <sep> s` with s random (the second s is
    trained); recall, key-value pairs of random tokens, `<sep>`, then queries `k <arrow> v` for some of the keys
    (each v trained); induction, random tokens in which a few bigrams `k v` (k seen nowhere else) recur in the
    second half, the recurring v trained: "the token that followed this one last time", with no marker to lean on.
    `vocab`: the ordinary token ids the strings are drawn from; `sep` and `arrow`: markers outside it."""
    kind = rng.randrange(kinds)
    if kind == 0:
        n = rng.randint(4, (length - 1) // 2)
        s = [rng.choice(vocab) for _ in range(n)]
        return s + [sep] + s, [0] * (n + 1) + [1] * n
    if kind == 1:
        n = rng.randint(2, min(24, (length - 1) // 5, len(vocab)))
        keys, values = rng.sample(vocab, n), [rng.choice(vocab) for _ in range(n)]
        ids = [x for kv in zip(keys, values) for x in kv] + [sep]
        mask = [0] * len(ids)
        for q in rng.sample(range(n), min(n, 6)):
            ids, mask = ids + [keys[q], arrow, values[q]], mask + [0, 0, 1]
        return ids, mask
    n = rng.randint(30, length)
    slots = range(0, n // 2 - 1, 2)  # even slots in the first half: two first occurrences never overlap
    m = rng.randint(2, min(8, len(slots), len(vocab) // 2))
    keys = rng.sample(vocab, m)
    others = [t for t in vocab if t not in keys]
    ids, mask = [rng.choice(others) for _ in range(n)], [0] * n
    values = [rng.choice(others) for _ in range(m)]
    for k, i, v in zip(keys, rng.sample(slots, m), values):
        ids[i], ids[i + 1] = k, v
    for k, v in zip(keys, values):
        j = rng.randrange(n // 2, n - 1)
        if {ids[j - 1], ids[j], ids[j + 1]} & set(keys) or mask[j] or mask[j + 1]:
            continue  # a slot another recurrence already uses
        ids[j], ids[j + 1], mask[j + 1] = k, v, 1
    if not any(mask):
        ids[n - 2], ids[n - 1], mask[n - 1] = keys[0], values[0], 1
    return ids, mask


READING_KINDS = ("copy", "recall", "induction")


def reading_kind(ids: list[int], sep: int, arrow: int) -> str:
    return "recall" if arrow in ids else "copy" if sep in ids else "induction"


def reading_probe(model, vocab: list[int], sep: int, arrow: int, n: int = 128, seed: int = 10**6) -> dict:
    """Held-out in-context copying, teacher-forced: for each kind of reading string (READING_KINDS), the share of
    the trained tokens of n strings (drawn from their own seed, never trained on) whose most likely next token is right."""
    rng, device, out = random.Random(seed), next(model.parameters()).device, {}
    strings = {kind: [] for kind in READING_KINDS}
    while min(len(v) for v in strings.values()) < n:
        ids, mask = reading_sample(rng, vocab, sep, arrow)
        kind = strings[reading_kind(ids, sep, arrow)]
        if len(kind) < n:
            kind.append((ids, mask))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for kind, rows in strings.items():
            input_ids, labels, attn = (x.to(device) for x in sft_batch(rows, 0))
            guess = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1].argmax(-1)  # (B, T - 1)
            target = labels[:, 1:]
            trained = target != -100
            out[kind] = round(((guess == target) & trained).sum().item() / trained.sum().item(), 4)
    model.train(was_training)
    return out


def reading_stage(model, vocab: list[int], sep: int, arrow: int, steps: int, lr: float, seed: int = 0, log=print):
    """Train on fresh reading strings (reading_sample), READING_BATCH a step: AdamW, 50 warm-up steps, then a constant
    rate (copying forms abruptly, late: a decaying rate would delay it). Copy and recall strings only for the first
    READING_PLAIN of the steps, then induction strings too: mixed in from the start they slow everything down (a
    trial: copy 0.25 after 1,800 steps), once copying has formed they are learned in a few hundred. Returns
    reading_probe's figures at the end.

    A scratch trial on the 3.3M FrozenLake model (idle 2-core CPU, 0.56 s a step), copy and recall only: held-out copy
    accuracy 0.07 at step 600, 0.54 at 1,000, 0.98 at 1,200 (recall 0.04, 0.09, 0.98): a phase change, as induction
    heads form; plain induction was then 0.27, and 0.81 after 400 more steps with induction strings."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    rng, t0 = random.Random(seed), time.time()
    model.train()
    for step in range(1, steps + 1):
        kinds = 2 if step <= READING_PLAIN * steps else 3
        rows = [reading_sample(rng, vocab, sep, arrow, kinds=kinds) for _ in range(READING_BATCH)]
        input_ids, labels, attn = (x.to(device) for x in sft_batch(rows, 0))
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, steps // 10) == 0 or step == steps:
            spent = time.time() - t0
            probe = reading_probe(model, vocab, sep, arrow, n=32)
            scores = "  ".join(f"{kind} {probe[kind]:.2f}" for kind in READING_KINDS)
            log(
                f"  reading step {step:5d}/{steps}  loss {loss.item():.3f}  {scores}  "
                f"({spent:.0f}s, ~{spent / step * (steps - step):.0f}s left)"
            )
    model.eval()
    return reading_probe(model, vocab, sep, arrow)


def cached_reading_stage(model, recipe: dict, vocab: list[int], marks: tuple[int, int], log=print) -> dict:
    """reading_stage(model, vocab, *marks, ...) with the recipe's steps, rate and seed, run once per cache.

    What it leaves depends only on the model's shape, the seed, the recipe and the token ids it draws (random
    strings: never what the tokens spell), so every task whose tokenizer has as many ids reuses one run: a task's
    second build (a new warm-up, another script) costs the warm-up alone. Kept in the cache as
    reading-<hash>/weights.pt and reading.json (the probe, the seconds the stage took); on reuse the figures say
    "reused": true. Returns reading_probe's figures and the seconds."""
    spec = {k: v for k, v in recipe.items() if k not in ("steps", "bs", "lr")}  # not the task warm-up's
    digest = hashlib.sha256(json.dumps([spec, list(marks), vocab], sort_keys=True).encode()).hexdigest()[:12]
    folder = tiny_cache_root() / f"reading-{digest}"
    if (folder / "reading.json").exists():
        model.load_state_dict(torch.load(folder / "weights.pt", map_location="cpu", weights_only=True))
        model.eval()
        log(f"  reading stage reused from {folder}")
        return dict(json.loads((folder / "reading.json").read_text()), reused=True)
    r0, reading = time.time(), spec["reading"]
    result = dict(reading_stage(model, vocab, *marks, reading["steps"], reading["lr"], spec["seed"], log))
    result["seconds"] = round(time.time() - r0, 1)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(model.state_dict(), tmp / "weights.pt")
    (tmp / "reading.json").write_text(json.dumps(result, indent=1))  # written last: it marks the folder whole
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _tiny_folder(name: str, recipe: dict, examples: list) -> str:
    return f"tiny-{name}-{hashlib.sha256(json.dumps([recipe, examples], sort_keys=True).encode()).hexdigest()[:12]}"


def tiny_model_name(name: str, examples: list, **build_kwargs) -> str:
    """The folder build_tiny_model(name, examples, **build_kwargs) builds into: tiny-<name>-<hash of recipe + data>."""
    bound = inspect.signature(build_tiny_model).bind(name, examples, **build_kwargs)
    bound.apply_defaults()
    kw = {k: v for k, v in bound.arguments.items() if k not in ("name", "examples", "log")}
    return _tiny_folder(name, tiny_recipe(**kw), examples)


def sft_batch(rows: list[tuple[list[int], int | list[int]]], pad_id: int):
    """(token ids, prompt length or 0/1 loss mask) rows -> right-padded input_ids, labels, attention_mask, (B, T)
    each. Labels are -100 (ignored by the loss) on the prompt (or where the mask is 0) and on the padding."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, trained) in enumerate(rows):
        mask = [int(j >= trained) for j in range(len(ids))] if isinstance(trained, int) else trained
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        attn[i, : len(ids)] = 1
    return input_ids, labels, attn


def sft_rows(tok, examples: list[tuple[list[dict], str]]) -> list[tuple[list[int], list[int]]]:
    """Warm-up (chat messages, reply) pairs -> (token ids, 0/1 loss mask) rows, tokenized piece by piece exactly as
    the scripts' rollouts build a conversation: the chat template up to the first reply, then each reply plus
    <|im_end|>, and each later message as "\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n". So the ids
    are the ones RL will see, boundaries included. The loss sees every reply (earlier ones in the messages too)
    and its <|im_end|>, nothing else: a multi-turn episode is one row."""
    im_end, rows = tok.convert_tokens_to_ids("<|im_end|>"), []
    for msgs, reply in examples:
        chat = list(msgs) + [{"role": "assistant", "content": reply}]
        first = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
        prompt = tok.apply_chat_template(chat[:first], add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids)
        for m in chat[first:]:
            if m["role"] == "assistant":
                piece, trained = tok(m["content"], add_special_tokens=False)["input_ids"] + [im_end], 1
            else:
                text = f"\n<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n<|im_start|>assistant\n"
                piece, trained = tok(text, add_special_tokens=False)["input_ids"], 0
            ids, mask = ids + piece, mask + [trained] * len(piece)
        rows.append((ids, mask))
    return rows


def token_ids_digest(rows: list[tuple[list[int], list[int]]]) -> str:
    """A hash of tokenized warm-up rows, kept in build_info.json: a test re-tokenizes with the scripts' tokenizer."""
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def sft(
    model,
    rows,
    steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int = 0,
    log=print,
    device="cpu",
    replay=None,
):
    """Supervised fine-tuning on sft_batch rows (token ids, prompt length or 0/1 loss mask): AdamW, 10 warm-up steps,
    cosine decay, gradient clip 1. Batches are drawn with replacement from random.Random(seed). Logs a line every
    tenth of the steps with the time left; returns the last loss. Used by the tiny-model build and --warmup-steps.
    replay: None, or a function returning more rows whose loss joins every step's gradient (the reading stage's
    strings during a tiny model's task warm-up: without them the task wipes the copying out)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    rng, t0, loss = random.Random(seed), time.time(), torch.tensor(float("nan"))
    model.train()
    for step in range(steps):
        input_ids, labels, attn = (
            x.to(device) for x in sft_batch([rows[rng.randrange(len(rows))] for _ in range(batch_size)], pad_id)
        )
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        if replay is not None:  # a pass of its own: short strings are not padded to the task's length
            input_ids, labels, attn = (x.to(device) for x in sft_batch(replay(), pad_id))
            model(input_ids=input_ids, attention_mask=attn, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, steps // 10) == 0 or step == steps - 1:  # a line every tenth: never silent for long
            spent = time.time() - t0
            left = spent / (step + 1) * (steps - step - 1)
            log(f"  warm-up step {step + 1:4d}/{steps}  loss {loss.item():.3f}  ({spent:.0f}s, ~{left:.0f}s left)")
    model.eval()
    return loss


def build_tiny_model(
    name: str,
    examples: list[tuple[list[dict], str]],
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    num_layers: int = 4,
    sft_steps: int = 60,
    sft_batch_size: int = 32,
    sft_lr: float = 3e-3,
    reading_steps: int = 0,
    reading_lr: float = 1e-3,
    log=print,
) -> Path:
    """Build (or reuse from the cache) the embedded tiny model for one task and return its directory.

    examples: (chat messages, assistant reply) pairs for the format warm-up. The cache key hashes the examples
    and the recipe, so editing the prompt rebuilds the model; the build is deterministic from `seed`. A build in
    the cache wins; else one shipped in the repository's tiny/ under the same name, or one whose only difference is
    the torch it was built with (a GPU machine's torch is rarely the CPU wheel's); else it is built here.
    """
    recipe = tiny_recipe(
        seed, vocab_size, hidden_size, num_layers, sft_steps, sft_batch_size, sft_lr, reading_steps, reading_lr
    )
    out = tiny_cache_root() / _tiny_folder(name, recipe, examples)
    for found in (out, SHIPPED_TINY / out.name):  # a build of your own first, then the repository's
        if (found / "build_info.json").exists():
            return found
    for info in sorted(SHIPPED_TINY.glob(f"tiny-{name}-*/build_info.json")):  # the same build under another torch
        made_with = json.loads(info.read_text())["torch"]
        if info.parent.name == _tiny_folder(name, dict(recipe, torch=made_with), examples):
            log(f"using {info.parent.name}: today's recipe, built with torch {made_with} ({recipe['torch']} here)")
            return info.parent

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    transformers.utils.logging.disable_progress_bar()  # our own lines say how far the build is

    t0 = time.time()
    log(f"building the embedded tiny model '{name}' in {out} (first run only) ...")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Tokenizer: byte-level BPE (any string, even model garbage, round-trips exactly), trained with the normaliser
    # and pre-tokeniser of Qwen2Tokenizer, which is what AutoTokenizer returns for this model: one digit per piece,
    # a space before a digit a piece of its own. Training with GPT-2's regex instead learns merges such as " 10"
    # that the loaded tokenizer never applies, so the numbers RL sees would be token sequences the warm-up never showed.
    qwen = Qwen2Tokenizer().backend_tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer, bpe.pre_tokenizer, bpe.decoder = qwen.normalizer, qwen.pre_tokenizer, decoders.ByteLevel()
    corpus = [m["content"] for msgs, _ in examples for m in msgs] + [reply for _, reply in examples]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tmp.mkdir(parents=True)
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TINY_CHAT_TEMPLATE
    ).save_pretrained(tmp)
    specials = {t: bpe.token_to_id(t) for t in TINY_SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=specials["<|endoftext|>"],
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
    )
    config.save_pretrained(tmp)  # before loading the tokenizer back: AutoTokenizer picks its class from it
    # One tokenizer: the warm-up is tokenized by exactly what the scripts load (AutoTokenizer on the saved folder).
    tok = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
    for text in corpus[:: max(1, len(corpus) // 200)]:
        if tok(text, add_special_tokens=False)["input_ids"] != bpe.encode(text).ids:
            raise RuntimeError(f"the reloaded tokenizer ({type(tok).__name__}) disagrees with the trained one")

    rows = sft_rows(tok, examples)
    max_len = max(len(ids) for ids, _ in rows)

    seed_everything(seed)
    model = Qwen2ForCausalLM(config)
    reading, replay = {}, None
    if reading_steps:  # in-context copying first (see reading_stage), on random strings of the ordinary tokens
        vocab = [i for i in range(config.vocab_size) if i not in specials.values()]
        marks = specials["<|endoftext|>"], specials["<|im_start|>"]
        reading = cached_reading_stage(model, recipe, vocab, marks, log)
        replay_rng = random.Random(seed + 1)  # then replayed during the task warm-up, which would wipe it out
        replay = lambda: [reading_sample(replay_rng, vocab, *marks) for _ in range(READING_REPLAY)]  # noqa: E731
    loss = sft(model, rows, sft_steps, sft_batch_size, sft_lr, tok.pad_token_id, seed, log, replay=replay)
    if reading_steps:  # what the task warm-up left of it
        reading["after_warmup"] = reading_probe(model, vocab, *marks)

    # Neutral sampling defaults: scripts always pass their own temperature / top_p / top_k.
    model.generation_config.do_sample = True
    model.generation_config.temperature, model.generation_config.top_p, model.generation_config.top_k = 1.0, 1.0, 0
    model.save_pretrained(tmp)
    info = dict(
        recipe,
        name=name,
        params=sum(p.numel() for p in model.parameters()),
        max_len=max_len,
        warmup_ids_sha256=token_ids_digest(rows),
        final_sft_loss=round(loss.item(), 4),
        **({"reading_probe": reading} if reading else {}),
        build_seconds=round(time.time() - t0, 1),
    )
    (tmp / "build_info.json").write_text(json.dumps(info, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)  # atomic: a half-built model never sits at the final path
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"  tiny model ready: {info['params'] / 1e6:.1f}M parameters, {info['build_seconds']}s")
    return out


def world_model_warmup(
    model_path: str, make_examples, out: Path, steps: int, seed: int, device: str, batch_size: int = 8, lr: float = 1e-5
) -> str:
    """--warmup-steps: SPA's world-model stage (arXiv 2510.15047) before RL. Fine-tunes the model on self-play
    transcripts (make_examples(), the script's tiny_warmup_examples: uniformly random moves; the think states the
    world and what each move would do, the environment's ground truth) and saves it to `out`, which then stands in
    for the model: policy, reference, critic and --resume all start from it. Returns its path; a resumed run finds
    it done and plays no episodes."""
    out = Path(out)
    if (out / "config.json").exists():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seed_everything(seed, device)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    rows = sft_rows(tok, make_examples())
    write_line(f"world-model warm-up: {steps} steps of {batch_size} ({len(rows)} episodes)")
    sft(model, rows, steps, batch_size, lr, tok.pad_token_id, seed, write_line, device)
    tmp = out.with_name("warmup.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return str(out)


def self_play(make_env, seeds, first_messages, feedback_message, reply, max_turns: int, budget: int, seed: int = 0):
    """Warm-up transcripts from self-play: one (chat messages, last reply) pair per episode, the last reply's
    messages holding the whole episode so far (sft_rows trains every reply in it), built from exactly the messages
    a multi-turn rollout produces. Each turn, reply(rng, env, moves_left) -> (moves, think) says what to play and
    think; the episode ends when the environment says done, the move budget is spent or after max_turns. The
    script's reply function draws its moves uniformly at random: nothing here prefers a good move."""
    rng = random.Random(seed)
    examples = []
    for s in seeds:
        env = make_env()
        messages = first_messages(env.reset(s))
        left = budget
        for turn_no in range(1, max_turns + 1):
            moves, thought = reply(rng, env, left)
            text = f"<think> {thought} </think> <answer> {' || '.join(moves)} </answer>"
            last = (list(messages), text)  # the whole episode so far: the warm-up trains every reply in it
            reward, done = 0.0, False
            for m in moves:
                obs, r, done, _ = env.step(m)
                reward, left = reward + r, left - 1
                if done:
                    break
            if done or left <= 0:
                break
            feedback = feedback_message(reward, turn_no + 1, obs, left)
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
        examples.append(last)
    return examples
