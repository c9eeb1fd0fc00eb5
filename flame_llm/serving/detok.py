"""Text of a streamed choice, token chunk by token chunk: incremental detokenization (a token that ends inside a
multi-byte character waits for the next one) and stop strings (the text ends before the first match; text that
could be the start of a stop string is held back until it is known not to be)."""
from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence
PREFIX_WINDOW = 6  # tokens decoded before the new ones, so a tokenizer's spacing rules see their context


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop or [])
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut before a matched stop string)
        self.sent = 0  # characters of text handed out
        self.prefix_offset = self.read_offset = 0
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False  # a stop string matched

    def feed(self, token_ids: list[int]) -> str:
        """The new text these tokens make that is safe to show now."""
        if self.stopped or not token_ids:
            return ""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        now = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            checked = len(self.text)
            self.text += now[len(before):]
            self.prefix_offset = max(self.read_offset, len(self.ids) - PREFIX_WINDOW)
            self.read_offset = len(self.ids)
            self._match_stop(max(0, checked - self.hold))
        end = len(self.text) if self.stopped else len(self.text) - self.hold
        return self._take(end)

    def finish(self) -> str:
        """The rest, once the stream has ended: held-back text, and tokens that end inside a character (their
        replacement character, as a whole decode shows it)."""
        if not self.stopped and self.read_offset < len(self.ids):
            decode = self.tokenizer.decode
            before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
            now = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
            checked = len(self.text)
            self.text += now[len(before):]
            self.read_offset = len(self.ids)
            self._match_stop(max(0, checked - self.hold))
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def _match_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
