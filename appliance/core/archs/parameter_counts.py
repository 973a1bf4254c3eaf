"""Parameter counts and checkpoint bytes of a model as released, where its architecture describes its tensors
torch-free (Architecture.parameters): what mode=validate prints and the plan's tables show."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParameterCounts:
    total: int               # main model (embedding, layers, head), every expert
    active: int              # per token: everything but the routed experts, plus num_experts_per_tok of them
    mtp: int                 # the MTP layers on top (held, not served)
    replicated_bytes: int    # checkpoint bytes every data-parallel rank holds (all but the routed experts)
    expert_bytes: int        # checkpoint bytes of the routed experts, divided over expert-parallel ranks

    @property
    def total_bytes(self) -> int:
        return self.replicated_bytes + self.expert_bytes
