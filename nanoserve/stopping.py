"""When to stop, and what text is safe to show while streaming (day 10).

`StopStrings` watches the text a sequence produces, piece by piece. A stop string may arrive
split over several pieces, so text that could still turn out to be the start of one is held
back until it is known either way; the text in front of a stop string is released and the stop
string itself is not (OpenAI's convention), unless `keep` is set (vLLM's
`include_stop_str_in_output`: the text ends with the stop string; anything after it still goes).

    s = StopStrings(("\\n\\n",))
    s.feed("Hi\\n")   -> ("Hi", False)       "\\n" might start "\\n\\n": held
    s.feed("\\nBye")  -> ("", True)          stopped; "\\n\\nBye" is never shown

`feed(piece, can_stop=False)` is a piece from a token that may not end the sequence (vLLM's
`min_tokens`: the first min_tokens tokens cannot). A stop string that is complete in such text
is ordinary text and never ends the sequence later; one that only starts there and is
completed by a later piece does, as in vLLM, whose check looks only at stop strings that end
in the newest text. The text is held back as usual meanwhile, so such a stop string is not
shown before it is known to be one.
"""

from __future__ import annotations


def first_stop(text: str, stops, after: int = 0) -> int | None:
    """Where the text is cut: the start of the stop string that is complete first as the text
    grows (the earliest end), ties going to the one that starts earlier. None if none occurs.
    Only stop strings that end past `after` characters count (the text before was looked at).

    "aba" with stops ("b", "aba"): "b" is complete at the second character, "aba" only at the
    third, so the cut is at 1 and the text is "a".
    """
    found = _matches(text, stops, after)
    return min(found)[1] if found else None


def _matches(text: str, stops, after: int) -> list[tuple[int, int]]:
    """(end, start) of each stop string's first occurrence that ends past `after`."""
    found = []
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0:
            found.append((i + len(s), i))
    return found


class StopStrings:
    def __init__(self, stops: tuple[str, ...] | list[str] = (), keep: bool = False):
        self.stops = tuple(stops)
        self.keep = keep  # the stop string stays in the text (include_stop_str_in_output)
        self.held = ""  # text not yet released: it may be the start of a stop string
        self.stopped = False

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def feed(self, piece: str, can_stop: bool = True) -> tuple[str, bool]:
        """Take the next piece of text; return (text safe to release now, stopped). With
        can_stop False the piece cannot end the sequence (module doc)."""
        if self.stopped:
            return "", True
        # what is held was looked at when it came; a stop string must end in the new piece
        text, seen = self.held + piece, len(self.held)
        found = _matches(text, self.stops, seen) if can_stop else []
        if found:
            end, start = min(found)
            self.stopped, self.held = True, ""
            return text[: end if self.keep else start], True
        keep = self._holdback(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The sequence ended for another reason: what was held is ordinary text after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
