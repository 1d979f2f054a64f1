"""Noticing an answer that has fallen into a loop, as small models do past their depth, token by token as it is
written, so that decoding stops there instead of running to --max-new-tokens.

A loop is not always one block of tokens repeated exactly. Summarizing a 17-page specification, SmolLM2-135M wrote
"2.N. The file\\nThe file is a list of lines containing a MIME type..." 35 times with N counting up, and some copies
a line break longer than others (issue 50): a guard that wants exact copies never saw it. So a block also counts as
repeated when each copy differs from the one before in a few tokens (a number counting up) and is a token longer or
shorter (a line break more or less). A list or a table, whose lines say something different each time, still never
trips it.
"""

# A near copy: of every NEAR_MISSES tokens, at most one that matches no token of the copy before (a counter).
NEAR_MISSES = 12
# Shorter blocks are held to exact copies: with a token of slack either side, a short block matches too easily.
NEAR_MIN_PERIOD = 8
# Near copies must go on twice as long as exact ones before they count: a table whose rows differ only in a number
# is text a model may mean for a few rows; eight copies of one sentence with a number counting up, as in the issue's
# 35, are a loop. The two look alike token by token, so such a table is cut after about eight rows too (the 19 rows
# of docs/compatibility.md, written out, would be).
NEAR_SPAN_FACTOR = 2


class RepetitionGuard:
    """Notices an answer that has fallen into a loop: one block of up to `longest_period` tokens repeated back to
    back, at least `min_copies` times and over at least `min_tokens` tokens; or (a block of NEAR_MIN_PERIOD tokens or
    more) nearly, twice as long: each token equal to the token one copy before it, give or take one place, but for
    one token in NEAR_MISSES. A list or a table varies from line to line and never trips it; a sentence said four
    times over does, and so does a numbered heading with the same sentence under it, eight times.

    Per token it updates, for each period p, how many tokens in a row have equalled the token p before, and how many
    of the last copies' tokens matched none of the tokens p - 1, p and p + 1 before: linear in the answer, a few
    integer comparisons per period and token, and memory bounded by the longest span it watches."""

    def __init__(self, longest_period: int = 64, min_copies: int = 4, min_tokens: int = 48) -> None:
        self.longest_period, self.min_copies, self.min_tokens = longest_period, min_copies, min_tokens
        self.tokens: list[int] = []  # the latest tokens, as many as the comparisons reach back
        periods = range(longest_period + 1)
        self.spans = [self.span(period) for period in periods]
        self.runs = [0] * (longest_period + 1)  # runs[p]: the latest tokens that equal the token p before them
        # Per period p, a ring of the last comparisons with the copy before (1: a miss), how many were made and
        # missed; a near copy may be a token longer, so the ring covers the copies of period p + 1.
        self.rings = [bytearray(NEAR_SPAN_FACTOR * self.span(period + 1) - period) for period in periods]
        self.allowed = [len(ring) // NEAR_MISSES for ring in self.rings]
        self.seen, self.misses = [0] * (longest_period + 1), [0] * (longest_period + 1)

    def span(self, period: int) -> int:
        """How many tokens an exact loop of `period` must cover before it counts: its copies, the first one
        included (a near loop: NEAR_SPAN_FACTOR times as many)."""
        return max(self.min_copies * period, self.min_tokens)

    def looping(self, token: int) -> bool:
        """Add `token`; True when the answer now ends in a loop. (Plain lists and index arithmetic: it runs for
        every token decoded, 64 periods each.)"""
        tokens, runs = self.tokens, self.runs
        tokens.append(token)
        if len(tokens) > 2 * (self.longest_period + 2):  # only the last period + 2 tokens are ever looked at
            del tokens[: self.longest_period + 2]
        last = len(tokens) - 1  # `token`'s index
        for period in range(1, min(self.longest_period, last) + 1):
            exact = tokens[last - period] == token
            runs[period] = runs[period] + 1 if exact else 0
            if runs[period] + period >= self.spans[period]:
                return True
            if period < NEAR_MIN_PERIOD:
                continue
            missed = not (exact or tokens[last - period + 1] == token  # this copy a token shorter, or longer
                          or (last > period and tokens[last - period - 1] == token))
            ring = self.rings[period]
            slot = self.seen[period] % len(ring)
            self.misses[period] += missed - ring[slot]
            ring[slot] = missed
            self.seen[period] += 1
            if self.seen[period] >= len(ring) and self.misses[period] <= self.allowed[period]:
                return True
        return False
