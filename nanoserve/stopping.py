"""When to stop, and what text is safe to show while streaming (day 10).

`StopStrings` watches the text a sequence produces, piece by piece. A stop string may arrive
split over several pieces, so text that could still turn out to be the start of one is held
back until it is known either way; the text in front of a stop string is released and the stop
string itself never is (OpenAI's convention).

    s = StopStrings(("\\n\\n",))
    s.feed("Hi\\n")   -> ("Hi", False)       "\\n" might start "\\n\\n": held
    s.feed("\\nBye")  -> ("", True)          stopped; "\\n\\nBye" is never shown
"""

from __future__ import annotations


def first_stop(text: str, stops) -> int | None:
    """Where the text is cut: the start of the stop string that is complete first as the text
    grows (the earliest end), ties going to the one that starts earlier. None if none occurs.

    "aba" with stops ("b", "aba"): "b" is complete at the second character, "aba" only at the
    third, so the cut is at 1 and the text is "a".
    """
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


class StopStrings:
    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = tuple(stops)
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

    def feed(self, piece: str) -> tuple[str, bool]:
        """Take the next piece of text; return (text safe to release now, stopped)."""
        if self.stopped:
            return "", True
        text = self.held + piece
        hit = first_stop(text, self.stops)
        if hit is not None:
            self.stopped, self.held = True, ""
            return text[:hit], True
        keep = self._holdback(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The sequence ended for another reason: what was held is ordinary text after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
