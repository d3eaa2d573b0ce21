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


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abc\n", max_size=40),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3), max_size=2),
    st.data(),
)
def test_streamed_output_is_the_text_before_the_first_stop(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = (text[: min(hits)], True) if hits else (text, False)
    assert run(pieces, stops) == expected
