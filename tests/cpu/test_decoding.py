"""``vime.rollout.decoding``: the ids that end a turn and a turn's text.

Proves: ``--rollout-stop-token-ids`` come first, each once, then EOS unless already
there (or absent); a turn's final stop token is dropped and any other kept, special
tokens included; no turns decode to no texts (``batch_decode([])`` alone gives one).
"""

from __future__ import annotations

from vime.models.embedded import build_tokenizer
from vime.rollout.decoding import decode_turns, stop_token_ids


def test_stop_ids_are_the_flag_then_eos_each_once() -> None:
    assert stop_token_ids([5, 7, 5], 2) == (5, 7, 2)
    assert stop_token_ids([2, 5], 2) == (2, 5)
    assert stop_token_ids([], None) == ()


def test_a_final_stop_is_dropped_and_the_rest_kept() -> None:
    tokenizer = build_tokenizer("abc")
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    eos = tokenizer.eos_token_id
    texts = decode_turns(tokenizer, [[a, b, eos], [a, eos, b], [b, a]], (eos,))
    assert texts[0] == "ab" and texts[2] == "ba"
    assert texts[1] == "a" + tokenizer.eos_token + "b"  # special, mid-turn: kept
    assert decode_turns(tokenizer, [], (eos,)) == []
