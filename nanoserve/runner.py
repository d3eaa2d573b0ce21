"""`ModelRunner`: turn the scheduler's batch into a plan, run the model on it, return logits.

Prefill and decode both run eagerly here (days 24-25). Day 52-55 add the decode variants
(bucketed, persistent inputs, captured) behind the same `execute` call, so the engine never
knows which one ran. A mixed step (the budget policy: decode rows and prompt chunks together)
is planned as prefill with the decode rows first as one-token chunks, and runs eagerly; only
pure decode steps take the bucketed and captured paths (as vLLM's piecewise mode runs mixed
batches outside its full graphs).

Graph memory is bounded. Without a warm list (`lazy`, day 54) an unseen decode shape is recorded
on first use while the recorded graphs hold less than `graph_budget` bytes; past that, a new
shape runs eagerly through the same buckets and buffers. Once a warm list is recorded (day 56,
`Engine.warm_decode` turns `lazy` off) nothing more is recorded: a shape outside the list runs
eagerly, as vLLM runs batch sizes past its capture list, so what graphs hold is exactly what the
boot line reported. `graph_bytes` is that memory (CPU: the graphs' output buffers; CUDA: growth
of the shared pool while recording) and `eager_steps` counts the decode steps that ran unrecorded.
"""

from __future__ import annotations

import torch

from nanoserve.cache import BatchedPagedKVCache
from nanoserve.capture import CudaGraph, HostGraph
from nanoserve.models import Llama
from nanoserve.plan import StepPlan, plan_decode, plan_decode_bucketed, plan_prefill, plan_verify
from nanoserve.scheduler import Batch, Sequence


class ModelRunner:
    """`slot_table` and `buckets` switch decode to the bucketed path; `inputs` (persistent
    buffers) to writing its addressing in place; `capture` to replaying one recorded graph per
    decode shape (`HostGraph` here; day 54)."""

    def __init__(
        self,
        model: Llama,
        cache: BatchedPagedKVCache,
        block_size: int,
        slot_table=None,
        buckets=None,
        inputs=None,
        capture: bool = False,
        graph_budget: int = 512 * 2**20,
        fused: bool = False,
    ):
        self.model, self.cache, self.block_size = model, cache, block_size
        self.fused = fused  # decode steps as one native call (Llama.fused_decode, phase 6)
        self.slot_table, self.buckets, self.inputs = slot_table, buckets, inputs
        self.capture = capture
        self.graphs: dict[tuple[int, int], HostGraph | CudaGraph] = {}  # (rows, width) -> graph
        self.cold_captures = 0  # graphs recorded in front of a running request
        self.graph_pool = None  # CUDA: the memory pool every capture shares
        self.lazy = True  # record an unseen shape on first use; off once a warm list is recorded
        self.graph_budget = graph_budget  # bytes lazy recording may hold in graphs
        self.graph_bytes = 0  # bytes the recorded graphs hold
        self.eager_steps = 0  # captured-mode decode steps that ran without a graph
        self.window_blocks = None  # blocks.WindowBlocks, for a model whose sliding layers have their own

    def plan(self, batch: Batch) -> StepPlan:
        device = self.model.device
        if self.window_blocks is not None:  # the sliding layers' blocks for this step's rows
            self.window_blocks.prepare(batch.as_chunks())
        if batch.is_decode and self.slot_table is not None:
            seqs = self.slot_table.sync(batch.decode)
            return plan_decode_bucketed(seqs, self.slot_table, self.buckets, self.inputs, device)
        if batch.is_decode:
            return plan_decode(batch.decode, self.block_size, device)
        if batch.speculative and self.fused and not batch.chunks:  # drafts through the fused step
            return plan_verify(batch.decode, self.block_size, device)
        # prefill, or a mixed step: decode rows ride along as one-token chunks, first
        plan = plan_prefill(batch.as_chunks(), self.block_size, device, batch.speculative)
        plan.num_decode = len(batch.decode)
        plan.decode_width = max((len(s.token_ids) + len(s.draft) for s in batch.decode), default=0)
        return plan

    def release(self, seq: Sequence) -> None:
        """seq left the running set (finished, aborted or preempted): free its slot-table row
        and its sliding layers' blocks."""
        if self.slot_table is not None and seq in self.slot_table.row_of:
            self.slot_table.release(seq)
        if self.window_blocks is not None:
            self.window_blocks.leave(seq)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        tp = getattr(self.model, "tp", None)
        if tp is not None:  # tensor parallel: every rank runs this plan (tp.py)
            tp.announce(plan)
        if self.fused and (plan.is_decode or plan.verify):
            return self.model.fused_decode(plan, self.cache)
        return self.model(plan.input_ids, plan.positions, self.cache.view(plan), logits_at=plan.logits_at)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits (B, vocab), fp32, one row per plan row (its last token).

        With capture on, a decode step replays the graph recorded for its (rows, width) shape,
        recording it first if this is the shape's first step (a cold capture)."""
        if not (self.capture and plan.is_decode):
            return self._forward(plan)
        shape = tuple(plan.slot_window.shape)
        graph = self.graphs.get(shape)
        if graph is not None:
            return graph.replay()
        if self.lazy and self.graph_bytes + self.graph_cost(shape) <= self.graph_budget:
            self.cold_captures += 1
            return self.record(plan).output
        self.eager_steps += 1  # past the warm list, or the budget is spent: run it as it is
        return self._forward(plan)

    def graph_cost(self, shape: tuple[int, int]) -> int:
        """What recording shape will hold at least: its fp32 logits buffer (rows x vocab)."""
        return shape[0] * self.model.cfg.vocab_size * 4

    def record(self, plan: StepPlan):
        """Record the decode step for plan's (rows, width) shape: a CUDA graph on a GPU (all
        sharing one memory pool), a HostGraph elsewhere."""
        shape = tuple(plan.slot_window.shape)
        if self.model.device.type == "cuda":
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            reserved = torch.cuda.memory_reserved(self.model.device)
            graph = CudaGraph.record(self._forward, plan, pool=self.graph_pool)
            self.graph_bytes += torch.cuda.memory_reserved(self.model.device) - reserved
        else:
            graph = HostGraph.record(self._forward, plan)
            if isinstance(graph.output, torch.Tensor):
                self.graph_bytes += graph.output.numel() * graph.output.element_size()
        self.graphs[shape] = graph
        return graph
