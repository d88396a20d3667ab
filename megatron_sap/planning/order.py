"""The order in which the outer ranks exchange K/V: one order of rank pairs for all.

A rank's exchanges run one after another on its link, and an exchange between r and p
starts only when both are done with their earlier ones. Any single order of the pairs
that every rank follows is free of deadlock (the first pair still pending is the next
step of both its ranks), but the order decides how long links sit idle waiting for a
partner. Exchange rounds (r and p meet in round (r + p) mod R) are such an order that
knows nothing of the sizes: a long exchange in an early round holds up both partners'
next ones, and theirs the next, and so on.

`exchange_order` builds the order by simulating the links: the rank whose link is free
soonest takes, among the peers it still has to meet, the one whose link is free soonest
(ties: the longer exchange, so that the kernels have the most to work on early; then
the lower rank). It reads only the tokens the ranks send each other (an exchange takes
its larger direction over its link). Every rank computes the same order from the same
plan and cost model (integer ties, the same floating-point operations in the same order).

`paced_exchange_order` builds another order from the kernels too, for the pipelined
forward under one hardware queue (`timeline`): a rank's next exchange leaves its queue
only once the kernels queued before it are done (the local calls and every step but the
one in flight), and its next step's calls start only once that exchange has left. The pair
whose exchange can start soonest goes next (ties: the longer exchange, then the lower
ranks), so ranks that reach their next exchange at about the same time meet, and a rank
does not sit waiting for a busy peer while another is ready. `matching_order` is a third,
blind to the sizes: round-robin rounds, each a perfect matching of the ranks, so that where
every pair exchanges and computes alike (the zigzag layout, a KV ring's) every rank meets
one peer a round in lockstep, as the ring's steps go, where the simulated orders can pair a
rank with a peer still busy with another. Which order runs is chosen on the compiled
programs timed together (all three, up to 16 outer ranks), or beyond by the step-level
models (`layer_timing`; the link and paced orders, the paced one beyond ALWAYS_PACED_PAIRS
pairs only where the ranks wait in the link order, and the matching order where every pair
of ranks exchanges: elsewhere it all but never wins and costs milliseconds to weigh)
(`Plan.exchange_order`).

Backward the same pairs exchange again, the gradients of the rows each step received
going back, but a step's return can start only once both its ranks have computed their
step for each other, and each rank computes its steps in its own order. The forward's
order, built for links that are all free at the start, can make a rank whose first
steps are heavy hold up peers that have little to compute before them, and them the
next. `backward_order` runs the backward in the forward's order or in its reverse,
whichever ends the slowest rank's layer sooner on the step-level models (its forward,
`paced_forward`, then its backward, `backward_ends`).

At odd outer sizes the ranks may exchange as ring shifts instead of pairwise
(`program.ring_exchanges`: R - 1 steps, each rank sending to one peer and receiving from
another); `ring_layer_seconds` times that layer under the same rules.

The step-level models read what the compiled pipelined programs run (each step's calls
tile-rounded segment by segment, `evaluate.step_pairs`, and each rank's total,
`Evaluation.pipelined_pairs`), and time a rank's layer as `timeline.joint_schedule` does,
its forward and backward together: fed so, they give what that timeline gives the
pipelined programs in the same order, the all-to-alls left out.
"""
from __future__ import annotations

import heapq
from typing import Callable, Mapping, Sequence

import numpy as np

from .cost_model import LINK_INTER, LINK_INTRA, CostModel
from .program import exchange_round

