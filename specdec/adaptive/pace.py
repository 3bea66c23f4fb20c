"""How the controller paces drafting that only its confidence bound keeps on.

Where the estimate says no k pays but the bound says one may (controller.choose_k), the controller
drafts to learn. Near break-even the bound may need hundreds of rounds to decide, and each of them
may cost more than the plain steps it replaces: on a short run the learning was the run (the 1B
stand-in at q4_k_m, 3 prompts x 48 tokens: 0.91x plain, drafting all along). So these learning
rounds keep an account of their measured excess over plain decoding (a round's time less its
tokens' plain time; negative where it paid, never below zero in all), and one runs only while the
account is within EXPLORE_SHARE of the time decoded so far plus EXPLORE_ALLOWANCE plain steps; past
that the controller decodes plainly until the elapsed time has caught up. Learning rounds that pay
are not paced, a few unlucky ones fit in the allowance, and a drafter that cannot pay costs about
EXPLORE_SHARE of a long run while its bound decides. Rounds the estimate chooses are not paced.

Later requests also bring their own NEW_REQUEST_ALLOWANCE, spent before the account, and while it
lasts the request learns on its own evidence too (the controller's bound counts the request's own upper
bound, and speculation given up is weighed again for it): its text may pay where the last ones' did not.
The account and the drafter's bound alone had kept a drafter off for a whole benchmark after its first
16 tokens (a warm-up whose 8 drafted rounds were all rejected: 8 x 128 tokens at plain speed, where the
same draft paid 1.3x). Such a trial's first round also pays the drafter's catch-up on the prompt (a draft
model's prefill: 6 ms, 2.5 plain steps, on llama.cpp for the shipped pair, not charged to the account: it is
switching on, which any drafting pays), so trials back off: while they end without the estimate saying
drafting pays, only one request in 2, 4, ... up to MAX_TRIAL_EVERY brings the allowance (llama.cpp on
Xeon-AMX-FP16, nothing paying: a trial every request cost 4-6% of plain decoding).
"""

from __future__ import annotations

EXPLORE_SHARE = 0.01  # learning may cost this share of the decoding time so far ...
EXPLORE_ALLOWANCE = 3.0  # ... plus this many plain steps (three wholly rejected rounds are not paced)
NEW_REQUEST_ALLOWANCE = 0.5  # plain steps of learning a later request may spend whatever the account says ...
MAX_TRIAL_EVERY = 8  # ... one request in 1, 2, 4, ... up to this many while trials find nothing that pays


class Pacer:
    """The learning rounds' account: the time decoded, their excess, and the time learning waits for."""

    def __init__(self, share: float = EXPLORE_SHARE):
        self.share = share  # EXPLORE_SHARE (inf: unpaced, as benchmarks/bench_adaptive.py --unpaced compares)
        self.elapsed_s = 0.0  # every reported round's time (draft, verify and host work)
        self.excess_s = 0.0  # learning rounds' time beyond plain decoding of the tokens they gave (>= 0)
        self.learning = False  # the round just chosen is a learning round
        self.resume_at_s = 0.0  # while elapsed_s is below this, learning waits ...
        self.paced_ids: list[int] = []  # ... if the batch is still these rows (a new row's estimate may differ)
        self.granted: set[int] = set()  # rows admitted (until released); after the first ones ...
        self.first_seen = False  # ... each brought NEW_REQUEST_ALLOWANCE (the first rows have the account's)
        self.fresh_s = 0.0  # what is left of those allowances
        self.trial_every = 1  # one later request in this many brings the allowance (``release``) ...
        self.until_trial = 0  # ... and how many more are admitted without it before the next does
        self.trials: set[int] = set()  # rows that brought it, until released
        self.paid_ids: set[int] = set()  # rows for which the estimate said that drafting pays

    def allows(self, plain_s: float, seq_ids: list[int]) -> bool:
        """Whether a learning round for the rows ``seq_ids`` may run now (``plain_s``: a plain token's
        wall time); if not, the elapsed time they wait for is kept (``waiting``)."""
        if self.fresh_s > 0.0 or self.excess_s <= self.share * self.elapsed_s + EXPLORE_ALLOWANCE * plain_s:
            return True
        self.resume_at_s = (self.excess_s - EXPLORE_ALLOWANCE * plain_s) / self.share
        self.paced_ids = list(seq_ids)
        return False

    def admit(self, seq_ids: list[int], plain_s: float) -> None:
        """Rows the controller weighs: a row not seen before, but for the first ones, brings
        NEW_REQUEST_ALLOWANCE plain steps (``plain_s``: a plain token's wall time)."""
        for sid in seq_ids:
            if sid not in self.granted:
                self.granted.add(sid)
                if not self.first_seen:
                    continue
                if self.until_trial > 0:
                    self.until_trial -= 1
                else:
                    self.fresh_s += NEW_REQUEST_ALLOWANCE * plain_s
                    self.trials.add(sid)
        self.first_seen = True

    def paid(self, seq_ids: list[int]) -> None:
        """The estimate said that drafting pays for these rows (a trial that ends so resets the back-off)."""
        self.paid_ids.update(seq_ids)

    def waiting(self, seq_ids: list[int]) -> bool:
        """Whether learning for these rows is paced off until more time has been decoded (plain rounds
        change no estimate, so the decision stands without weighing k again). A batch with other rows
        is weighed again: a new request's text may pay where the last one's did not."""
        return self.elapsed_s < self.resume_at_s and seq_ids == self.paced_ids

    def record(self, seconds: float, excess_s: float | None) -> None:
        """A round's time; ``excess_s``: a learning round's time beyond plain decoding of its tokens."""
        self.elapsed_s += seconds
        if excess_s is not None:
            spent = min(self.fresh_s, max(excess_s, 0.0))  # new requests' allowances first
            self.fresh_s -= spent
            self.excess_s = max(0.0, self.excess_s + excess_s - spent)
        self.learning = False

    def release(self, seq_ids: list[int]) -> None:
        """Finished rows: their allowances are no longer theirs to spend; a trial row that the estimate
        never said paid for doubles the requests between trials, one it did resets them."""
        for sid in seq_ids:
            if sid in self.trials:
                self.trials.discard(sid)
                self.trial_every = 1 if sid in self.paid_ids else min(2 * self.trial_every, MAX_TRIAL_EVERY)
                self.until_trial = self.trial_every - 1
        self.paid_ids.difference_update(seq_ids)
        self.granted.difference_update(seq_ids)
        if not self.granted:
            self.fresh_s = 0.0
