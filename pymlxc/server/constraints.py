"""Constrained decoding with llguidance: a JSON schema (or a Lark grammar) as a `batching.Constraint`.

llguidance compiles the grammar against the model's tokenizer (the Hugging Face `tokenizers` JSON)
and, at each step, gives the ids that keep the output inside the grammar; the scheduler masks the
others out before sampling. The tokenizer conversion is made once per model.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


class ConstraintError(ValueError):
    """A schema or grammar llguidance cannot use (the message says why), or a tokenizer it cannot read."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - the server extra installs it
        raise ConstraintError("constrained decoding needs llguidance (pip install 'pymlxc[server]')") from exc
    return llguidance


class GrammarFactory:
    """Builds constraints for one model: its tokenizer converted once (`tokenizer_json`: the HF
    tokenizers JSON text; `vocab_size`: the model's logits width; `eos_ids`: the ids that end a
    completed output)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._json = tokenizer_json
        self._vocab = vocab_size
        self._eos = sorted(eos_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                try:
                    self._tokenizer = llg.LLTokenizer(self._json, n_vocab=self._vocab, eos_token=self._eos)
                except Exception as exc:  # noqa: BLE001 - llguidance's own message
                    raise ConstraintError(f"llguidance cannot use this tokenizer: {exc}") from exc
            return self._tokenizer

    def json_schema(self, schema: Mapping[str, Any]) -> GrammarConstraint:
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(_compact(schema))
        except Exception as exc:  # noqa: BLE001
            raise ConstraintError(f"unusable JSON schema: {exc}") from exc
        return self._matcher(grammar)

    def lark(self, source: str) -> GrammarConstraint:
        return self._matcher(_llguidance().LLMatcher.grammar_from_lark(source))

    def from_grammar(self, grammar: str) -> GrammarConstraint:
        """A new constraint of another's compiled grammar (`GrammarConstraint.grammar`): the same
        masks step by step for the same tokens (a distributed server's ranks each hold one)."""
        return self._matcher(grammar)

    def _matcher(self, grammar: str) -> GrammarConstraint:
        llg = _llguidance()
        tokenizer = self._lltokenizer()
        problem = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise ConstraintError(f"unusable grammar: {problem}")
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"unusable grammar: {_reason(matcher.get_error())}")
        constraint = GrammarConstraint(matcher, self._vocab, grammar)
        # Some grammars fail only at their first mask (a schema that refers to itself and nothing
        # else): computed here, that is a refused request rather than a failed generation.
        unsatisfiable = "unusable grammar: no output satisfies it"
        try:
            first = constraint.allowed()
        except ConstraintError:
            raise ConstraintError(f"{unsatisfiable} ({_reason(matcher.get_error())})") from None
        if not first.any():
            raise ConstraintError(f"{unsatisfiable} (no token may start one)")
        return constraint


def _reason(error: str) -> str:
    """llguidance's error without the parser state and grammar it appends (internal, and long)."""
    return error.split("<state>", 1)[0].strip()


# Compact JSON (", " and ": " between items, no other whitespace): with flexible whitespace a model
# unsure of what comes next may emit blanks until max_tokens.
COMPACT = {"whitespace_flexible": False}


def _compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**dict(schema), "x-guidance": {**COMPACT, **dict(schema.get("x-guidance") or {})}}


def json_lark_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule body for a compact JSON value of `schema` (llguidance's `%json` extension)."""
    return "%json " + json.dumps(_compact(schema))


class GrammarConstraint:
    """One request's grammar state (see `batching.Constraint`)."""

    def __init__(self, matcher: Any, vocab_size: int, grammar: str) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self.grammar = grammar  # llguidance's grammar text, as compiled from the schema or Lark source
        self._mask: np.ndarray | None = None  # the mask of the current position, once computed

    def allowed(self) -> np.ndarray:
        if self._mask is None:
            mask = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8)
            if self._matcher.is_error():
                raise ConstraintError(f"grammar: {_reason(self._matcher.get_error())}")
            self._mask = mask[: self._vocab] > 0
        return self._mask

    def advance(self, token: int) -> None:
        self._mask = None
        if not self._matcher.consume_token(token):
            raise ConstraintError(f"grammar refused token {token}: {_reason(self._matcher.get_error())}")

    def done(self) -> bool:
        return bool(self._matcher.is_stopped())
