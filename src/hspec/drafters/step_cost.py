"""What a speculative step costs and what it is expected to emit, in units of one 1-token decode.

A step drafts (once, whatever it verifies) and then verifies x0 and n drafted tokens in one target
forward. On a CPU the verify grows with n, and faster with a longer context, because every extra query
row reads the sequence's keys (`results/tree_verify/`, `hspec bench decode`); the first drafted token costs
more than the later ones, because a forward of two rows leaves the one-row decode path (products tiled for
several rows, the attention's passes for each row):

    cost(n, S) = draft + draft_per_key * S + 1 + [n > 0] first_token + n * (per_token + per_token_key * S)
                                                    (0 drafted tokens: a plain decode, plus the draft if it ran)

The draft grows with the context too where the drafter reads the target's keys (H-Spec's attention over
the pool, DFlash's context), and it includes what it costs the decode after it (the drafter's weights
push the target's out of the caches).

The unit is a 1-token decode at the same context, so a step is worth taking when it emits more tokens per
cost than the 1 a plain decode emits. What a step emits on average follows from the probability that
each drafted token is accepted given that the ones before it were (`expected_emitted`).

The cost-aware draft length (`drafters/cost_aware.py`) and SpecBlock's cost-aware tree budget
(`drafters/specblock/tree_shape.py`, where n counts the tree's nodes) both read these numbers; measured
once per machine by `decoding.step_cost.measure_step_cost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """A speculative step's cost in 1-token decodes:
    draft + draft_per_key * keys + 1 + [n > 0] first_token + n * (per_token + per_token_key * keys)."""

    draft: float  # drafting the block (and building its tree), whatever is verified of it, at no context
    per_token: float  # one more token in the verify, at no context
    per_token_key: float  # its growth with each key of context (the extra row's attention over the sequence)
    first_token: float = 0.0  # what a verify of any drafted token costs on top (leaving the one-row decode path)
    draft_per_key: float = 0.0  # the draft's growth with each key of context

    def __post_init__(self) -> None:
        for name in ("draft", "per_token", "per_token_key", "first_token", "draft_per_key"):
            value = getattr(self, name)
            if not value >= 0.0:  # also refuses NaN
                raise ValueError(f"StepCost.{name} must be a number >= 0 (in 1-token decodes), got {value!r}")

    def of(self, tokens: int, keys: int, drafted: bool = True) -> float:
        """Cost of a step verifying `tokens` drafted tokens at `keys` keys of context; `drafted`: the
        drafter ran this step (its cost is paid whatever is verified)."""
        first = self.first_token if tokens > 0 else 0.0
        draft = self.draft + self.draft_per_key * keys if drafted else 0.0
        return draft + 1.0 + first + tokens * (self.per_token + self.per_token_key * keys)

    @classmethod
    def parse(cls, text: str, flag: str = "--step-cost") -> StepCost:
        """`DRAFT,PER_TOKEN,PER_TOKEN_KEY[,FIRST_TOKEN[,DRAFT_PER_KEY]]` (the form of `flag`, in 1-token
        decodes) -> StepCost."""
        parts = text.split(",")
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if len(values) not in (3, 4, 5):
            raise ValueError(f"{flag} takes DRAFT,PER_TOKEN,PER_TOKEN_KEY[,FIRST_TOKEN[,DRAFT_PER_KEY]], three "
                             f"to five numbers >= 0 in 1-token decodes (e.g. 0.6,0.13,8e-5,0.08,1e-4), got {text!r}")
        return cls(*values)

    def to_dict(self) -> dict[str, float]:
        return {"draft": self.draft, "per_token": self.per_token, "per_token_key": self.per_token_key,
                "first_token": self.first_token, "draft_per_key": self.draft_per_key}


def expected_emitted(acceptance: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: tokens a step emits on average when its k-th drafted token is accepted
    with probability a_k given that tokens 1..k-1 were (the target's own token comes on top)."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= float(a)
        total += reach
    return total
