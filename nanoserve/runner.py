"""`ModelRunner`: turn the scheduler's batch into a plan, run the model on it, return logits.

Prefill and decode both run eagerly here (days 24-25). Day 52-55 add the decode variants
(bucketed, persistent inputs, captured) behind the same `execute` call, so the engine never
knows which one ran.
"""

from __future__ import annotations

import torch

from nanoserve.cache import BatchedPagedKVCache
from nanoserve.model import Llama
from nanoserve.plan import StepPlan, plan_decode, plan_prefill
from nanoserve.scheduler import Batch


class ModelRunner:
    def __init__(self, model: Llama, cache: BatchedPagedKVCache, block_size: int):
        self.model, self.cache, self.block_size = model, cache, block_size

    def plan(self, batch: Batch) -> StepPlan:
        device = self.model.device
        if batch.is_decode:
            return plan_decode(batch.decode, self.block_size, device)
        return plan_prefill(batch.chunks, self.block_size, device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits (B, vocab), fp32, one row per plan row (its last token)."""
        return self.model(plan.input_ids, plan.positions, self.cache.view(plan), logits_at=plan.logits_at)
