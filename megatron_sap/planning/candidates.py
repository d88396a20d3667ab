"""Every candidate placement the planner weighs, as builds (see `placement.Build`)."""
from __future__ import annotations

from .cost_model import CostModel
from .greedy import SPREAD_NODE, SPREAD_WIDE, GreedyPasses, greedy_name
from .layouts import (BALANCED, DEALT, REFINE_MAX_DOCS, REFINED, ContiguousBuild, WholeBuild, ZigzagBuild,
                      balanced_order, dealt_order, refined_order)
from .placement import Build
from .tally import Tally

# From this many outer ranks the greedy passes are weighed with `fill` too: rooms are small
# there, and the last documents' cuts by load scatter over many ranks (docs/planner.md).
# Under it only the projected passes fill.
FILL_MIN_RANKS = 32


def candidates(
    doc_starts: list[int],
    lengths: list[int],
    num_ranks: int,
    capacity: int,
    model: CostModel,
    slacks: tuple[float, ...],
    inner_size: int = 1,
) -> list[Build]:
    """Every placement the planner weighs, as builds (see `Build`), in this order:
    sequence-aware ones from the tightest slack (the most balanced) up, the split mode
    that moves fewer bytes first (over FILL_MIN_RANKS outer ranks or more, zigzag splits
    only); then one that spreads each document heavier than a
    rank's share over as many ranks as it can (balance when one document dominates the
    work, worth its traffic where links are fast); then the zigzag, contiguous and
    whole layouts, and the contiguous layouts of the documents in `balanced_order`, in
    `dealt_order` and, on rows of at most REFINE_MAX_DOCS documents, in `refined_order`
    (where every document fits on one rank); then, over FILL_MIN_RANKS
    outer ranks or more, the zigzag greedy passes again with `fill` (the row's last
    documents cut through the rooms left in a chain, once each); then, where nodes hold
    several outer ranks each and there is more than one node, the zigzag greedy passes
    again with `node spread` (a document heavier than a rank's share, whose fewest
    balancing ranks would cross nodes, spread over one node instead), over FILL_MIN_RANKS
    outer ranks or more with `fill` only. Over FILL_MIN_RANKS outer ranks or more where
    every document fits on one rank, every greedy pass but the spread one runs with `fill`
    only. Under FILL_MIN_RANKS outer ranks, last, the zigzag greedy passes again with `fill`,
    weighing the ranks by their projected loads (`GreedyPasses.density`: a rank's tiles plus its room
    at the work per token of the documents left). The greedy passes start as one build."""
    passes = GreedyPasses(doc_starts, lengths, num_ranks, capacity, model, inner_size)
    # The passes without `fill`: all of them but over FILL_MIN_RANKS outer ranks or more
    # where every document fits on one rank (there they differ from their fill ones only in
    # how the documents no rank has room for whole are cut). Over FILL_MIN_RANKS outer ranks
    # or more, with zigzag splits only: the contiguous ones cost a tenth to a fifth of the
    # planning time there, and the plans chosen without them run as fast all ranks together
    # on average (docs/planner.md, "Candidates").
    plain = num_ranks < FILL_MIN_RANKS or max(lengths, default=0) > capacity
    splits = ("contiguous", "zigzag") if num_ranks < FILL_MIN_RANKS else ("zigzag",)
    members = [
        (greedy_name(s, split), 2 * i + j, s, split, None, False)
        for i, s in enumerate(slacks)
        for j, split in enumerate(("contiguous", "zigzag")) if split in splits
    ] if plain else []
    if num_ranks >= FILL_MIN_RANKS:
        members += [(greedy_name(s, "zigzag", fill=True), 2 * len(slacks) + 6 + i, s, "zigzag", None, True)
                    for i, s in enumerate(slacks)]
    else:
        # Last of all, the zigzag passes with `fill` weighing the ranks by their projected
        # loads (over FILL_MIN_RANKS outer ranks or more they were all but never chosen, at
        # a quarter more planning time).
        members += [(greedy_name(s, "zigzag", fill=True, projected=True), 5 * len(slacks) + 7 + i, s, "zigzag", None, True,
                     True) for i, s in enumerate(slacks)]
    builds: list[Build] = []
    if num_ranks > 1:
        spread_slack = min(slacks, default=0.0)
        members.append((greedy_name(spread_slack, "zigzag", SPREAD_WIDE), 2 * len(slacks), spread_slack, "zigzag",
                        SPREAD_WIDE, False))
        if passes.node_aware:
            # After every other candidate: the node spread passes, from FILL_MIN_RANKS outer
            # ranks with fill only (without, they were all but never faster there).
            fill = num_ranks >= FILL_MIN_RANKS
            members += [(greedy_name(s, "zigzag", SPREAD_NODE, fill), (3 + fill) * len(slacks) + 7 + i, s, "zigzag",
                         SPREAD_NODE, fill)
                        for i, s in enumerate(slacks)]
        builds.append(ZigzagBuild(2 * len(slacks) + 1, doc_starts, lengths, passes.cost, capacity,
                                   Tally(num_ranks, inner_size, model)))
        builds.append(ContiguousBuild(2 * len(slacks) + 2, doc_starts, lengths, passes.cost, capacity,
                                       Tally(num_ranks, inner_size, model)))
        if max(lengths, default=0) <= capacity:  # else no packing keeps every document whole
            builds.append(WholeBuild(2 * len(slacks) + 3, doc_starts, lengths, passes.cost, capacity,
                                      Tally(num_ranks, inner_size, model)))
            balanced = balanced_order(passes.order, lengths, passes.cost, num_ranks, capacity)
            builds.append(ContiguousBuild(2 * len(slacks) + 4, doc_starts, lengths, passes.cost, capacity,
                                           Tally(num_ranks, inner_size, model), balanced, BALANCED))
            builds.append(ContiguousBuild(2 * len(slacks) + 5, doc_starts, lengths, passes.cost, capacity,
                                           Tally(num_ranks, inner_size, model), dealt_order(passes.order, num_ranks),
                                           DEALT))
            refined = (refined_order(balanced, lengths, num_ranks, capacity, model.tile)
                       if len(passes.order) <= REFINE_MAX_DOCS else None)  # the non-empty documents
            if refined is not None:
                builds.append(ContiguousBuild(3 * len(slacks) + 6, doc_starts, lengths, passes.cost, capacity,
                                               Tally(num_ranks, inner_size, model), refined, REFINED))
    return [passes.build(members)] + builds if members else builds
