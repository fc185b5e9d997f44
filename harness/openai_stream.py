"""The text a streamed response may send while the model is still generating (pure).

The endpoint streams each choice's text as the sampler produces tokens, but a piece of
text, once sent, cannot be taken back, and the answer the client finally gets (the call's
record: stop strings applied, tool calls parsed) must be exactly the pieces joined. So
`TextStreamer` sends only text that is certain to stay:

* not a trailing incomplete character (a byte tokenizer's partial UTF-8 decodes to
  U+FFFD until its last byte arrives);
* nothing from a stop string on, and not a tail that may be the start of one (it is
  sent once the next tokens show it is not);
* with tool-call parsing, nothing from the tool-call marker (``<tool_call>``) on, nor a
  tail that may start it, nor trailing whitespace (the content before tool calls is
  returned without it); the calls themselves go out with the finish, once parsed.

`TextStreamer.push` takes the ids generated so far (the prefix grows with each chunk)
and returns the new safe text; `TextStreamer.rest` returns what completes the final
text. When decoding a longer prefix rewrites earlier text (a tokenizer that cleans up
spaces on decode), the streamer stops sending and the rest goes out at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

from .chat import ChatTokenizer

__all__ = ["TOOL_CALL_MARKER", "TextStreamer"]

TOOL_CALL_MARKER = "<tool_call>"
"""Where the tool calls of an answer begin (the template's format, `tool_calls`)."""


def _held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class TextStreamer:
    """The safe text of one choice (module docstring)."""

    def __init__(self, tok: ChatTokenizer, *, stops: Sequence[str] = (), tool_calls: bool = False) -> None:
        self.tok = tok
        self.stops = [s for s in stops if s]
        self.tool_calls = tool_calls
        self.sent = ""
        self._ended = False  # a stop string, the tool-call marker or a rewrite: nothing more now

    def _safe(self, full: str) -> str:
        text = full.rstrip("\ufffd")
        ends = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if self.tool_calls and (i := text.find(TOOL_CALL_MARKER)) >= 0:
            ends.append(i)
        if ends:
            self._ended = True
            text = text[:min(ends)]
        else:
            markers = [*self.stops, *([TOOL_CALL_MARKER] if self.tool_calls else [])]
            text = text[:len(text) - _held_tail(text, markers)]
        if self.tool_calls:
            text = text.rstrip()
        return text

    def push(self, ids: Sequence[int]) -> str:
        """The new text that can be sent now that ``ids`` (all generated so far) are known."""
        if self._ended:
            return ""
        text = self._safe(self.tok.decode(ids))
        if not text.startswith(self.sent):
            self._ended = True  # decoding rewrote sent text: send the rest at the end
            return ""
        piece = text[len(self.sent):]
        self.sent = text
        return piece

    def rest(self, final: str) -> str:
        """What completes ``final``, the answer's text as recorded, after the text sent.
        ``final`` always starts with it (the module docstring's rules keep it so)."""
        if not final.startswith(self.sent):
            raise ValueError(f"the streamed text {self.sent[-40:]!r} is not a prefix of the answer")
        return final[len(self.sent):]
