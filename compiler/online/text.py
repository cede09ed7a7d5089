"""A request's output as text for ``batchc serve``: incremental detokenisation and stop strings,
through the offline runner's ``compiler.offline.stops.StopScanner`` (one implementation: a request
is cut at the same token, with the same text, online and in ``batchc run``'s ``--outputs``).

``TextStream`` takes the generated ids as they arrive and returns the text that may be shown now.
Stop strings are matched on the detokenised text, as the OpenAI API defines them (and with
``min_tokens`` as vLLM's stop checker: an occurrence before the output holds ``min_tokens`` tokens
is passed over): the text ends before the first stop string, and the stream reports ``stopped``. So
that a stop string split across tokens (or across the deltas of a speculative window) is never
shown in part, the last ``longest stop - 1`` characters are held back until more text or the end
decides them.

Invariants: the pieces ``push`` and ``finish`` return, joined, equal the text ``batchc run`` writes
for the same output ids (``compiler.offline.run``: the text before the stop string, ``StopCut.text``,
or, when none occurs, ``Tokenizer.decode`` of all of them); ``tokens`` counts the ids kept
(``StopCut.keep``: up to and including the one whose text completed the stop string; all of them
when none occurs), which the engine is asked to keep (``Engine.finish``).

``token_text`` gives a token's text and bytes for logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from compiler.offline.stops import StopScanner
from compiler.offline.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["TextStream", "token_text"]


class TextStream:
    """One completion's output as text (see the module): ``push`` the ids as they arrive, ``finish`` at
    the end; a stop string (matched on the text, none before ``min_tokens`` tokens) ends it there."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], *, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._scanner = StopScanner(tokenizer, stops, min_tokens=min_tokens)
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._ids: list[int] = []
        self.text = ""
        """Everything returned so far."""

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text (later ids are not taken)."""
        return self._scanner.cut is not None

    @property
    def tokens(self) -> int:
        """How many ids the text keeps: up to the one that completed the stop string, or all of them."""
        cut = self._scanner.cut
        return cut.keep if cut is not None else len(self._ids)

    def _show(self, upto: str) -> str:
        """The text past what was shown, up to ``upto`` (which extends it: held-back characters
        cover any stop string that could still begin in it)."""
        assert upto.startswith(self.text), "shown text was cut back"
        new, self.text = upto[len(self.text):], upto
        return new

    def push(self, ids: Iterable[int]) -> str:
        """The text ``ids`` make showable (ids after a stop string are not taken)."""
        if self.stopped:
            return ""
        self._ids.extend(int(t) for t in ids)
        cut = self._scanner.feed(self._ids)
        if cut is not None:
            return self._show(cut.text)
        full = self._scanner.text
        return self._show(full[: max(len(self.text), len(full) - self._hold)])

    def finish(self) -> str:
        """The rest of the text, at the end of the output."""
        if self.stopped:
            return ""  # (``push`` showed all of the text before the stop string)
        return self._show(self._tokenizer.decode(self._ids))


def token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """One token's text and bytes, as logprobs report them: on the byte-level path the token's byte
    (text: that byte decoded, U+FFFD for a byte that is not a whole character), else the
    tokenizer's decoding of the token alone and its UTF-8 bytes."""
    if isinstance(tokenizer, ByteTokenizer):
        raw = bytes((token,))
        return raw.decode("utf-8", errors="replace"), list(raw)
    text = tokenizer.decode([token])
    return text, list(text.encode("utf-8"))