# Every pair of up to 128 outer ranks (P = 1,024 at 8 inner ranks); beyond, round order:
# the simulation's cost grows with pairs x peers (10-70 ms at 2,400-8,128 pairs, docs/planner.md).
MAX_ORDERED_PAIRS = 8192
# Up to this many exchanging pairs the paced order is always weighed beside the link order
# (`Plan.exchange_order`); beyond, up to MAX_PACED_PAIRS, only where the step-level model of
# the link order sees the ranks wait for each other (docs/planner.md, "The order of the
# exchanges"): building and weighing it takes 20-50 ms at 1,000-2,016 pairs, 150 ms at 8,128.
ALWAYS_PACED_PAIRS = 1024
# As far as the link order is simulated (every pair of up to 128 outer ranks); beyond,
# the 32,640 pairs of 256 outer ranks would take about 1.2 s a plan.
MAX_PACED_PAIRS = MAX_ORDERED_PAIRS


def directed_seconds(traffic_tokens: np.ndarray, model: CostModel, inner_size: int) -> np.ndarray:
    """The seconds of every outer rank s's K/V message to d, `[s, d]` (0 where it sends d
    nothing): its tokens over their link, one message's latency (`CostModel.transfer_seconds`)."""
    R = len(traffic_tokens)
    node = model.node_of(np.arange(R) * inner_size)  # as `CostModel.link_between` compares them
    rate = np.where(node[:, None] == node[None, :], model.bandwidth(LINK_INTRA), model.bandwidth(LINK_INTER))
    seconds = model.message_latency_us * 1e-6 + traffic_tokens * model.inner_kv_bytes_per_token(inner_size) / rate
    return np.where(traffic_tokens > 0, seconds, 0.0)


def exchange_seconds(traffic_tokens: np.ndarray, model: CostModel, inner_size: int,
                     directed: np.ndarray | None = None) -> dict[tuple[int, int], float]:
    """The seconds of every exchanging pair's exchange `(a, b)`, a < b (in row-major order):
    its larger direction (`directed_seconds`, given or worked out)."""
    directed = directed_seconds(traffic_tokens, model, inner_size) if directed is None else directed
    first, second = np.nonzero(np.triu(traffic_tokens + traffic_tokens.T, 1))
    seconds = np.maximum(directed[first, second], directed[second, first]).tolist()
    return dict(zip(zip(first.tolist(), second.tolist()), seconds))


def exchange_order(traffic_tokens: np.ndarray, model: CostModel, inner_size: int) -> dict[tuple[int, int], int]:
    """The position of every exchanging pair of outer ranks `(a, b)`, a < b, in the order
    all ranks run their exchanges in (see the module docstring; round order beyond
    MAX_ORDERED_PAIRS pairs); `traffic_tokens[s, d]` is the forward K/V tokens outer rank
    s sends d."""
    return link_order(exchange_seconds(traffic_tokens, model, inner_size), len(traffic_tokens))


def link_order(exchange_s: Mapping[tuple[int, int], float], num_ranks: int) -> dict[tuple[int, int], int]:
    """`exchange_order` of the exchanges' seconds (`exchange_seconds`) among `num_ranks` outer ranks."""
    pairs = list(exchange_s)
    if len(pairs) > MAX_ORDERED_PAIRS:
        # Rounds, each a matching of the ranks: cheap, but blind to the sizes.
        pairs.sort(key=lambda pair: (exchange_round(*pair, num_ranks), pair))
        return {pair: i for i, pair in enumerate(pairs)}
    seconds = list(exchange_s.values())
    # Each rank's peers, the longest exchange first, then the lower rank.
    ends = [(r, -s, q) for (x, y), s in zip(pairs, seconds) for r, q in ((x, y), (y, x))]
    ends.sort()
    peers: list[list[int]] = [[] for _ in range(num_ranks)]
    for r, _, q in ends:
        peers[r].append(q)
    free = [0.0] * num_ranks  # when each rank's link is done with its exchanges so far
    heap = [(0.0, r) for r in range(num_ranks) if peers[r]]
    order: dict[tuple[int, int], int] = {}
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        at, r = pop(heap)
        mine = peers[r]
        if at != free[r] or not mine:
            continue  # a stale entry
        p, soonest = -1, float("inf")
        for q in mine:  # the first peer already free starts now; else the one free soonest
            if free[q] < soonest:
                p, soonest = q, free[q]
                if soonest <= at:
                    break
        pair = (r, p) if r < p else (p, r)
        order[pair] = len(order)
        free[r] = free[p] = done = max(at, soonest) + exchange_s[pair]
        theirs = peers[p]
        mine.remove(p)
        theirs.remove(r)
        if mine:
            push(heap, (done, r))
        if theirs:
            push(heap, (done, p))
    return order


