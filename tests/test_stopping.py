"""Stop strings over streamed pieces: nothing past a stop string is shown, nothing else is lost."""

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.stopping import StopStrings


def run(pieces, stops):
    s = StopStrings(stops)
    out = ""
    for piece in pieces:
        text, stopped = s.feed(piece)
        out += text
        if stopped:
            return out, True
    return out + s.flush(), False


def test_stop_split_across_pieces_is_caught_and_hidden():
    assert run(["Hi\n", "\nBye"], ["\n\n"]) == ("Hi", True)


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop():
    s = StopStrings(["END"])
    assert s.feed("the EN") == ("the ", False)
    assert s.feed("D") == ("", True)
    s = StopStrings(["END"])
    assert s.feed("the EN") == ("the ", False)
    assert s.feed("ds") == ("ENds", False)


def test_earliest_stop_wins():
    assert run(["a STOP b HALT"], ["HALT", "STOP"]) == ("a ", True)


def test_the_stop_completed_first_wins_whatever_the_pieces():
    # "b" is complete one character before "aba" is, so the cut is after "a"
    for pieces in (["aba"], ["ab", "a"], ["a", "b", "a"]):
        assert run(pieces, ["b", "aba"]) == ("a", True)


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abc\n", max_size=40),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3), max_size=2),
    st.data(),
)
def test_streamed_output_is_the_text_before_the_first_stop(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    # the reference: grow the text one character at a time and cut at the first complete stop
    expected = (text, False)
    for n in range(1, len(text) + 1):
        done = [s for s in stops if text[:n].endswith(s)]
        if done:
            expected = (text[: n - max(len(s) for s in done)], True)
            break
    assert run(pieces, stops) == expected
