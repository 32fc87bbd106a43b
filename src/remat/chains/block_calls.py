"""Blocks a step's forward calls more than once (a loop over shared layers, ALBERT's one layer run at every
depth, a universal transformer): each call is planned on its own.

A call is named for its block and its number in the forward: the first call keeps the block's FQN, the k-th
(k >= 2) is ``<fqn>@<k>`` (:func:`call_name`, :func:`split_call`). The profiler gives every call its own row of
the cost table, in the order the step runs them (:class:`ProfiledCalls`), so the planners see a longer chain and
a plan may give each call its own action, segments and memory-poor groups across calls included. The runtime
counts each block's calls from the start of every forward of the model (:class:`CallCounter`) and runs call k
under the plan's entry for it (:class:`CallPositions`). A plan naming each block once (no ``@k``) runs every call
of a block under the block's action, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

SEPARATOR = "@"


def call_name(fqn: str, k: int) -> str:
    """The name of the ``k``-th call (from 1) of block ``fqn`` in a forward."""
    return fqn if k == 1 else f"{fqn}{SEPARATOR}{k}"


def split_call(name: str) -> tuple[str, int]:
    """``(fqn, k)`` of a call named by :func:`call_name`; a plain FQN is call 1."""
    fqn, sep, k = name.rpartition(SEPARATOR)
    if sep and k.isdigit() and int(k) >= 2:
        return fqn, int(k)
    return name, 1


def names_calls(names: Sequence[str]) -> bool:
    """Whether ``names`` (a plan's or a table's rows) name a later call of some block."""
    return any(split_call(n)[1] > 1 for n in names)


class ProfiledCalls:
    """The calls a profiled step's forward makes, per chain in the order it makes them: the table's rows."""

    def __init__(self, fqns: Sequence[str], chain_of: Sequence[int], chains: int) -> None:
        self.fqns = list(fqns)  # block index -> FQN
        self.chain_of = list(chain_of)  # block index -> chain index
        self.rows: list[list[int]] = [[] for _ in range(chains)]  # per chain: block index of each call in order
        self.counts = [0] * len(self.fqns)  # calls of each block so far

    def call(self, i: int) -> tuple[tuple[int, int], str]:
        """Block ``i`` is called (again) in the forward: the key of its row (chain, position in the chain) and the
        call's name."""
        self.counts[i] += 1
        chain = self.rows[self.chain_of[i]]
        chain.append(i)
        return (self.chain_of[i], len(chain) - 1), call_name(self.fqns[i], self.counts[i])

    def called(self, i: int) -> bool:
        return self.counts[i] > 0

    def looped(self, chain: int) -> bool:
        """Whether a block of ``chain`` has been called more than once so far."""
        return any(self.counts[i] > 1 for i in self.rows[chain])

    def keys(self) -> list[tuple[int, int]]:
        """Row keys chain after chain (in the order the chains were given), each chain's calls in call order."""
        return [(k, j) for k, chain in enumerate(self.rows) for j in range(len(chain))]

    def lengths(self) -> list[int]:
        return [len(chain) for chain in self.rows]

    def block_of(self, key: tuple[int, int]) -> int:
        return self.rows[key[0]][key[1]]

    def repeated(self) -> dict[str, int]:
        """Block FQN -> calls per forward, for blocks called more than once."""
        return {fqn: n for fqn, n in zip(self.fqns, self.counts, strict=True) if n > 1}

    def missing(self) -> list[str]:
        return [fqn for fqn, n in zip(self.fqns, self.counts, strict=True) if n == 0]


class CallCounter:
    """Calls of each block since the model's forward started (the runtime resets it there)."""

    def __init__(self, blocks: int) -> None:
        self.counts = [0] * blocks

    def reset(self) -> None:
        self.counts = [0] * len(self.counts)

    def enter(self, i: int) -> int:
        """Block ``i`` is called: its call number in this forward."""
        self.counts[i] += 1
        return self.counts[i]

    def current(self, i: int) -> int:
        """The number of block ``i``'s call now running (its forward hook runs after its pre-hook)."""
        return max(1, self.counts[i])


class CallPositions:
    """Where each call of a block sits in a plan's list of calls.

    ``names`` are the plan's entries in order: block FQNs, and ``<fqn>@<k>`` for later calls. Every block must
    be named, and a block named with later calls must have calls 2..n named without gaps. A block's call beyond
    those named wraps around (call n+1 runs as call 1): a forward the counter did not see start (the blocks
    called without the model) starts again at call 1."""

    def __init__(self, fqns: Sequence[str], names: Sequence[str]) -> None:
        index = {fqn: i for i, fqn in enumerate(fqns)}
        self._position: dict[tuple[int, int], int] = {}
        unknown = []
        for p, name in enumerate(names):
            fqn, k = split_call(name)
            if fqn not in index or (index[fqn], k) in self._position:
                unknown.append(name)
                continue
            self._position[(index[fqn], k)] = p
        if unknown:
            raise ValueError(
                f"plan names calls that are not blocks of the model's chain (or names one twice): {unknown}; the "
                f"chain is {list(fqns)} (a later call of a block is named '<fqn>@<k>', as in its cost table)"
            )
        self._calls = [sum(1 for (j, _) in self._position if j == i) for i in range(len(fqns))]
        for i, fqn in enumerate(fqns):
            if any((i, k) not in self._position for k in range(1, self._calls[i] + 1)):
                named = sorted(k for (j, k) in self._position if j == i)
                raise ValueError(
                    f"plan must give an action for every block, and for calls 2..n of a block called n times: block "
                    f"{fqn!r} has calls {named}; take the plan from a cost table of this model (remat.profile)"
                )

    def single_call_positions(self) -> list[int] | None:
        """The plan position of each block where the plan names one call of every block (every call of a block
        then runs under that entry: the runtime need not count calls); ``None`` otherwise."""
        if any(n != 1 for n in self._calls):
            return None
        return [self._position[(i, 1)] for i in range(len(self._calls))]

    def planned(self, actions: Sequence[str]) -> list[set[str]]:
        """Per block, the actions a plan whose ``actions`` these positions index gives its calls."""
        return [{actions[self._position[(i, k)]] for k in range(1, n + 1)} for i, n in enumerate(self._calls)]

    def position(self, i: int, k: int) -> int:
        """The plan position of block ``i``'s ``k``-th call."""
        return self._position[(i, (k - 1) % self._calls[i] + 1)]


def waiting_grad_bytes(row_blocks: Sequence[int], grad_bytes: Sequence[int]) -> list[int]:
    """Per row of a table whose rows are calls of blocks ``row_blocks`` (in step order), the parameter gradients
    of blocks called more than once that wait while the row runs backward: a block's gradient from its last call
    (``grad_bytes`` per block) is made during that row's backward and waits, through its first call's row, for
    the gradients of its other calls to be summed with it (``CostTable.call_grad_bytes``). The last call's row
    counts all of it, an upper bound: its backward makes them one parameter after another."""
    waiting = [0] * len(row_blocks)
    for b, nbytes in enumerate(grad_bytes):
        rows = [r for r, block in enumerate(row_blocks) if block == b]
        if len(rows) > 1:
            for r in range(rows[0], rows[-1] + 1):
                waiting[r] += nbytes
    return waiting
