"""The speculation budget as a measured choice: a cost model over candidate plans, fed by
every round's measurements (SmartSpec's goodput, extended with the network and the batch).

    speculative plan (b draft nodes):  tokens/s = E[accepted + 1 | b] / (T_draft(b) + T_pass(N) + N * X(b) + wire)
    the verifier alone (b = 0):        tokens/s = block / (block * T_pass(N) + wire)

The verifier batches the rounds of the N sessions that reach it together (continuous
batching), so a round's verify time is that of a pass over every session's tokens. Since all
requests share this controller, they run alike: with N sessions each feeding n tokens a pass
holds N * n, and the plan that maximises one session's tokens per second maximises the
goodput of all of them. Idle (N = 1) this is the plain latency model; under load the cost of
the extra rows makes speculation give way to the verifier alone.

All inputs are exponential moving averages of what the rounds measured:
- acceptance: for chains, the rate each depth d keeps of the rounds that reached it,
  P(accepted >= d | accepted >= d - 1), learned from every chain that drafted that deep, so a
  chain of 8 also teaches what a chain of 2 would accept, and a round stopped at depth 1 says
  nothing of depth 5 (counted as P(accepted >= d), a round that kept nothing was a miss at every
  depth: one early chain-8 round on fresh text priced chain-8 below rsd-s-16 for a benchmark's
  hundred rounds); for trees, accepted tokens per plan;
- T_draft per plan;
- T_pass by the rows of a pass (all sessions' tokens fed), piecewise linear over what was
  measured, learned from the verifier alone's rounds: their passes hold one row per session;
  a fused block costs `block` passes. X(b), what a plan's verify call costs per session beyond
  such a pass (its tree's rows, the verifier state it brings back), learned from its own rounds at
  the load they ran at. (Tree rounds fed into T_pass instead priced a pass of 3 sessions like
  a 3-row tree with its features, half again a one-row pass: as a burst arrived, its first
  requests chose a one-token chain and paid for opening their drafter sessions under the
  full load.) N, the sessions per pass: the requests in
  flight at this coordinator now, times the share of them the verifier reported in its passes
  (a burst of requests is priced as a burst from its first round on, before any reports);
- wire time per call on each link (round trip, serialization, bandwidth), shared by all plans;
- the coordinator's own time per round, which no call accounts for: one figure for the
  verifier's rounds alone, one for speculative rounds (two calls and a tree to handle), so
  that a one-token chain does not look as cheap as its calls alone.
Every plan is tried once at the start. After that, every `revisit_every` rounds (times the
sessions per pass N, and times how many times slower than the best plan it looks, at most N,
or 2 idle; each round counts at its own load) the plan measured longest ago is tried once more:
the wire estimates are shared, so a stale plan's
estimate already follows the network, and the revisits refresh the rest (the drafter link's
time while the verifier alone was winning, and slowly drifting acceptance).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    budget: int  # draft tree nodes per round; 0 = the verifier alone
    method: str = "chain"
    ngram: str = ""  # n-gram candidates merged into the drafter model's (hybrid); "" = the request's

    @property
    def label(self) -> str:
        if self.budget == 0:
            return "fused"
        return f"{self.method}-{self.budget}" + (f"+{self.ngram}" if self.ngram else "")

    @property
    def profiled(self) -> bool:
        """A plain chain: all of them share one acceptance profile by depth."""
        return self.method == "chain" and not self.ngram


@dataclass(kw_only=True)  # eleven numbers of one round: named, so none can swap places
class RoundReport:
    plan: Plan
    accepted: int  # draft tokens accepted
    depth: int  # depth of the draft tree
    verified_tokens: int  # tokens the verify call was fed; tokens generated when fused
    draft_ms: float
    verify_ms: float
    draft_wire_ms: float  # call time not spent computing, per link
    verify_wire_ms: float
    opened: bool = False  # a call (re)opened a session: its times include reading the whole context
    batch_rows: float = 0.0  # the verifier's passes this round: mean rows of all sessions (0 = not reported: this round's own)
    batch_sessions: float = 0.0  # and mean sessions sharing them (0 = not reported: 1)
    wall_ms: float = 0.0  # the whole round at the coordinator (0 = not measured)
    accepted_forced: int = 0  # of `accepted`, tokens a constraint forced (drafted by no model)
    # The plan whose drafter proposed nothing this round (an n-gram drafter without a match), so
    # that the verifier went alone: `plan` is then Plan(0), and draft_ms its empty draft's cost.
    drafted_nothing: Plan | None = None

    @property
    def unaccounted_ms(self) -> float:
        """The round's time that no call accounts for: the coordinator's own work."""
        return max(self.wall_ms - self.draft_ms - self.verify_ms - self.draft_wire_ms - self.verify_wire_ms, 0.0)

    @property
    def passes(self) -> int:
        """Verifier passes the round took: one per token when fused, else one."""
        return max(self.verified_tokens, 1) if self.plan.budget == 0 else 1

    @property
    def pass_rows(self) -> float:
        return self.batch_rows or self.verified_tokens / self.passes


class Ema:
    """An exponentially weighted mean whose old samples fade by `decay` per new one,
    normalised by the summed weights (no bias toward zero at the start)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.total = self.weights = 0.0

    def add(self, x: float) -> None:
        self.total = self.decay * self.total + x
        self.weights = self.decay * self.weights + 1.0

    @property
    def value(self) -> float | None:
        return self.value_with(0.0, 0.0)

    def value_with(self, prior: float, prior_weight: float) -> float | None:
        """The mean with `prior` counted as `prior_weight` samples: an optimistic prior makes
        a rarely measured plan worth measuring again before it is written off on one unlucky
        round."""
        if self.weights + prior_weight == 0:
            return None
        return (self.total + prior_weight * prior) / (self.weights + prior_weight)

    def get(self, default: float) -> float:
        value = self.value
        return default if value is None else value


