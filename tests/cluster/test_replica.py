"""What crosses from the front to a replica: requests pickle, and a grammar is rebuilt on the other side."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from runlm.cluster.replica import PortableGrammar, local_request, portable_request
from runlm.engine import GenerationRequest
from runlm.engine.grammar import GrammarConstraint

pytest.importorskip("llguidance")


def test_a_request_with_a_grammar_crosses_processes_and_constrains_the_same_tokens(smollm2_loaded):
    tok = smollm2_loaded.tokenizer
    vocab = smollm2_loaded.runner.vocab_size()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = GrammarConstraint.json_schema(schema, tok, vocab, [tok.eos_id])
    request = GenerationRequest([1, 2, 3], max_tokens=5, grammar=grammar, cache_scope="tenant-a")

    sent = pickle.loads(pickle.dumps(portable_request(request)))
    assert isinstance(sent.grammar, PortableGrammar)
    assert request.grammar is grammar  # the front's own request is left as it was
    received = local_request(sent, tok)
    assert isinstance(received.grammar, GrammarConstraint)
    assert received.cache_scope == "tenant-a" and received.prompt_ids == [1, 2, 3]
    assert np.array_equal(received.grammar.allowed(), grammar.allowed())
    brace = tok.encode("{", add_bos=False)[0]
    assert received.grammar.accept(brace) and grammar.accept(brace)
    assert np.array_equal(received.grammar.allowed(), grammar.allowed())


def test_a_request_without_a_grammar_is_sent_as_it_is():
    request = GenerationRequest([5, 6], max_tokens=2)
    assert portable_request(request) is request
    assert local_request(request, tokenizer=None) is request
