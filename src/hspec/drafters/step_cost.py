"""What a speculative step costs and what it is expected to emit, in units of one 1-token decode.

A step drafts m positions (once, whatever it verifies of them) and then verifies x0 and n <= m drafted tokens
in one target forward. On a CPU the verify grows with n, and faster with a longer context, because every extra query
row reads the sequence's keys (`results/tree_verify/`, `hspec bench decode`); the first drafted token costs
more than the later ones, because a forward of two rows leaves the one-row decode path (products tiled for
several rows, the attention's passes for each row):

    cost(n, m, S) = [m > 0] (draft + draft_per_position * m + draft_per_key * S)
                    + 1 + [n > 0] first_token + n * (per_token + per_token_key * S)
                                                    (m = 0: the drafter did not run; n = 0: a plain decode
                                                     plus the draft if it ran)

The draft grows with the context too where the drafter reads the target's keys (H-Spec's attention over
the pool, DFlash's context), and it includes what it costs the decode after it (the drafter's weights
push the target's out of the caches). It grows with the positions drafted where the drafter's work does (a
block drafter's rows through its products, its Markov head's loop): a row expected to verify two drafts
then need not pay for seven (`drafters/cost_aware.py`). Costs given without it (0) charge the block's whole
draft for any m.

The unit is a 1-token decode at the same context, so a step is worth taking when it emits more tokens per
cost than the 1 a plain decode emits. What a step emits on average follows from the probability that
each drafted token is accepted given that the ones before it were (`expected_emitted`).

The cost-aware draft length (`drafters/cost_aware.py`) and SpecBlock's cost-aware tree budget
(`drafters/specblock/tree_shape.py`, where n counts the tree's nodes) both read these numbers; measured
once per machine by `decoding.step_cost.measure_step_cost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StepCost:
    """A speculative step's cost in 1-token decodes (module docstring): [m > 0] (draft + draft_per_position m +
    draft_per_key keys) + 1 + [n > 0] first_token + n (per_token + per_token_key keys), m positions drafted and
    n tokens verified."""

    draft: float  # drafting (and building a tree), whatever is verified, at no context, less its positions' part
    per_token: float  # one more token in the verify, at no context
    per_token_key: float  # its growth with each key of context (the extra row's attention over the sequence)
    first_token: float = 0.0  # what a verify of any drafted token costs on top (leaving the one-row decode path)
    draft_per_key: float = 0.0  # the draft's growth with each key of context
    draft_per_position: float = 0.0  # the draft's growth with each position drafted

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if not value >= 0.0:  # also refuses NaN
                raise ValueError(f"StepCost.{name} must be a number >= 0 (in 1-token decodes), got {value!r}")

    def of(self, tokens: int, keys: int, positions: int) -> float:
        """Cost of a step verifying `tokens` drafted tokens at `keys` keys of context after drafting `positions`
        positions (0: the drafter did not run this step; else its cost is paid whatever is verified)."""
        first = self.first_token if tokens > 0 else 0.0
        draft = self.draft + self.draft_per_position * positions + self.draft_per_key * keys if positions else 0.0
        return draft + 1.0 + first + tokens * (self.per_token + self.per_token_key * keys)

    @classmethod
    def parse(cls, text: str, flag: str = "--step-cost") -> StepCost:
        """`DRAFT,PER_TOKEN,PER_TOKEN_KEY[,FIRST_TOKEN[,DRAFT_PER_KEY[,DRAFT_PER_POSITION]]]` (the form of `flag`,
        in 1-token decodes) -> StepCost."""
        parts = text.split(",")
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if not 3 <= len(values) <= len(FIELDS):
            raise ValueError(f"{flag} takes {FORM}, three to six numbers >= 0 in 1-token decodes (e.g. "
                             f"0.6,0.13,8e-5,0.08,1e-4,0.05), got {text!r}")
        return cls(*values)

    def to_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIELDS}


FIELDS = tuple(field.name for field in fields(StepCost))  # in order: `StepCost.parse`'s numbers
# `StepCost.parse`'s form, as flags name it
FORM = "DRAFT,PER_TOKEN,PER_TOKEN_KEY[,FIRST_TOKEN[,DRAFT_PER_KEY[,DRAFT_PER_POSITION]]]"


def expected_emitted(acceptance: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: tokens a step emits on average when its k-th drafted token is accepted
    with probability a_k given that tokens 1..k-1 were (the target's own token comes on top)."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= float(a)
        total += reach
    return total