class PassCost:
    """T(rows), the time of a verifier pass over `rows` tokens of all sessions: an EMA of rows
    and of ms per power-of-two bucket of rows, joined by straight lines; below the smallest,
    the first line. Not one line for all: a pass costs ~0.5 ms per extra row of one session's
    tree but ~1.5 ms per row of many sessions (each row reads its own cache), and a line fitted
    to the narrow range of one load flattened out, pricing speculation for 32 sessions like the
    verifier alone. Past the largest bucket, the least-squares slope of all buckets: the last
    line alone came out flat where a bucket mixed one session's trees with many sessions' rows,
    and priced 16-node trees for 32 sessions (544 rows) like 32 rows. One bucket measured: flat
    (optimistic, so that larger passes get tried and measured)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.buckets: dict[int, tuple[Ema, Ema]] = {}
        self._points: list[tuple[float, float]] | None = None  # (rows, ms) by rows, until the next add

    def add(self, rows: float, ms: float) -> None:
        rows_ema, ms_ema = self.buckets.setdefault(max(round(rows), 1).bit_length(), (Ema(self.decay), Ema(self.decay)))
        rows_ema.add(rows)
        ms_ema.add(ms)
        self._points = None

    def __call__(self, rows: float) -> float | None:
        if self._points is None:
            self._points = sorted((r.value, m.value) for r, m in self.buckets.values())
        points = self._points
        if not points:
            return None
        if len(points) == 1:
            return points[0][1]
        if rows > points[-1][0]:
            (x0, y0), slope = points[-1], _least_squares_slope(points)
        else:
            index = min(max(sum(x <= rows for x, _ in points), 1), len(points) - 1)
            (x0, y0), (x1, y1) = points[index - 1], points[index]
            slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        return max(y0 + max(slope, 0.0) * (rows - x0), 1e-3)


def _least_squares_slope(points: list[tuple[float, float]]) -> float:
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


class BudgetController:
    """Thread-safe; one per coordinator, shared by all requests, and no request waits on
    another's bookkeeping: a report that finds the controller busy is queued for whoever
    holds it next, and a choice that finds it busy takes the best plan by the rates last
    computed, if they were computed at the same load (and does not count toward revisits; at
    another load it waits). Waiting on its lock, 32 streams' threads queued behind one
    another every pass, and their wake-ups stalled the verifier's compute."""

    # How fast old measurements fade: acceptance is noisy and drifts slowly, compute times
    # are steady, and the network may change at any moment.
    ACCEPTANCE_DECAY, COMPUTE_DECAY, WIRE_DECAY = 0.97, 0.9, 0.7
    PRIOR_WEIGHT = 2.0  # optimistic acceptance priors count as this many rounds
    IDLE_STRETCH = 2.0  # idle, revisits of a plan that looks slower come at most this many times further apart

    def __init__(self, plans: list[Plan], fused_block: int, revisit_every: int = 64, in_flight: Callable[[], int] = lambda: 1):
        if not plans:
            raise ValueError("the controller needs at least one plan")
        self.plans = list(plans)
        self.fused_block = fused_block
        self.revisit_every = revisit_every
        self.kept_at: dict[int, Ema] = {}  # chains: depth d -> P(accepted >= d | accepted >= d - 1)
        self.tree_accepted = {p: Ema(self.ACCEPTANCE_DECAY) for p in self.plans}
        self.draft_ms = {p: Ema(self.COMPUTE_DECAY) for p in self.plans}
        self.pass_ms = PassCost(self.COMPUTE_DECAY)  # by the rows of the pass, all sessions'
        self.verify_extra_ms = {p: Ema(self.COMPUTE_DECAY) for p in self.plans}  # X(b): per session, beyond a one-row pass
        self.in_flight = in_flight  # requests at this coordinator now, this controller's or not
        self.pass_share = Ema(self.WIRE_DECAY)  # sessions per verifier pass / requests in flight
        self.draft_wire_ms, self.verify_wire_ms = Ema(self.WIRE_DECAY), Ema(self.WIRE_DECAY)
        self.own_ms = {speculative: Ema(self.COMPUTE_DECAY) for speculative in (False, True)}  # per round
        self.last_round = {p: -1 for p in self.plans}
        self.round = 0
        self.revisit_due = 0.0  # the share of the way to the next revisit, summed over rounds
        self._accepted: dict[Plan, float] = {}  # expected_accepted, until the next speculative round
        self._rates: tuple[int, dict[Plan, float]] | None = None  # (round(sessions), each plan's tokens/s) at the last choice
        self._reports_since = 0  # reports observed since the rates were computed
        self._pending: deque[tuple[RoundReport, int]] = deque()  # (report, requests in flight then), not learned yet
        self._lock = threading.Lock()

    def expected_accepted(self, plan: Plan) -> float:
        """Acceptance estimates start optimistic, so that a plan is not written off on one
        unlucky round, but only as far as the measurements allow: the first chain depth
        starts at 'always accepted'; a deeper one at the rate the depth before it keeps, so the
        rarely reached depths of a long chain do not look perfect; a tree starts at twice what
        the best chain is expected to accept (at most a quarter of its nodes, at least 1)."""
        if plan not in self._accepted:
            self._accepted[plan] = self._expected_accepted(plan)
        return self._accepted[plan]

    def _expected_accepted(self, plan: Plan) -> float:
        if not plan.profiled:
            chains = [self.expected_accepted(p) for p in self.plans if p.profiled and p.budget]
            prior = max(1.0, min(plan.budget / 4, 2 * max(chains))) if chains else max(plan.budget / 4, 1.0)
            return self.tree_accepted[plan].value_with(prior, self.PRIOR_WEIGHT)
        total, reach, rate = 0.0, 1.0, 1.0
        for d in range(1, plan.budget + 1):
            rate = self.kept_at[d].value_with(rate, self.PRIOR_WEIGHT) if d in self.kept_at else rate
            reach *= rate
            total += reach
        return total

    def sessions(self) -> float:
        """Sessions per verifier pass, now."""
        return max(self.in_flight() * self.pass_share.get(1.0), 1.0)

    def expected_tokens_per_s(self, plan: Plan, sessions: float | None = None) -> float:
        sessions = sessions or self.sessions()
        if plan.budget == 0:
            step = self.pass_ms(round(sessions)) or 1.0
            return self.fused_block / (self.fused_block * step + self.verify_wire_ms.get(0.0) + self.own_ms[False].get(0.0)) * 1e3
        accepted = self.expected_accepted(plan)
        # X(b) >= 0: a plan's verify call holds a verifier-alone pass; a noisy negative estimate
        # would price a one-token chain under the verifier alone.
        verify = (self.pass_ms(round(sessions)) or 0.0) + sessions * max(self.verify_extra_ms[plan].get(0.0), 0.0)
        seconds_ms = (
            self.draft_ms[plan].get(0.0) + verify + self.draft_wire_ms.get(0.0) + self.verify_wire_ms.get(0.0) + self.own_ms[True].get(0.0)
        )
        return (accepted + 1) / max(seconds_ms, 1e-6) * 1e3

    def choose(self) -> Plan:
        if not self._lock.acquire(blocking=False):
            best = self._best_at(round(self.sessions()))
            if best is not None:
                return best
            self._lock.acquire()  # the load changed (a burst arriving): the last best is no guide
        try:
            self._learn_pending()
            self.round += 1
            stale = min(self.plans, key=lambda p: self.last_round[p])
            unmeasured = self.last_round[stale] < 0
            # N sessions make rounds N times as often, and a revisit under load slows them all:
            # revisits come N times fewer rounds apart; and up to N times fewer again (idle, up
            # to twice) for a plan that looks that many times slower than the best. Under load
            # drafting plans only confirm that the verifier alone wins; idle, a revisit costs a
            # round at the stale plan's pace and its switch (the features kept meanwhile fused,
            # the drafter catching up), and an unlucky early estimate is still corrected within
            # two intervals. Each round brings the next
            # revisit 1/interval nearer at the load of that round: the many rounds of a burst
            # do not make a revisit overdue the moment the load falls as it drains.
            sessions = self.sessions()
            rates = self._rates_at(sessions)
            best = max(self.plans, key=rates.__getitem__)
            interval = self.revisit_every * sessions
            if not unmeasured:
                interval *= min(rates[best] / max(rates[stale], 1e-9), max(sessions, self.IDLE_STRETCH))
            self.revisit_due += 1 / interval
            if unmeasured or self.revisit_due >= 1 - 1e-9:
                choice, self.revisit_due = stale, 0.0
            else:
                choice = best
            self.last_round[choice] = self.round
            return choice
        finally:
            self._lock.release()

    def _best_at(self, load: int) -> Plan | None:
        """The best plan by the rates last computed, if they were computed at this load."""
        rates = self._rates
        if rates is None or rates[0] != load:
            return None
        return max(self.plans, key=rates[1].__getitem__)

    def _rates_at(self, sessions: float) -> dict[Plan, float]:
        """Each plan's expected tokens/s. Computed again once the load changes or as many
        rounds were observed as sessions share a pass: N sessions report N rounds a pass, and
        computing the rates for each of them cost each round more than the rest of the
        controller (the model moves little within one pass)."""
        load = round(sessions)
        if self._rates is None or self._rates[0] != load or self._reports_since >= sessions:
            self._rates = load, {p: self.expected_tokens_per_s(p, sessions) for p in self.plans}
            self._reports_since = 0
        return self._rates[1]

    def observe(self, report: RoundReport) -> None:
        self._pending.append((report, self.in_flight()))
        if self._lock.acquire(blocking=False):
            try:
                self._learn_pending()
            finally:
                self._lock.release()

    def _learn_pending(self) -> None:
        while self._pending:
            self._learn(*self._pending.popleft())

    def _learn(self, report: RoundReport, in_flight: int) -> None:
        """A round that opened a session teaches acceptance only: reading a prompt costs a
        request's first round many times a step, and counted as one it priced a plan out
        (the verifier alone, always the first round of a feature head) for many rounds."""
        plan = report.plan
        self._reports_since += 1
        self.pass_share.add((report.batch_sessions or 1.0) / max(in_flight, 1))
        if not report.opened:
            self.verify_wire_ms.add(report.verify_wire_ms)
            if plan.budget == 0:
                self.pass_ms.add(report.pass_rows, report.verify_ms / report.passes)
            else:
                # X(b) is what the call costs beyond a verifier-alone pass: unknown until such a
                # pass was measured (taken from the whole call, a request's first rounds priced
                # their plans at twice their verify for the rest of a benchmark)
                sessions = report.batch_sessions or 1.0
                one_pass = self.pass_ms(round(sessions))
                if one_pass is not None:
                    self.verify_extra_ms[plan].add((report.verify_ms - one_pass) / sessions)
            if report.wall_ms:
                self.own_ms[plan.budget > 0].add(report.unaccounted_ms)
            if plan.budget:
                self.draft_wire_ms.add(report.draft_wire_ms)
                self.draft_ms[plan].add(report.draft_ms)
        if report.drafted_nothing is not None and not report.opened:  # a plan's draft costs what it costs, empty or not
            self.draft_wire_ms.add(report.draft_wire_ms)
            self.draft_ms[report.drafted_nothing].add(report.draft_ms)
        if plan.budget == 0:
            return
        self._accepted.clear()
        if plan.profiled:
            for d in range(1, min(report.depth, report.accepted + 1) + 1):  # the depths the round reached
                self.kept_at.setdefault(d, Ema(self.ACCEPTANCE_DECAY)).add(float(report.accepted >= d))
        else:
            self.tree_accepted[plan].add(report.accepted)


