"""How many rows a decode call frees before the host looks again, while requests wait for rows.

Ending the on-device loop at the first row that stops frees its row at once, but each return to
the host costs a round trip: the decode call's host call, and a join (or a prefill) for the row
it frees. On a busy server rows stop nearly every step, so those round trips can cost as much
as the steps themselves. Waiting for j stops makes one round trip free j rows; the rows that
stopped first stand idle until the j-th stops, each idle step a row that could have produced a
token. The host knows how many steps each running row has left to its limit, so it prices
both and takes the j whose round trip and idle row-steps cost least per freed row:

    cost(j) = (round_trip_s + row_step_s * sum_{i<j} (left[j-1] - left[i])) / j

over j = 1 .. min(rows wanted, rows running), ``left`` sorted (a stop token ends a row sooner:
the loop counts real stops, so that only makes the call end earlier than priced). The prices
come from the cost model the serving loop already holds (``mixing.Pricer``): a round trip is a
one-row join and the decode call's host call (``pricing.CallPricer``); an idle row-step is a
decode step's time over its rows. With no round-trip cost the rule is the old one (j = 1).

    j = stops_to_wait(left=[3, 1, 9, 4], wanted=2, round_trip_s=2e-3, row_step_s=1e-4)
    batch.advance(max_steps, stops=j)
    batch.advance(max_steps, stops=Cadence(pricer, max_seq).stops(batch, wanted))  # priced

Both loops use it: the virtual clock's (``continuous.py``) and the live server's (``live.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from vocabjax.serving.batching import Call, RunningBatch
from vocabjax.serving.mixing import Pricer
from vocabjax.serving.pricing import CallPricer


def stops_to_wait(
    left: Sequence[int], wanted: int, *, round_trip_s: float, row_step_s: float
) -> int:
    """The stops a decode call waits for (module doc): at least 1; more only while requests
    want rows (``wanted``) and waiting for one more costs less per freed row."""
    ordered = sorted(left)
    most = min(wanted, len(ordered))
    best, best_cost, idle = 1, float("inf"), 0.0
    for j in range(1, most + 1):
        # every row that stops before the j-th idles from its stop to the j-th's
        idle = sum(ordered[j - 1] - x for x in ordered[: j - 1])
        cost = (round_trip_s + row_step_s * idle) / j
        if cost < best_cost:
            best, best_cost = j, cost
    return best


class Cadence:
    """``stops_to_wait`` priced on the serving loop's device (its ``mixing.Pricer``) for a
    run whose carries hold ``max_seq`` positions."""

    def __init__(self, pricer: Pricer, max_seq: int) -> None:
        self.pricer = pricer
        self.calls = CallPricer(pricer.model, max_seq)

    def round_trip(self, vocab: int, rows: int) -> float:
        """One return to the host: a one-row join into ``rows`` rows and a decode call's host
        call."""
        join = Call("join", vocab, rows, 0, 0.0, 0.0, joined=1)
        return self.calls.seconds(join, score=False) + self.pricer.model.host_call()

    def stops(self, batch: RunningBatch, wanted: int) -> int:
        """The stops ``batch``'s next decode call waits for while ``wanted`` requests want
        rows (waiting or staged): 1 when none does."""
        if wanted <= 0 or not batch.live:
            return 1
        vocab, rows = batch.vocab, batch.rows
        return stops_to_wait(
            batch.remaining(),
            wanted,
            round_trip_s=self.round_trip(vocab, rows),
            row_step_s=self.pricer.step_seconds(vocab, rows) / rows,
        )
