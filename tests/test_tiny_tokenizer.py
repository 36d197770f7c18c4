"""The embedded tiny models are warmed up with exactly the tokenizer the scripts load (AutoTokenizer)."""

import json

import pytest
from tokenizers import Tokenizer

import plumbing.tiny
import starpo_bandit as sb
import starpo_frozenlake as fl
import starpo_sokoban as sk

BUILDS = {
    "bandit": lambda: ({}, sb.tiny_warmup_examples([("Phoenix", "Dragon")])),
    "frozenlake": lambda: (fl.TINY_BUILD, fl.tiny_warmup_examples(fl.Args(**fl.PRESETS["tiny"]))),
    "sokoban": lambda: (sk.TINY_BUILD, sk.tiny_warmup_examples(sk.Args(**sk.PRESETS["tiny"]))),
}
DIGIT_TEXTS = ["Turn 2:", "Moves left: 10", "reward 0.50, total 12", "(3, 0) -> (3, 1)", "Turn 10 of 5", " 22 23 01"]


@pytest.fixture(scope="module", params=sorted(BUILDS))
def built(request):
    from transformers import AutoTokenizer

    kwargs, examples = BUILDS[request.param]()
    path = plumbing.tiny.build_tiny_model(request.param, examples, **kwargs)
    return path, AutoTokenizer.from_pretrained(path), examples


def test_warmup_was_tokenized_by_the_tokenizer_the_scripts_load(built):
    path, tok, examples = built
    info = json.loads((path / "build_info.json").read_text())
    assert info["warmup_ids_sha256"] == plumbing.tiny.token_ids_digest(plumbing.tiny.sft_rows(tok, examples))


def test_saved_tokenizer_file_and_autotokenizer_agree_on_digits(built):
    path, tok, _ = built
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in DIGIT_TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text).ids, text
        digits = [t for t in tok.convert_ids_to_tokens(ids) if any(ch.isdigit() for ch in t)]
        assert all(len(t) == 1 for t in digits), (text, digits)  # one digit per token, the space a piece of its own