def matching_round(a: int, b: int, num_ranks: int) -> int:
    """The round in which outer ranks a < b meet in a round-robin of `num_ranks` ranks (the
    circle method): every round a perfect matching (one rank idle where R is odd), every
    pair once in R - 1 rounds (R where R is odd). Rank n - 1 of n = R rounded up to even
    meets rank r in round r; two others, a and b, in the round k with 2k = a + b mod n - 1."""
    n = num_ranks + num_ranks % 2
    if b == n - 1:
        return a
    return (a + b) * (n // 2) % (n - 1)


def matching_order(exchange_s: Mapping[tuple[int, int], float], num_ranks: int) -> dict[tuple[int, int], int]:
    """The position of every pair of `exchange_s` in round-robin rounds (`matching_round`;
    within a round, by pair). Blind to the sizes like the rounds of `exchange_round`, but
    each round a perfect matching: where every pair exchanges alike and computes alike (a
    zigzag layout's, as a KV ring's steps), every rank meets one peer a round, in lockstep,
    and no rank waits for a partner still busy with another."""
    pairs = sorted(exchange_s, key=lambda pair: (matching_round(*pair, num_ranks), pair))
    return {pair: i for i, pair in enumerate(pairs)}


def paced_exchange_order(exchange_s: Mapping[tuple[int, int], float], step_s: Sequence[Sequence[float]],
                         local_s: Sequence[float]) -> dict[tuple[int, int], int]:
    """The position of every pair of `exchange_s` (pair -> its exchange's seconds) in an order
    paced by the kernels (module docstring): `step_s[a][b]`, the forward seconds of a's
    calls on what b sends it, `local_s[a]` those of its local calls. Simulates the pipelined
    forward (`paced_forward`); the pair that can start soonest goes next."""
    return paced_forward(exchange_s, step_s, local_s)[0]


def paced_forward(exchange_s: Mapping[tuple[int, int], float], step_s: Sequence[Sequence[float]],
                  local_s: Sequence[float], order: Mapping[tuple[int, int], int] | None = None,
                  ) -> tuple[dict[tuple[int, int], int], list[float]]:
    """The pipelined forward, posting one exchange ahead (`program.FETCH_AHEAD`), with one
    hardware queue, as `timeline.joint_schedule` runs it: (the order of the pairs, when each rank is done). A
    rank posts exchange k + 1 after step k - 1's calls; it leaves the rank's queue once the
    rank's link is free and the kernels queued before it are done, and starts once it has
    left both ranks' queues. The local calls run once the rank's first exchange has left
    its queue, step k's calls once exchange k is done and exchange k + 1 has left. With
    `order`, the pairs go in that order; else the pair that can start soonest goes next
    (ties: the longer exchange, then the lower ranks)."""
    R = len(local_s)
    link = [0.0] * R  # when the rank's last exchange ends
    computed = [0.0] * R  # when its kernels queued so far are done
    free = [0.0] * R  # when its next exchange leaves its queue: max(link, computed)
    previous: list[int | None] = [None] * R  # its last exchange's peer, whose step runs next
    chosen: dict[tuple[int, int], int] = {}

    def take(a: int, b: int, start: float, seconds: float) -> None:
        chosen[a, b] = len(chosen)
        for r, peer in ((a, b), (b, a)):
            last = previous[r]  # the exchange leaves r's queue: its next calls may start
            computed[r] = free[r] + (local_s[r] if last is None else step_s[r][last])
            previous[r] = peer
        link[a] = link[b] = start + seconds
        free[a], free[b] = max(link[a], computed[a]), max(link[b], computed[b])

    if order is not None:
        for a, b in sorted(order, key=order.__getitem__):
            take(a, b, max(free[a], free[b]), exchange_s[a, b])
    else:
        _take_soonest(exchange_s, free, take)
    done = [local_s[r] if last is None else max(computed[r], link[r]) + step_s[r][last]
            for r, last in enumerate(previous)]
    return chosen, done


def _take_soonest(exchange_s: Mapping[tuple[int, int], float], free: list[float],
                  take: Callable[[int, int, float, float], None]) -> None:
    """Call `take(a, b, start, seconds)` for every pair of `exchange_s`, the one that can start
    soonest first (`start`: the later of `free[a]` and `free[b]`; ties: the longer exchange,
    then the lower ranks); `take` moves its two ranks' `free` later, never earlier.

    A pair waits for the later of its ranks, so the soonest pair is, over the ranks x, the
    soonest `free[x]` with x's first peer already free by then, in one fixed order of x's
    peers (the longest exchange first, then the lower rank: the ties' order). A take changes
    that for its two ranks (their peers are left to search again from the first) and for
    the ranks whose first free peer was one of them and is now busy, which search on from
    it: the peers before it in their order were busy and, as `free` only grows, still are.
    Each rank's choice waits in a heap until it is the soonest or out of date; the order is
    the one a heap of every pair, re-keyed as the ranks' times grow, gives, without re-keying
    them all (that costs pairs x ranks: 5.4 s at 32,640 pairs, this 0.8 s)."""
    R = len(free)
    by_length: list[list[tuple[float, int]]] = [[] for _ in range(R)]
    for (a, b), s in exchange_s.items():
        by_length[a].append((-s, b))
        by_length[b].append((-s, a))
    for mine in by_length:
        mine.sort()
    peers = [[q for _, q in mine] for mine in by_length]
    minus_s = [[m for m, _ in mine] for mine in by_length]  # -seconds of each peer's exchange
    found = [0] * R  # the position in peers[x] of x's first peer free by free[x] (len(peers[x]): none)
    chosen = [-1] * R  # that peer (-1: none)
    waiting: list[set[int]] = [set() for _ in range(R)]  # the ranks whose chosen peer this rank is
    version = [0] * R
    heap: list[tuple[float, float, int, int, int, int]] = []

    def search(x: int, i: int) -> None:
        mine, at = peers[x], free[x]
        while i < len(mine) and free[mine[i]] > at:
            i += 1
        if chosen[x] >= 0:
            waiting[chosen[x]].discard(x)
        found[x] = i
        version[x] += 1
        if i < len(mine):
            q = chosen[x] = mine[i]
            waiting[q].add(x)
            heapq.heappush(heap, (at, minus_s[x][i], min(x, q), max(x, q), x, version[x]))
        else:
            chosen[x] = -1

    for x in range(R):
        search(x, 0)
    while heap:
        start, minus_seconds, a, b, x, seen = heapq.heappop(heap)
        if seen != version[x]:
            continue  # x has chosen again since
        take(a, b, start, -minus_seconds)
        for r, q in ((a, b), (b, a)):
            i = peers[r].index(q)
            del peers[r][i], minus_s[r][i]
        moved = waiting[a] | waiting[b]
        search(a, 0)
        search(b, 0)
        for x in moved:
            if x != a and x != b and free[chosen[x]] > free[x]:  # its peer is busy now
                search(x, found[x])


def layer_timing(order: Mapping[tuple[int, int], int], exchange_s: Mapping[tuple[int, int], float],
                 step_s: Sequence[Sequence[float]], local_s: Sequence[float],
                 backward_step_s: Sequence[Sequence[float]],
                 backward_total_s: Sequence[float]) -> tuple[float, dict[tuple[int, int], int]]:
    """The pipelined layer with its exchanges in `order` under the step-level models: the
    slowest rank's forward (`paced_forward`; `step_s`, `local_s` its kernel seconds) and
    backward (`backward_ends`; `backward_step_s`, `backward_total_s`) together, as
    `timeline.joint_schedule` times a rank's layer, with the backward in the order
    `backward_order` takes, `order` or its reverse: (its seconds, that order). What the plan
    weighs the orders by where compiling every rank's programs to time them together would
    cost too much."""
    return backward_order(order, exchange_s, backward_step_s, backward_total_s,
                          paced_forward(exchange_s, step_s, local_s, order)[1])


def _slowest(forward_s: Sequence[float], backward_s: Sequence[float]) -> float:
    """The slowest rank's forward and backward together."""
    return max((f + b for f, b in zip(forward_s, backward_s)), default=0.0)


def _reversed(order: Mapping[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """`order` run backwards."""
    last = len(order) - 1
    return {pair: last - i for pair, i in order.items()}


def backward_order(order: Mapping[tuple[int, int], int], exchange_s: Mapping[tuple[int, int], float],
                   step_s: Sequence[Sequence[float]], total_s: Sequence[float],
                   forward_s: Sequence[float] | None = None) -> tuple[float, dict[tuple[int, int], int]]:
    """The order the backward runs its exchanges in, the position of every pair of `order`:
    `order` itself, or its reverse where the slowest rank's layer ends sooner with it
    (`forward_s`, each rank's forward seconds, default 0, plus its `backward_ends`;
    `step_s[a][b]`: the seconds of a's step with b; ties: `order`), with that layer's
    seconds: (seconds, order). Every rank chooses alike from the same plan."""
    reverse = _reversed(order)
    forward_s = [0.0] * len(total_s) if forward_s is None else forward_s
    ahead = _slowest(forward_s, backward_ends(order, exchange_s, step_s, total_s))
    behind = _slowest(forward_s, backward_ends(reverse, exchange_s, step_s, total_s))
    return (behind, reverse) if behind < ahead else (ahead, dict(order))


def backward_ends(order: Mapping[tuple[int, int], int], exchange_s: Mapping[tuple[int, int], float],
                  step_s: Sequence[Sequence[float]], total_s: Sequence[float]) -> list[float]:
    """When each outer rank is done with a backward pass whose exchanges run in `order`,
    step by step: each rank computes its steps in that order (`step_s[a][b]`: the seconds of
    a's step with b), posting each step's return once computed; a return leaves a rank's
    queue once its link is free and the step is computed, and no later kernel of the rank
    starts before that (one hardware queue); it starts when both ranks' returns have left and takes
    `exchange_s`; the local calls (the rest of `total_s`, a rank's kernel seconds) follow the
    last return; a rank is done when its link and its kernels are. Every rank in the
    pipelined schedule, as `timeline.joint_schedule` times the compiled programs."""
    computed = [0.0] * len(total_s)
    link = [0.0] * len(total_s)
    posted = [0.0] * len(total_s)  # when the rank's last return left its queue
    local = list(total_s)
    for a, b in sorted(order, key=order.__getitem__):
        for r, peer in ((a, b), (b, a)):
            computed[r] = max(computed[r], posted[r]) + step_s[r][peer]
            local[r] -= step_s[r][peer]
            posted[r] = max(link[r], computed[r])
        link[a] = link[b] = max(posted[a], posted[b]) + exchange_s[a, b]
    return [max(max(c, p) + rest, x) for c, p, rest, x in zip(computed, posted, local, link)]


def ring_layer_seconds(directed_s: Sequence[Sequence[float]], step_s: Sequence[Sequence[float]],
                       local_s: Sequence[float], backward_step_s: Sequence[Sequence[float]],
                       backward_total_s: Sequence[float]) -> float:
    """`layer_timing`'s seconds with the exchanges as ring shifts (`program.ring_exchanges`): in
    step d (1 to R - 1) rank r sends r + d its message (`directed_s[r][r + d]`, 0: none)
    and receives r - d's, skipping steps with neither; each message starts once both its
    ranks have posted the step, the step is done with the later one, and backward the
    gradients go the other way in the same steps. Otherwise as `paced_forward` and
    `backward_ends` time pairwise exchanges."""
    R = len(local_s)
    shifts = [[d for d in range(1, R) if directed_s[r][(r + d) % R] or directed_s[(r - d) % R][r]] for r in range(R)]
    return _slowest(_ring_forward(directed_s, step_s, local_s, shifts),
                    _ring_backward(directed_s, backward_step_s, backward_total_s, shifts))


def _ring_step_ends(message_s: Sequence[Sequence[float]], posted: Sequence[float], ranks: Sequence[int],
                    d: int) -> list[float]:
    """When step d of each of `ranks` is done: its message to r + d and the one from r - d
    (`message_s[s][t]`: the seconds of s's message to t) each start once both ranks have
    posted the step (`posted`), the later ends it."""
    R = len(posted)
    ends = []
    for r in ranks:
        to, source = (r + d) % R, (r - d) % R
        out, into = message_s[r][to], message_s[source][r]
        ends.append(max(max(posted[r], posted[to]) + out if out else 0.0,
                        max(posted[r], posted[source]) + into if into else 0.0))
    return ends


def _ring_forward(directed_s: Sequence[Sequence[float]], step_s: Sequence[Sequence[float]],
                  local_s: Sequence[float], shifts: Sequence[Sequence[int]]) -> list[float]:
    """When each rank is done with the pipelined forward with ring shifts, by
    `paced_forward`'s rules: a rank posts step k + 1 once its link and step k - 1's calls
    are done; the calls queued after it (the local ones after the first step, step k's
    after step k + 1) start then."""
    R = len(local_s)
    link = [0.0] * R
    computed = [0.0] * R  # when the calls queued so far are done
    posted = [0.0] * R  # when the rank's last step left its queue
    last = [-1] * R  # the rank whose K/V its last step brought (-1: none yet)
    for d in range(1, R):
        ranks = [r for r in range(R) if d in shifts[r]]
        for r in ranks:
            posted[r] = max(link[r], computed[r])
            computed[r] = posted[r] + (local_s[r] if last[r] < 0 else step_s[r][last[r]])
            last[r] = (r - d) % R
        for r, end in zip(ranks, _ring_step_ends(directed_s, posted, ranks, d)):
            link[r] = end
    return [local_s[r] if last[r] < 0 else max(computed[r], link[r]) + step_s[r][last[r]] for r in range(R)]


def _ring_backward(directed_s: Sequence[Sequence[float]], step_s: Sequence[Sequence[float]],
                   total_s: Sequence[float], shifts: Sequence[Sequence[int]]) -> list[float]:
    """`backward_ends` with ring shifts: each rank computes step d on what r - d sent it
    and posts the return, which goes back to r - d while r + d's comes in."""
    R = len(total_s)
    returns_s = list(zip(*directed_s))  # r's return to q: what q sent r
    computed, link, posted, rest = [0.0] * R, [0.0] * R, [0.0] * R, list(total_s)
    for d in range(1, R):
        ranks = [r for r in range(R) if d in shifts[r]]
        for r in ranks:
            seconds = step_s[r][(r - d) % R]
            computed[r] = max(computed[r], posted[r]) + seconds
            rest[r] -= seconds
            posted[r] = max(link[r], computed[r])
        for r, end in zip(ranks, _ring_step_ends(returns_s, posted, ranks, -d)):
            link[r] = end
    return [max(max(c, p) + left, x) for c, p, left, x in zip(computed, posted, rest, link)]