class AskCosts:
    """What asking the drafter costs, measured over all requests (thread-safe, one per
    coordinator): a round whose draft proposed nothing pays for the ask (the draft call, both
    hops, the coordinator's own work) beside the verifier's passes, and a token costs its pass
    when the verifier goes alone (`verify`'s one-token passes), its share of the round when
    speculating."""

    def __init__(self, verify: VerifyCosts, decay: float = BudgetController.COMPUTE_DECAY):
        self.verify = verify
        self.ask_ms, self.speculated_token_ms = Ema(decay), Ema(decay)
        self._lock = threading.Lock()

    def observe(self, report: RoundReport) -> None:
        if report.opened or not report.wall_ms:
            return
        with self._lock:
            if report.drafted_nothing is not None:
                self.ask_ms.add(report.wall_ms - report.verify_ms)
            elif report.plan.budget:
                self.speculated_token_ms.add(report.wall_ms / (report.accepted + 1))

    def now(self) -> tuple[float, float] | None:
        """(ask, gain): an ask's cost, and what a token speculated saves over one generated alone
        (0 where speculating costs more); None until both kinds of round were measured."""
        with self._lock:
            ask, speculated = self.ask_ms.value, self.speculated_token_ms.value
        alone = self.verify.one_token_ms()
        if ask is None or alone is None or speculated is None:
            return None
        return max(ask, 0.0), max(alone - speculated, 0.0)


