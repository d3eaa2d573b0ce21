"""The engine (day 34): requests in, tokens and text out, one step at a time.

    engine = build_engine(EngineConfig())
    rid = engine.add_request("Hello!", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput: new tokens and text per request
            print(out.request_id, out.text_delta, out.finish_reason)

`add_request` validates (a bad request is a `ValueError` with a sentence, and nothing in flight
is touched), `step` runs one scheduler batch through the model and the sampler, applies the
end-of-sequence rule, `max_tokens`, the context limit and stop strings, and releases finished
sequences' blocks at once; `abort` ends a request wherever it is. `generate` is the offline
loop over a list of prompts, with a progress bar.

Penalties (issue 32). A sequence's `stop_token_ids` end it as the end token does; none of its
first `min_tokens` tokens can end it (the sampler masks the end tokens meanwhile). The
penalties, logit_bias and min_tokens need what each sequence has seen, so a step hands the
sampler every row's token ids, but only when one of its rows asks for one of them: a step
without runs the sampler's ops exactly as before (days 48 and 61 count them).

Scores (day 36). A request whose params ask for `logprobs` gets each new token's
`TokenLogprobs` in `RequestOutput.logprobs`; one asking for `prompt_logprobs` gets the prompt's
(None for the first token, which nothing predicts) in the `prompt_logprobs` of its first
output. Prefill computes the logits of every position of such a prompt, and only of such a
prompt (`logits_at` widened for its rows alone); its prefix is not taken from the cache, since a
skipped position has no logits. With `max_tokens=0` it ends after the prompt, unsampled.

Several samples of one prompt (`n`): `add_request(..., after=first_id)` holds a request until
the request `first_id` has its prompt in the cache, then queues it at the front, so its prompt's
full blocks are shared through the prefix cache instead of computed again (only the last,
partial block is recomputed per sample).

The engine owns nothing clever itself: the scheduler decides, the plan addresses, the runner
computes, the sampler picks.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from dataclasses import dataclass, field

import torch

from nanoserve.blocks import BlockAllocator, WindowBlocks
from nanoserve.buckets import row_buckets, width_buckets
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.config import EngineConfig
from nanoserve.grammar import Grammars
from nanoserve.inputs import PersistentInputs
from nanoserve.pool import plan_pool
from nanoserve.runner import ModelRunner
from nanoserve.sampling import InvalidParam, SamplingParams, TokenLogprobs, logprobs_of, sample_rows
from nanoserve.scheduler import Scheduler, Sequence
from nanoserve.slots import SlotTable
from nanoserve.speculative import NgramProposer, RowState, SpecStats, accepted_length
from nanoserve.stopping import StopStrings


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finish_reason: str | None = None  # stop | length | abort | error; None while running
    error: str | None = None  # with finish_reason "error": why this request alone was ended
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when params.logprobs is set
    # on the first output, when params.prompt_logprobs is set: one per prompt token, None first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # one per new token: where its text starts in the request's text (the characters decoded
    # before it). Not the length of the text emitted so far: a stop string's holdback or half a
    # UTF-8 character delays a token's text to a later output. None without a tokenizer.
    text_offsets: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_preemptions: int = 0


@dataclass
class _Request:
    seq: Sequence
    detok: object | None
    stops: StopStrings
    pieces: list[str] = field(default_factory=list)  # the text as emitted, joined once at the end

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config.validate()
        self.max_model_len = config.max_model_len or model.cfg.max_position_embeddings
        dtype = model.dtype
        tp = getattr(model, "tp", None)
        # a model with sliding layers: their own blocks, sized for the rows that can run, and
        # the rest of the budget to the full layers (`_window_pool`); None: one pool for all
        self.window_pool, pool_cfg, budget = self._window_pool(model, config, tp)
        self.pool = plan_pool(
            # under tensor parallelism the pool is planned for the whole model (the same blocks as
            # one process, so the same schedule); each rank holds its K/V heads' part (tp.py)
            pool_cfg if tp is None else tp.full_cfg,
            dtype,
            block_size=config.block_size,
            budget_bytes=budget,
            device=model.device.type,
        )
        self.context_capped = None  # the model's own context, where the pool made it shorter
        if config.fit_context and config.max_model_len is None and self.pool.num_slots < self.max_model_len:
            # not asked for, and fitting asked for (the CLI does): the longest context the pool
            # holds, said in the paths line; otherwise a context the pool cannot hold is refused
            self.context_capped, self.max_model_len = self.max_model_len, self.pool.num_slots
        if self.pool.num_slots < self.max_model_len:
            raise ValueError(
                f"the KV pool holds {self.pool.num_slots} tokens, fewer than max_model_len "
                f"{self.max_model_len}; raise the KV budget or lower max_model_len"
            )
        self.allocator = BlockAllocator(
            self.pool.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.cache = BatchedPagedKVCache(
            model.cfg, self.pool.num_slots, dtype=dtype, device=model.device, attention=config.attention
        )
        self.scheduler = Scheduler(
            self.allocator,
            config.max_batch,
            config.max_num_batched_tokens,
            watermark=config.watermark,
            policy=config.schedule,
            order=config.scheduling_policy,
        )
        slot_table = buckets = inputs = None
        if config.bucket_decode:
            sink = self.pool.sink_slot
            slot_table = SlotTable(config.max_batch, self.max_model_len, sink, device=model.device)
            buckets = (
                row_buckets(config.max_batch),
                width_buckets(self.max_model_len, config.width_multiple),
            )
            if config.persist_inputs:
                inputs = PersistentInputs(config.max_batch, sink, device=model.device)
        # last of the checks that can refuse the config: a refused engine leaves the model as it was
        self.linear = self._pack(model, config)
        self.decode_step = self._decode_step(model, config, self.cache.attention)
        self.runner = ModelRunner(
            model,
            self.cache,
            config.block_size,
            slot_table,
            buckets,
            inputs,
            capture=config.capture_decode,
            graph_budget=config.graph_budget,
            fused=self.decode_step == "fused",
        )
        self.scheduler.on_leave = self.runner.release
        self.window_blocks = None
        if self.window_pool is not None:
            cfg = model.cfg
            self.window_blocks = WindowBlocks(
                self.window_pool.num_blocks, config.block_size, cfg.sliding_window, self.pool.num_blocks
            )
            self.allocator.usable_hits = self.window_blocks.usable_hits
            self.allocator.on_fresh = self.window_blocks.forget
            self.cache.set_window_blocks(
                self.window_blocks.local_of, self.window_pool.num_blocks, config.block_size
            )
            self.runner.window_blocks = self.window_blocks
        self.proposer = None  # speculative decoding's (speculative.py), when config.speculative asks
        self.spec_stats = SpecStats()
        if config.speculative == "ngram":
            if self.window_pool is not None:
                raise ValueError(
                    "speculative decoding is not built for a model whose sliding layers have their own "
                    "blocks (Gemma 3); serve it without --speculative"
                )
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        self.requests: dict[str, _Request] = {}
        self.held: dict[str, list[Sequence]] = {}  # request id -> samples waiting for its prompt
        self.step_kinds = {"prefill": 0, "decode": 0, "mixed": 0}  # steps run, by what they held
        self._ids = itertools.count()
        self.eos_ids = tokenizer.eos_ids if tokenizer is not None else frozenset()
        # structured output: llguidance's tokenizer is built on the first constrained request
        self.grammars = Grammars(
            tokenizer, model.cfg.vocab_size, self.eos_ids, threads=torch.get_num_threads()
        )
        self.warm_report = None  # a WarmupReport once warm_decode has run
        self.model_name = "model"  # what the server calls it; build_engine uses the directory's name
        self.malloc = None  # what build_engine's keep_freed_memory did (malloc.py), when asked

    @staticmethod
    def _window_pool(model, config: EngineConfig, tp):
        """(the sliding layers' pool plan or None, the config the full pool is planned for, its
        budget). The sliding layers get `WindowBlocks.blocks_for` blocks, the most the running
        rows can hold at once; the full layers the rest of the budget. One pool for all layers
        where there are no sliding layers, config.window_blocks is off, under tensor
        parallelism (each rank plans its own pools), or where the sliding blocks would not
        leave the full layers a block."""
        cfg = model.cfg
        if not (cfg.sliding_layers and config.window_blocks and tp is None):
            return None, cfg, config.kv_budget
        bs, local_layers = config.block_size, len(cfg.sliding_layers)
        blocks = WindowBlocks.blocks_for(
            config.max_batch, config.max_num_batched_tokens, bs, cfg.sliding_window
        )
        local_cfg = dataclasses.replace(cfg, num_layers=local_layers)
        full_cfg = dataclasses.replace(cfg, num_layers=cfg.num_layers - local_layers)
        per_block = local_cfg.kv_bytes_per_token(model.dtype) * bs
        local_bytes = (blocks + 1) * per_block  # and the hole block
        budget = config.kv_budget
        if budget is None:
            budget = plan_pool(cfg, model.dtype, bs, None, device=model.device.type).budget_bytes
        if budget - local_bytes < 2 * full_cfg.kv_bytes_per_token(model.dtype) * bs:
            return None, cfg, config.kv_budget
        local = dataclasses.replace(
            plan_pool(local_cfg, model.dtype, bs, local_bytes, device=model.device.type), num_blocks=blocks
        )
        return local, full_cfg, budget - local_bytes

    def kv_bytes_held(self) -> int:
        """Bytes of K/V the blocks rows hold now take, over all layers: a full block holds every
        full layer's K/V; a sliding block every sliding layer's (without window_blocks a block
        holds every layer's)."""
        held = self.allocator.num_used * self.pool.bytes_per_block
        if self.window_blocks is not None:
            held += self.window_blocks.num_used * self.window_pool.bytes_per_block
        return held

    @staticmethod
    def _pack(model, config: EngineConfig) -> str:
        """Pack the model's linears in place when config.linear asks (model.pack_linears);
        returns what the engine runs: "packed" or "plain". Packing cannot be undone: a model an
        earlier engine packed stays packed whatever config.linear says (load a fresh model for
        a plain reference, as days 48-58 do)."""
        from nanoserve.models import pack_linears, packing_status
        from nanoserve.quant import QuantTensor

        if isinstance(model.head, QuantTensor):
            if config.linear == "packed":
                raise ValueError(
                    f"linear='packed' is for fp32/bf16 weights; this model's are {model.weights}"
                )
            return model.weights
        if model.head.is_mkldnn:
            return "packed"
        if config.decode_step == "fused" and config.linear == "auto":
            return "plain"  # the fused step reads the weights as loaded, not oneDNN's layout
        why = packing_status(model.dtype, model.device) if config.linear != "plain" else "asked"
        if why is None:
            pack_linears(model, rows=config.max_batch)
            return "packed"
        if config.linear == "packed":
            raise ValueError(f"linear='packed' is not possible here: {why}")
        return "plain"

    def paths_line(self) -> str:
        """Which way each part runs: 'paths: linears packed, decode attention native, schedule
        budget'; with quantized weights or the fused step, also what the weights are and which
        step runs: 'paths: weights q4_1 (fp32 activations), 96.6 MB, linears q4_1, decode step
        fused, decode attention native, schedule budget'."""
        from nanoserve.models import describe_weights
        from nanoserve.quant import WEIGHTS

        linears, attention = f"linears {self.linear}", f"decode attention {self.cache.attention}"
        schedule = f"schedule {self.config.schedule}"
        if self.context_capped is not None:  # the pool, not the model, sets the context
            schedule += (
                f", context {self.max_model_len:,} tokens (the KV pool's; the model's own is "
                f"{self.context_capped:,}: --kv-budget raises it)"
            )
        if self.malloc is not None:  # build_engine with config.keep_freed_memory (the CLI's)
            schedule += ", freed memory kept" if self.malloc == "kept" else f", malloc as is: {self.malloc}"
        if self.proposer is not None:
            schedule += f", {self.proposer.describe()}"
        if self.model.weights in WEIGHTS or self.decode_step == "fused":
            weights, step = f"weights {describe_weights(self.model)}", f"decode step {self.decode_step}"
            return f"paths: {weights}, {linears}, {step}, {attention}, {schedule}"
        return f"paths: {linears}, {attention}, {schedule}"

    @staticmethod
    def _decode_step(model, config: EngineConfig, attention: str) -> str:
        """ "fused" or "ops": what a decode step runs as (config.decode_step; auto is fused for
        quantized weights where the native kernels can run the model)."""
        from nanoserve.quant import QuantTensor

        if config.decode_step == "ops":
            return "ops"
        why = model.fused_status()
        if why is None and attention != "native":
            why = "the fused step reads the pools with the native attention kernel (attention='native')"
        if config.decode_step == "fused":
            if why is not None:
                raise ValueError(f"decode_step='fused' is not possible here: {why}")
            return "fused"
        return "fused" if why is None and isinstance(model.head, QuantTensor) else "ops"

    # --- requests --------------------------------------------------------------------------

    def encode_prompt(self, prompt, tools=None) -> list[int]:
        """str -> tokens as is; list of {role, content} -> the chat template (with `tools`, a
        chat's tool list, written in by it); list of ints -> as is."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass the prompt as a list of token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer to render chat messages with")
            return (
                self.tokenizer.encode_chat(prompt)
                if tools is None
                else self.tokenizer.encode_chat(prompt, tools)
            )
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            vocab = self.model.cfg.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary of {vocab} tokens")
            return list(prompt)
        raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        after: str | None = None,
    ) -> str:
        """Queue a request; returns its id. `after`: the id of a request in flight with the same
        prompt; this one waits until that one's prompt is in the cache, and then shares its
        blocks (several samples of one prompt)."""
        # with the vocabulary: a logit_bias or stop_token_ids id past the logits is refused here
        params = (params or SamplingParams()).validate(vocab=self.model.cfg.vocab_size)
        ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(ids)} tokens, which leaves no room to generate in the context of "
                f"{self.max_model_len} tokens; shorten it"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if params.priority and self.scheduler.order != "priority":
            raise InvalidParam(
                "priority",
                f"priority {params.priority} needs priority scheduling (--scheduling-policy priority); "
                "this server serves requests in arrival order",
            )
        seq = Sequence(request_id, ids, params, self.config.block_size)
        seq.priority = params.priority
        seq.max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        seq.reuse_prefix = params.prompt_logprobs is None or len(ids) == 1
        if not params.greedy:
            seq.generator = params.make_generator(self.model.device)
        if params.guided is not None:  # compiled already if the server asked first (grammar.py)
            seq.matcher = self.grammars.matcher(params.guided)
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        stops = StopStrings(params.stop, keep=params.include_stop_str_in_output)
        self.requests[request_id] = _Request(seq, detok, stops)
        first = self.requests.get(after) if after is not None else None
        if first is not None and not self._prompt_done(first.seq):
            self.held.setdefault(after, []).append(seq)
        else:
            self.scheduler.add(seq)
        return request_id

    @staticmethod
    def _prompt_done(seq: Sequence) -> bool:
        return seq.finished or seq.num_computed >= len(seq.prompt_ids)

    def _release_held(self) -> None:
        """Queue the samples whose first sample has its prompt in the cache (or has ended)."""
        for first_id in list(self.held):
            first = self.requests.get(first_id)
            if first is None or self._prompt_done(first.seq):
                for seq in reversed(self.held.pop(first_id)):
                    if not seq.finished:
                        self.scheduler.add(seq, front=True)

    def abort(self, request_id: str) -> bool:
        """End a request now; its blocks are free when this returns. False if it is unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req.seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.held)

    # --- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._release_held()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        if batch.speculative and any(not s.reuse_prefix for s, _, _ in batch.chunks):
            for seq in batch.decode:  # a prompt being scored this step: its logits' way, no drafts
                seq.draft.clear()
            batch.speculative = False
        plan = self.runner.plan(batch)
        if batch.speculative:
            self.step_kinds["mixed" if batch.chunks else "decode"] += 1
            return self._step_speculative(batch, plan)
        self.step_kinds["mixed" if batch.is_mixed else "decode" if batch.is_decode else "prefill"] += 1
        # rows whose prompt is being scored: every position's logits, not only the last
        scored = [i for i, (s, _, _) in enumerate(plan.chunks) if not s.reuse_prefix]
        if scored:
            logits = self._execute_scoring(plan, scored)
        else:
            logits = self.runner.execute(plan)  # (B, V)
        for seq, _, end in batch.chunks:
            seq.num_computed = end
        for seq in batch.decode:
            seq.num_computed = len(seq.token_ids)
        for seq in plan.rows:
            # only blocks whose K/V is written now may be shared: another sequence can read them next step
            self.allocator.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        # a row samples once its whole sequence is in the cache (a prompt's last chunk, or decode)
        ready = [i for i, s in enumerate(plan.rows) if s.num_computed == len(s.token_ids)]
        outs = []
        scoring_only = [i for i in ready if plan.rows[i].max_tokens == 0]
        for i in scoring_only:  # max_tokens 0: the prompt was all it asked for
            outs.append(self._finish_unsampled(plan.rows[i]))
        ready = [i for i in ready if plan.rows[i].max_tokens > 0]
        if not ready:
            return outs
        seqs = [plan.rows[i] for i in ready]
        picked = logits[torch.tensor(ready, device=logits.device)]
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        guided = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if guided:  # structured output: each grammar row's token mask (grammar.py)
            masks = (guided, self.grammars.fill([seqs[i].matcher for i in guided]))
            history = [(s.token_ids, len(s.prompt_ids)) for s in seqs]
            tokens = sample_rows(picked, params, generators, history, self.eos_ids, masks)
        elif any(p.adjusts_logits for p in params):  # penalties, logit_bias, min_tokens
            history = [(s.token_ids, len(s.prompt_ids)) for s in seqs]  # prompt first, then output
            tokens = sample_rows(picked, params, generators, history, self.eos_ids)
        else:  # the call as it was before these options existed, and the same ops
            tokens = sample_rows(picked, params, generators)
        scores = self._token_scores(picked, seqs, tokens)
        for seq, token, score in zip(seqs, tokens, scores):
            out = self._append_or_fail(seq, token)
            if score is not None and out.finish_reason != "error":
                seq.cumulative_logprob += score.logprob
                out.logprobs = [score]
            outs.append(self._with_prompt_scores(seq, out))
        return outs

    # --- speculative decoding (speculative.py) ------------------------------------------------

    def _propose(self) -> None:
        """A draft for each decoding row, cut to what the row may still generate (its accepted
        drafts and one more token fit max_tokens and the context) and, under a grammar, to what
        the grammar accepts."""
        for seq in self.scheduler.running:
            seq.draft = []
            if seq.needs_prefill:
                continue
            if seq.spec is None:
                seq.spec = RowState()
            n = len(seq.token_ids)
            left = min(seq.max_tokens - (n - len(seq.prompt_ids)), self.max_model_len - n) - 1
            seq.draft = self.proposer.propose(seq.spec, seq.token_ids, left)
            if seq.draft and seq.matcher is not None:
                ends = [i for i, t in enumerate(seq.draft) if t in self.eos_ids]
                if ends:
                    del seq.draft[ends[0] :]
                del seq.draft[seq.matcher.validate_tokens(seq.draft) :]

    def _draft_masks(self, seqs: list[Sequence], drafts: list[list[int]]):
        """(rows, bitmask) of the grammar rows among the verifying rows: row j of a sequence with
        a draft is masked by its grammar's state after the draft's first j tokens (copies of the
        matcher advanced along the draft; the sequence's own matcher moves only as tokens are kept)."""
        rows, states = [], []
        for i, (seq, j) in enumerate(zip(seqs, drafts)):
            if seq.matcher is None:
                continue
            state = seq.matcher
            if j:
                state = seq.matcher.deep_copy()
                state.consume_tokens(j)
            rows.append(i)
            states.append(state)
        return (rows, self.grammars.fill(states)) if rows else None

    def _step_speculative(self, batch, plan) -> list[RequestOutput]:
        """A step in which some decode rows carry drafts: logits at every position of those rows,
        one draw per position, the longest agreeing prefix kept (speculative.py's module doc)."""
        d = len(batch.decode)
        at, spans = [], []
        for row, (n0, n1, _) in enumerate(plan.row_spans):
            wide = row < d and plan.rows[row].draft
            spans.append((len(at), n1 - n0 if wide else 1))
            at.extend(range(n0, n1) if wide else (n1 - 1,))
        plan.logits_at = torch.tensor(at, dtype=torch.long, device=plan.logits_at.device)
        every = self.runner.execute(plan)  # (len(at), V)
        for seq, _, end in batch.chunks:
            seq.num_computed = end
        for seq in batch.decode:
            seq.num_computed = len(seq.token_ids)  # the drafts' K/V is written, not yet kept
        for seq in plan.rows:
            self.allocator.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        ready = [i for i, s in enumerate(plan.rows) if s.num_computed == len(s.token_ids)]
        outs = [self._finish_unsampled(plan.rows[i]) for i in ready if plan.rows[i].max_tokens == 0]
        ready = [i for i in ready if plan.rows[i].max_tokens > 0]
        # one virtual row per position to draw at: (plan row, draft tokens before it)
        virtual = [(i, j) for i in ready for j in range(spans[i][1])]
        seqs = [plan.rows[i] for i, _ in virtual]
        drafts = [plan.rows[i].draft[:j] for i, j in virtual]
        picked = every[torch.tensor([spans[i][0] + j for i, j in virtual], device=every.device)]
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        masks = self._draft_masks(seqs, drafts) if any(s.matcher is not None for s in seqs) else None
        if masks is not None or any(p.adjusts_logits for p in params):
            history = [(s.token_ids + j, len(s.prompt_ids)) for s, j in zip(seqs, drafts)]
            tokens = sample_rows(picked, params, generators, history, self.eos_ids, masks)
        else:
            tokens = sample_rows(picked, params, generators)
        scores = self._token_scores(picked, seqs, tokens)
        v = 0
        for i in ready:
            seq, n = plan.rows[i], spans[i][1]
            drawn, drawn_scores = tokens[v : v + n], scores[v : v + n]
            v += n
            draft = seq.draft
            m = accepted_length(draft, drawn) if draft else 0
            out = self._append_many(seq, draft[:m] + [drawn[m]], drawn_scores[: m + 1])
            outs.append(self._with_prompt_scores(seq, out))
            if draft:
                stats = self.spec_stats
                stats.verifications += 1
                stats.draft_tokens += len(draft)
                stats.accepted_tokens += m
                stats.emitted_tokens += len(out.new_token_ids)
                self.proposer.record(seq.spec, m, len(draft))
                seq.draft = []
                if not seq.finished:  # the rejected positions' blocks back to the pool
                    seq.num_computed = len(seq.token_ids) - 1
                    self.allocator.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
                    self.allocator.trim(seq.block_table, len(seq.token_ids))
        return outs

    def _append_many(self, seq: Sequence, tokens: list, scores: list) -> RequestOutput:
        """`_append_or_fail` for each token in turn, until the sequence ends; one output for them all."""
        out = RequestOutput(seq.request_id, [])
        for token, score in zip(tokens, scores):
            one = self._append_or_fail(seq, token)
            out.new_token_ids += one.new_token_ids
            out.text_delta += one.text_delta
            if one.text_offsets is not None:
                out.text_offsets = (out.text_offsets or []) + one.text_offsets
            if score is not None and one.finish_reason != "error":
                seq.cumulative_logprob += score.logprob
                out.logprobs = (out.logprobs or []) + [score]
            if one.finished:
                out.finish_reason, out.error = one.finish_reason, one.error
                break
        return out

    def _execute_scoring(self, plan, scored: list[int]) -> torch.Tensor:
        """Run a prefill step whose rows `scored` want every position's logits. Returns the
        sampling logits (B, V) as `execute` would, after storing the scored rows' prompt scores."""
        at, last, spans = [], [], {}
        for row, (n0, n1, _) in enumerate(plan.row_spans):
            if row in scored:
                spans[row] = (len(at), n1 - n0)
                at.extend(range(n0, n1))
            else:
                at.append(n1 - 1)
            last.append(len(at) - 1)
        plan.logits_at = torch.tensor(at, dtype=torch.long, device=plan.logits_at.device)
        every = self.runner.execute(plan)  # (len(at), V)
        for row in scored:
            seq, start, end = plan.chunks[row]
            first, _ = spans[row]
            # logits at position p score token p + 1; the prompt's last position scores no prompt token
            k = min(end, len(seq.prompt_ids) - 1) - start
            targets = seq.token_ids[start + 1 : start + 1 + k]
            del seq.prompt_lp[start:]  # a prompt restarted after preemption is scored again
            seq.prompt_lp.extend(logprobs_of(every[first : first + k], targets, seq.params.prompt_logprobs))
            if len(seq.prompt_lp) == len(seq.prompt_ids) - 1:
                seq.reuse_prefix = True  # scored: a recompute may now take its prefix from the cache
        return every[torch.tensor(last, dtype=torch.long, device=every.device)]

    def _token_scores(self, logits, seqs, tokens) -> list[TokenLogprobs | None]:
        """Scores of the tokens just sampled, for the rows whose params ask for them."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and isinstance(tokens[i], int)]
        scores: list[TokenLogprobs | None] = [None] * len(seqs)
        if rows:
            index = torch.tensor(rows, device=logits.device)
            asked = [seqs[i].params.logprobs for i in rows]
            got = logprobs_of(logits[index], [tokens[i] for i in rows], asked)
            for i, score in zip(rows, got):
                scores[i] = score
        return scores

    def _with_prompt_scores(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        """Attach the prompt's scores to the request's first output (once)."""
        if seq.params.prompt_logprobs is not None and not seq.prompt_lp_sent:
            out.prompt_logprobs = [None, *seq.prompt_lp]
            seq.prompt_lp_sent = True
        return out

    def _finish_unsampled(self, seq: Sequence) -> RequestOutput:
        """A request that only scores its prompt ends when the prompt is computed."""
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, "length")
        return self._with_prompt_scores(seq, RequestOutput(seq.request_id, [], finish_reason="length"))

    def _append_or_fail(self, seq: Sequence, token: int | str) -> RequestOutput:
        """One row's outcome. A row that could not be sampled (token is the reason) or whose
        token could not be turned into text ends alone, with finish_reason "error"; its blocks
        are free and the step's other rows are untouched."""
        if not isinstance(token, str) and seq.matcher is not None:
            token = self.grammars.advance(seq.matcher, token) or token
        if not isinstance(token, str):
            try:
                return self._append(seq, token)
            except Exception as e:  # detokenizing or a stop check broke on this row only
                token = f"this request's output could not be processed ({type(e).__name__}: {e})"
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, "error")
        return RequestOutput(seq.request_id, [], finish_reason="error", error=token)

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        req = self.requests[seq.request_id]
        seq.token_ids.append(token)
        out = RequestOutput(seq.request_id, [token])
        if req.detok is not None:
            out.text_offsets = [req.detok.chars]
        finish, p = None, seq.params
        # the first min_tokens tokens cannot end the sequence (the sampler masks the end tokens
        # meanwhile, and a stop string they complete is ordinary text: stopping.py)
        may_stop = len(seq.token_ids) - len(seq.prompt_ids) > p.min_tokens
        if seq.matcher is not None and seq.matcher.is_stopped():  # a complete grammar outranks min_tokens
            may_stop = True
        if may_stop and (token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)):
            finish = "stop"
            if p.include_stop_str_in_output and req.detok is not None:  # the end token's text too
                out.text_delta, _ = req.stops.feed(req.detok.add(token))
        elif req.detok is not None:
            piece, stopped = req.stops.feed(req.detok.add(token), may_stop)
            out.text_delta = piece
            if stopped:
                finish = "stop"
        if finish is None and (
            len(seq.token_ids) - len(seq.prompt_ids) >= seq.max_tokens
            or len(seq.token_ids) >= self.max_model_len
        ):
            finish = "length"
        if finish is not None:
            if req.detok is not None and not req.stops.stopped:
                tail, _ = req.stops.feed(req.detok.flush(), may_stop)
                out.text_delta += tail + req.stops.flush()
            self.scheduler.finish(seq, finish)
            out.finish_reason = finish
            del self.requests[seq.request_id]
        if out.text_delta:
            req.pieces.append(out.text_delta)
        return out

    def warm_decode(self, max_rows: int | None = None, max_width: int | None = None):
        """Record the decode graphs for every bucket shape (trimmed to max_rows and max_width)
        before any request arrives; needs capture_decode. Returns a `WarmupReport`, also kept as
        `self.warm_report`. From then on nothing more is recorded: a decode shape outside the
        list runs eagerly (`runner.eager_steps`), so graph memory stays what the report says."""
        from nanoserve.warmup import warm_decode, warm_shapes

        if not self.config.capture_decode:
            raise ValueError("warm_decode needs capture_decode: there is nothing to record without it")
        shapes = warm_shapes(
            self.config.max_batch, self.max_model_len, self.config.width_multiple, max_rows, max_width
        )
        self.cache.ensure_pools()
        report = warm_decode(self.runner, shapes)
        report.max_rows, report.max_width = max_rows, max_width
        self.warm_report = report
        self.runner.lazy = False
        return report

    def warm_trim(self) -> tuple[int, int, int]:
        """(max_rows, max_width, width ceiling) for the warm list (day 56): rows from the
        scheduler's max_batch (or warm_max_rows, if smaller); width the smallest of the context
        this deployment serves, warm_max_width, and the widest shape the memory left after the
        weights and the KV pool allows (`width_ceiling` of `warm_budget_bytes`)."""
        from nanoserve.warmup import warm_budget_bytes, width_ceiling

        cfg = self.config
        max_rows = min(self.scheduler.max_batch, cfg.warm_max_rows or self.scheduler.max_batch)
        self.cache.ensure_pools()  # the KV pool is resident before free memory is probed
        ceiling = width_ceiling(warm_budget_bytes(self.model.device), max_rows, self.model.cfg.num_heads)
        max_width = min(self.max_model_len, ceiling, cfg.warm_max_width or self.max_model_len)
        return max_rows, max_width, ceiling

    # --- offline ---------------------------------------------------------------------------

    def generate(self, prompts, params=None, use_tqdm: bool = True) -> list[Completion]:
        """Run every prompt to completion; results in the prompts' order."""
        from tqdm import tqdm

        if not isinstance(params, list):
            params = [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        reqs = {rid: self.requests[rid] for rid in ids}
        done: dict[str, Completion] = {}
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        t0, n_tokens = time.perf_counter(), 0
        while len(done) < len(ids) and self.has_unfinished():
            for out in self.step():
                n_tokens += len(out.new_token_ids)
                if out.finished and out.request_id in reqs:
                    r = reqs[out.request_id]
                    done[out.request_id] = Completion(
                        out.request_id,
                        r.seq.prompt_ids,
                        r.seq.output_ids,
                        r.text,
                        out.finish_reason,
                        r.seq.num_preemptions,
                    )
                    bar.update(1)
            bar.set_postfix_str(f"{n_tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s", refresh=False)
        bar.close()
        return [done[rid] for rid in ids]


def build_engine(config: EngineConfig, on_phase=None) -> Engine:
    """Load the model and tokenizer the config names, plan the KV pool, build the engine and,
    with capture_decode and warm on, record the warm list before returning (day 56): whoever
    gets the engine back gets one that will not record a graph in front of a client for any
    shape in the list. `on_phase("loading" | "warming")` is told as each stage starts (the
    server's /health reads it). The pool line and the warm line go to stderr."""
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.tp import launched
    from nanoserve.weights import resolve_model_dir

    on_phase = on_phase or (lambda phase: None)
    config.validate()
    on_phase("loading")
    if config.threads:
        torch.set_num_threads(config.threads)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    malloc = None
    if config.keep_freed_memory and torch.device(device).type == "cpu":
        from nanoserve.malloc import keep_freed_memory

        malloc = keep_freed_memory()
    model_dir = resolve_model_dir(config.model)
    tp = None
    if launched():  # one rank of several (torchrun): this is rank 0's engine (tp.py)
        from nanoserve import tp as tensor_parallel

        config = tensor_parallel.engine_config(config)
        model, tp = tensor_parallel.load_share(config, model_dir, torch.device(device))
    elif config.weights:
        from nanoserve.fetch import model_gguf
        from nanoserve.models import load_quantized

        model = load_quantized(config, model_dir, config.gguf or model_gguf(config.model))
    else:
        model = load_model(model_dir, dtype=getattr(torch, config.dtype), device=device)
    try:
        if config.max_model_len and config.max_model_len > model.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} is longer than the model's context of "
                f"{model.cfg.max_position_embeddings} tokens"
            )
        tokenizer = Tokenizer.from_dir(model_dir)
        if config.chat_template is not None:
            tokenizer.use_template_file(config.chat_template)
        engine = Engine(model, tokenizer, config)
    except Exception as e:
        if tp is not None:  # the workers wait for rank 0's pool: tell them why it will not come
            tp.fail_setup(str(e))
        raise
    engine.model_name = model_dir.name
    engine.malloc = malloc
    print(engine.pool.describe(), file=sys.stderr)  # stderr: a command's stdout stays its answer
    if engine.window_pool is not None:  # the sliding layers' own blocks, sized for the rows that run
        print(
            engine.window_pool.describe().replace("KV pool:", "KV pool of the sliding layers:"),
            file=sys.stderr,
        )
    print(engine.paths_line(), file=sys.stderr)
    if tp is not None:
        import atexit

        tp.setup(engine)
        atexit.register(tp.stop)  # the workers leave their loops when this process ends
        for share in tp.shares:
            print(f"nanoserve: tensor parallel {share.describe()}", file=sys.stderr)
    if config.capture_decode and config.warm:
        on_phase("warming")
        max_rows, max_width, ceiling = engine.warm_trim()
        report = engine.warm_decode(max_rows, max_width)
        report.width_ceiling = ceiling
        print(report.describe(), file=sys.stderr)
    return engine
