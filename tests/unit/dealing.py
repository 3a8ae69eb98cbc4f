"""The dealer as the dealing tests read it: each call returns the tiles it deals."""

from __future__ import annotations

from cleave.gemm.dealer import Dealer, Policy, Send


class Dealing(Dealer):
    """The dealer, its calls returning the tiles they deal (`Send`s) as these tests read them; every other
    instruction is kept in `notes`, in order."""

    def __init__(self, policy: Policy | None = None) -> None:
        super().__init__(policy)
        self.notes: list = []

    def _out(self, sends):
        out = super()._out(sends)
        self.notes += [i for i in out if not isinstance(i, Send)]
        return [i for i in out if isinstance(i, Send)]

    def told(self, kind: type) -> list:
        """The instructions of `kind` since last asked."""
        mine = [n for n in self.notes if isinstance(n, kind)]
        self.notes = [n for n in self.notes if not isinstance(n, kind)]
        return mine