class EmptyDraftBlocks:
    """One request's answer to a draft that proposed nothing (an n-gram drafter without a match):
    how many tokens the verifier generates alone before the drafter is asked again. Another token
    in the block saves an ask but is generated alone even where a copied run started at one of
    the positions before it, which a draft would have matched: worth it while the ask costs more
    than `hazard` x `gain` per position already in the block, so a block is 1 + ask / (hazard x
    gain) tokens, within [1, limit]. Costs are the coordinator's (AskCosts); the hazard, the
    chance that a position starts a run, is the request's: whether its text copies its context.
    Where speculating saves nothing a token (fresh text), the blocks are whole; where it saves
    much (a copied function on the CPU: ~37 ms of a 50 ms pass, an ask ~4 ms), one token."""

    DECAY = 0.8  # the request's text changes its mind (a copied function, then fresh text)
    PRIOR_ASKS = 2.0  # a prior of two asks after one token each, one of which found a draft

    def __init__(self, costs: AskCosts, limit: int):
        self.costs, self.limit = costs, limit
        self.asks, self.found, self.positions = 0.0, 0.0, 0.0  # decayed sums over the request's asks

    @property
    def hazard(self) -> float:
        """From the share of asks that found a draft after blocks of b tokens on average: a run
        starts at each position with chance h, so an ask finds one with chance 1 - (1 - h)^b."""
        asks = self.asks + self.PRIOR_ASKS
        found = (self.found + self.PRIOR_ASKS / 2) / asks
        block = (self.positions + self.PRIOR_ASKS) / asks
        return 1 - (1 - found) ** (1 / block)

    def asked(self, block: int, found: bool) -> None:
        """The drafter asked after `block` tokens generated alone; whether it found a draft."""
        self.asks = self.DECAY * self.asks + 1
        self.found = self.DECAY * self.found + found
        self.positions = self.DECAY * self.positions + block

    def length(self) -> int:
        costs = self.costs.now()
        if costs is None:
            return 1
        ask, gain = costs
        if gain <= 0:
            return self.limit
        return max(1, min(self.limit, 1 + int(ask / (self.hazard * gain))))


