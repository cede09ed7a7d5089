"""Stop strings (``SamplingParams.stop``, OpenAI semantics): a request ends at the first of its stop
strings that appears in its detokenized output, and its text ends before that stop string.

``StopScanner`` pushes a request's output ids through the tokenizer's incremental detokenizer
(``compiler.offline.tokenizer``) one id at a time and looks for the stop strings in the text each id
completes. So a stop string split over several tokens is found at the token that completes it, and
several tokens emitted in one step (a speculative window) are looked at one by one: the first
stop string to appear wins, whatever step brought the tokens.

Invariants:

- ``StopCut.keep`` is the number of output ids kept: those up to and including the id whose text
  completed the stop string (the detokenizer may hold back an unfinished character's bytes, and
  then the id that releases them). Ids after it (the rest of a speculative window) are dropped. The
  ids kept may decode to more than ``StopCut.text``: like vLLM's token ids, they hold the stop
  string's tokens; the text does not.
- ``StopCut.text`` is the output's text before the first character of the stop string.
- With ``min_tokens``, a stop string counts only once the output holds at least ``min_tokens``
  tokens (the completing one included); an earlier occurrence is passed over, as vLLM's stop checker
  does.
- Scanning is prefix-consistent: feeding the ids of one output in any number of calls finds the same
  cut, so the ``--outputs`` writer (``compiler.offline.models.output_lines``) finds again, from the kept
  ids alone, the cut the serving loop made (``compiler.offline.run.serve``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from compiler.offline.tokenizer import Tokenizer

__all__ = ["StopCut", "StopScanner", "scan"]


@attrs.frozen(kw_only=True)
class StopCut:
    """Where a stop string ended a request's output (module docstring)."""

    keep: int
    text: str
    stop: str
    """The stop string that ended it."""


class StopScanner:
    """One request's stop-string search over its output ids (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], *, min_tokens: int = 0) -> None:
        self._detok = tokenizer.detokenizer()
        self._stops = tuple(stops)
        self._min_tokens = min_tokens
        self._text = ""
        self._fed = 0
        self.cut: StopCut | None = None

    @property
    def fed(self) -> int:
        """Output ids pushed so far."""
        return self._fed

    @property
    def text(self) -> str:
        """The text of the ids pushed so far (the detokenizer's pieces joined: the bytes of a
        character not complete yet are not in it; nor is anything after a cut's stop string's
        completing id). ``batchc serve`` streams it (``compiler.online.text``)."""
        return self._text

    def feed(self, output: Sequence[int]) -> StopCut | None:
        """Push the ids of ``output`` (the request's whole output so far; the ids pushed before
        must be its prefix) not pushed yet; the cut once a stop string appears, else ``None``.
        Once found, the cut stays and nothing more is pushed."""
        if self.cut is not None:
            return self.cut
        for i in range(self._fed, len(output)):
            piece = self._detok.push(int(output[i]))
            self._fed = i + 1
            if not piece:
                continue
            before = len(self._text)
            self._text += piece
            if i + 1 < self._min_tokens:
                continue
            found: tuple[int, str] | None = None
            for s in self._stops:
                # only occurrences that end in the new text: the older text held none that counted
                at = self._text.find(s, max(0, before - len(s) + 1))
                if at >= 0 and (found is None or at < found[0]):
                    found = (at, s)
            if found is not None:
                self.cut = StopCut(keep=i + 1, text=self._text[: found[0]], stop=found[1])
                return self.cut
        return None


def scan(tokenizer: Tokenizer, stops: Sequence[str], output: Sequence[int], *, min_tokens: int = 0) -> StopCut | None:
    """The cut of ``output`` at its first stop string (``StopScanner``), or ``None``."""
    if not stops:
        return None
    return StopScanner(tokenizer, stops, min_tokens=min_tokens).feed(output)