class VerifyCosts:
    """What a verify call costs by how many tokens it is fed, as measured (an EMA per size;
    a fused round counts as one-token calls), and the wire time per call. Thread-safe; one
    per coordinator."""

    def __init__(self, decay: float = BudgetController.COMPUTE_DECAY):
        self.decay = decay
        self.by_size: dict[int, Ema] = {}
        self.wire_ms = Ema(BudgetController.WIRE_DECAY)
        self._lock = threading.Lock()

    def observe(self, fed: int, compute_ms: float, wire_ms: float, generated: int = 1) -> None:
        """One verify call: `fed` tokens (1 for a fused round, which made `generated`)."""
        with self._lock:
            self.by_size.setdefault(fed, Ema(self.decay)).add(compute_ms / generated)
            self.wire_ms.add(wire_ms)

    def one_token_ms(self) -> float | None:
        """The compute of a pass that makes one token (the verifier alone's), None before one was measured."""
        with self._lock:
            one = self.by_size.get(1)
            return one.value if one is not None else None

    def round_ms(self, fed: int) -> float | None:
        """Compute plus wire for a call fed `fed` tokens: interpolated between the nearest
        sizes measured; past the largest, the largest's cost (optimistic, so that longer
        drafts get tried and measured); None before a one-token call has been measured."""
        with self._lock:
            sizes = sorted(self.by_size)
            if 1 not in self.by_size:
                return None
            below = max(s for s in sizes if s <= fed)
            above = min((s for s in sizes if s >= fed), default=below)
            low, high = self.by_size[below].value, self.by_size[above].value
            compute = low if above == below else low + (high - low) * (fed - below) / (above - below)
            return compute + self.wire_ms.get(0.0)


def goodput_cut(parent: list[int], confidence: list[float], round_ms) -> list[int]:
    """The draft nodes worth verifying: the n most confident, for the n that maximises the
    expected tokens per ms, (1 + their summed confidence) / round_ms(1 + n); n = 0 is the
    verifier's own token alone. A child counts as no more confident than its parent, so the
    kept nodes (ascending) form a tree."""
    capped: list[float] = []
    for node, up in enumerate(parent):
        capped.append(min(confidence[node], capped[up]) if 0 <= up < node else confidence[node])
    order = sorted(range(len(capped)), key=lambda node: (-capped[node], node))
    best_n, best_rate, expected = 0, 1.0 / round_ms(1), 1.0
    for n, node in enumerate(order, start=1):
        expected += capped[node]
        rate = expected / round_ms(1 + n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return sorted(order[:best_n])
