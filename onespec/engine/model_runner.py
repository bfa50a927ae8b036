"""Packs a scheduled batch into flat device tensors, runs the spec worker, and brings the
small results back to the host in one copy."""
from __future__ import annotations

import torch

from onespec.engine.cuda_graph import PendingStep
from onespec.engine.request import Request
from onespec.layers.logprobs import LogprobRows, host_entries
from onespec.layers.processors import RowHistory, build_row_processors
from onespec.engine.scheduler import ScheduledBatch, StepOutput
from onespec.layers.attention import build_attention_metadata
from onespec.layers.sampler import GreedySampling, SamplingTensors
from onespec.speculative.host_drafts import host_span
from onespec.speculative.shape import ChainShape, ResultsLayout
from onespec.speculative.thinking import relaxed_delta
from onespec.speculative.worker import SpecWorker, StepInputs
from onespec.structured.step import StepGrammar

PLACEHOLDER = -1      # step-0 draft input not known until this step's tokens are sampled
CHAIN = ChainShape()


def drafting_requests(batch: ScheduledBatch) -> list[int]:
    """Batch indices of the requests that draft this step: context chunks that complete
    their prompt, then every generation request."""
    num_ctx = len(batch.context)
    return [i for i, c in enumerate(batch.context) if c.is_last] + \
        list(range(num_ctx, num_ctx + len(batch.generation)))


def _history(req: Request, drafts_before: list[int]) -> RowHistory | None:
    """A logit row's processor history (None without processors): the output plain
    decoding would have at that row, drafts before it included (layers/processors.py)."""
    sp = req.sampling_params
    if not sp.has_processors:
        return None
    return RowHistory(sp, req.prompt_token_ids, req.output_token_ids + drafts_before)


class LogprobPlan:
    """Collects, while a step's inputs are packed, the rows whose log-probabilities its
    requests ask for: output rows (logit rows of context chunks and verify rows) and
    prompt rows (a chunk's hidden rows that score the prompt token after them)."""

    def __init__(self):
        self.out_rows, self.out_tops = [], []
        self.prompt_index, self.prompt_tokens, self.prompt_tops, self.prompt_owners = \
            [], [], [], []

    def add_output_rows(self, req: Request, logit_rows):
        n = req.sampling_params.logprobs
        if n is not None:
            self.out_rows += logit_rows
            self.out_tops += [n] * len(logit_rows)

    def add_prompt_rows(self, req: Request, chunk: int, first_row: int, start: int, end: int):
        """Rows of positions q in [start, end) score prompt token q + 1, from the first
        token not scored yet (a preempted request recomputes without scoring again)."""
        n = req.sampling_params.prompt_logprobs
        if n is None:
            return
        prompt = req.prompt_token_ids
        done = len(req.prompt_logprobs or ())
        for q in range(max(start, done), min(end, len(prompt) - 1)):
            self.prompt_index.append(first_row + q - start)
            self.prompt_tokens.append(prompt[q + 1])
            self.prompt_tops.append(n)
            self.prompt_owners.append(chunk)

    def output_rows(self, dev) -> LogprobRows | None:
        if not self.out_rows:
            return None
        return LogprobRows(torch.tensor(self.out_rows, dtype=torch.int64, device=dev), None,
                           self.out_tops, self.out_rows)

    def prompt_rows(self, dev) -> LogprobRows | None:
        if not self.prompt_index:
            return None
        as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        return LogprobRows(as_long(self.prompt_index), as_long(self.prompt_tokens),
                           self.prompt_tops, self.prompt_owners)


def _by_owner(rows: LogprobRows | None, res, many: bool = False) -> dict | None:
    """Host entries keyed by their rows' owners ({logit row: entry}, or with many
    {context chunk: [entries]})."""
    if rows is None or res is None:
        return None
    entries = host_entries(res, rows.num_tops)
    if not many:
        return dict(zip(rows.owners, entries))
    out: dict[int, list] = {}
    for owner, entry in zip(rows.owners, entries):
        out.setdefault(owner, []).append(entry)
    return out


class ModelRunner:
    def __init__(self, worker: SpecWorker, block_size: int, device, vocab_size: int,
                 sliding_window: int | None = None, graphs=None, grammar_backend=None,
                 eos_token_ids: tuple[int, ...] = ()):
        self.worker = worker
        self.shape = worker.shape      # the step's rows, tree inputs, result layout
        self.eos_token_ids = tuple(eos_token_ids)     # what min_tokens holds back
        self.graphs = graphs          # CudaGraphRunner or None
        self.greedy = GreedySampling(device)
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.sliding_window = sliding_window
        self.grammar_backend = grammar_backend   # GrammarBackend (structured outputs)

    def run(self, batch: ScheduledBatch) -> StepOutput:
        if self.can_launch(batch):
            return self.collect(self.launch(batch))
        if self.graphs is not None and self.graphs.can_run(batch):   # constrained requests
            return self._run_constrained(batch)
        inp = self.prepare(batch)
        res = self.worker.step(inp)
        bc, bg, k = inp.num_ctx, inp.num_gen, inp.k
        layout = ResultsLayout.of(k, res.num_accepted, res.drafts, res.draft_parents)
        relaxed = [] if res.relaxed is None else [res.relaxed.reshape(-1)]
        flat = torch.cat([res.context_tokens, layout.pack(res.accepted, res.num_accepted,
                                                          res.drafts, res.draft_parents),
                          *relaxed]).tolist()                           # one host copy
        ctx, flat = flat[:bc], flat[bc:]
        num_acc, accepted, draft_rows, parent_rows = layout.unpack(flat, bg,
                                                                   layout.rows_of_drafts)
        if relaxed:
            rest = flat[layout.size:]
            relaxed = [rest[i * k:(i + 1) * k] for i in range(bg)]
        drafts: list[list[int]] = [[] for _ in range(bc + bg)]
        parents: list[list[int]] = [[] for _ in range(bc + bg)]
        for row, i in enumerate(drafting_requests(batch) if layout.num_drafts else []):
            drafts[i] = draft_rows[row]
            if parent_rows is not None:
                parents[i] = parent_rows[row]
            if res.draft_probs is not None:
                batch.requests[i].features.draft_probs = res.draft_probs[row]
        return StepOutput(
            context_tokens=ctx,
            accepted=accepted,
            num_accepted=num_acc,
            drafts=drafts,
            relaxed=relaxed or None,
            draft_parents=parents if parent_rows is not None else None,
            logprobs=_by_owner(inp.logprob_rows, res.logprobs),
            prompt_logprobs=_by_owner(inp.prompt_logprob_rows, res.prompt_logprobs, many=True),
        )

    def _run_constrained(self, batch: ScheduledBatch) -> StepOutput:
        """A generation batch with grammar-constrained requests, from CUDA graphs: the
        matchers fill each graph's masks on the host in between (CudaGraphRunner)."""
        k = batch.k
        drafts = [self._verified_drafts(r, k)[0] for r in batch.generation]
        grammar = StepGrammar(self.grammar_backend, batch, drafts,
                              list(range(len(batch.generation))), self.device, host_only=True)
        try:
            num_acc, accepted, next_drafts = self.graphs.run_constrained(batch, grammar)
        finally:          # the matchers keep only what postprocess feeds them
            grammar.rollback()
        return StepOutput([], accepted, num_acc, next_drafts)

    def can_launch(self, batch: ScheduledBatch) -> bool:
        """Whether the batch runs as a graph step that can be launched and collected later
        (never with grammar-constrained requests: their masks come from the host)."""
        return self.graphs is not None and self.graphs.can_run(batch) and \
            not StepGrammar.needed(batch)

    def can_follow(self, after: PendingStep, batch: ScheduledBatch) -> bool:
        """Whether `batch` can be launched chained to `after` (launch)."""
        return self.graphs.can_chain(after, batch)

    def launch(self, batch: ScheduledBatch, after: PendingStep | None = None) -> PendingStep:
        """Enqueues a graph step (can_launch) without waiting for it. `after`: a launched
        step not yet collected whose requests `batch` continues, row for row (the overlap
        scheduler): their tokens, drafts and positions come from its results on the device."""
        return self.graphs.launch(batch, chained=after is not None)

    def collect(self, step: PendingStep) -> StepOutput:
        num_acc, accepted, drafts, parents = self.graphs.collect(step)
        return StepOutput([], accepted, num_acc, drafts, draft_parents=parents)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        k = batch.k
        ids, pos, shift, q_lens, logit_rows, ctx_last = [], [], [], [], [], []
        draft_ctx_rows = []
        row_params, row_pos = [], []       # per logit row: params, position of its token
        histories = []                     # per logit row: its processors' history or None
        scored = LogprobPlan()             # rows whose logprobs are asked for
        for i, c in enumerate(batch.context):
            tokens = c.req.token_ids
            end = c.start + c.length
            ids += tokens[c.start:end]
            pos += range(c.start, end)
            shift += tokens[c.start + 1:end] + [PLACEHOLDER if c.is_last else tokens[end]]
            q_lens.append(c.length)
            ctx_last.append(len(ids) - 1)
            if c.is_last:
                draft_ctx_rows.append(len(ids) - 1)
            logit_rows.append(len(ids) - 1)
            row_params.append(c.req.sampling_params)
            row_pos.append(end)
            histories.append(_history(c.req, []))
            scored.add_output_rows(c.req, [len(logit_rows) - 1])
            scored.add_prompt_rows(c.req, i, len(ids) - c.length, c.start, end)
        gen_start = len(ids)
        draft_rows, tree_parents, rotary = [], [], list(pos)
        for req in batch.generation:
            drafts, parents = self._verified_drafts(req, k)
            draft_rows.append(drafts)
            tree_parents.append(parents)
            offsets = self.shape.row_offsets(parents, k)      # row -> rotary position - P
            rows, p = len(offsets), req.num_computed
            logit_rows += range(len(ids), len(ids) + rows)
            ids += [req.token_ids[-1]] + drafts
            pos += range(p, p + rows)            # cache positions: a chain's, for trees too
            rotary += [p + o for o in offsets]
            shift += [PLACEHOLDER] * rows
            q_lens.append(rows)
            row_params += [req.sampling_params] * rows
            row_pos += [p + o + 1 for o in offsets]
            histories += [_history(req, drafts[:j]) for j in range(rows)] \
                if req.sampling_params.has_processors else [None] * rows
            scored.add_output_rows(req, range(len(logit_rows) - rows, len(logit_rows)))
        reqs = batch.requests
        draft_reqs = drafting_requests(batch)
        dev = self.device
        as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        width = max(len(r.block_table) for r in reqs)
        block_tables = as_long([r.block_table + [0] * (width - len(r.block_table)) for r in reqs])
        positions = as_long(pos)
        max_kv = max(pos) + 1
        meta = build_attention_metadata(block_tables, q_lens, positions, self.block_size, max_kv,
                                        self.sliding_window, self.worker.attn_backend)
        if self.worker.states is not None:       # a hybrid target's recurrent-state slots
            meta.recurrent = self.worker.states.batch(batch.context, batch.generation, k, dev)
        num_drafts = len(draft_rows[0]) if draft_rows else k
        return StepInputs(
            input_ids=as_long(ids), positions=positions, meta=meta, block_tables=block_tables,
            num_ctx=len(batch.context), num_gen=len(batch.generation), k=k,
            logit_rows=as_long(logit_rows), ctx_last_rows=as_long(ctx_last), gen_start=gen_start,
            draft_ctx_rows=as_long(draft_ctx_rows), draft_reqs=as_long(draft_reqs),
            shift_ids=as_long(shift),
            draft_tokens=as_long(draft_rows).view(len(batch.generation), num_drafts),
            draft_probs=self._draft_probs(batch.generation, draft_rows, k),
            row_sampling=self._sampling_rows(row_params, row_pos),
            gen_sampling=self._sampling(batch.generation,       # positions: first drafts
                                        [r.num_computed + 1 for r in batch.generation]),
            draft_sampling=self._sampling([reqs[i] for i in draft_reqs]),
            max_kv_draft=max_kv + self.shape.draft_kv_slots(k),
            block_size=self.block_size,
            relaxed_delta=None if not self.worker.acceptor.uses_thinking_phase else torch.tensor(
                [relaxed_delta(r) for r in batch.generation], dtype=torch.float32, device=dev),
            grammar=StepGrammar(self.grammar_backend, batch, draft_rows, draft_reqs, dev)
            if StepGrammar.needed(batch) else None,
            tree=self._tree_inputs(batch, meta, tree_parents, as_long(rotary)),
            processors=build_row_processors(histories, self.eos_token_ids, dev),
            logprob_rows=scored.output_rows(dev), prompt_logprob_rows=scored.prompt_rows(dev),
        )

    def _verified_drafts(self, req: Request, k: int) -> tuple[list[int], list[int] | None]:
        """The drafts a generation request verifies this step and, for a tree, their
        parents (shape.py: a tree's padding is N nodes of PAD_DRAFT under the root)."""
        return self.shape.verified_drafts(req, k)

    def _tree_inputs(self, batch: ScheduledBatch, meta, tree_parents, rotary):
        """A tree verify's TreeInputs (the shape's), or None for a chain's (no parents)."""
        if not batch.generation or tree_parents[0] is None:
            return None
        dev = self.device
        parents = torch.tensor(tree_parents, dtype=torch.int64, device=dev)  # [Bg, N]
        base = torch.tensor([r.num_computed for r in batch.generation], device=dev)
        bc = len(batch.context)
        gen = torch.arange(bc, bc + len(batch.generation), device=dev)
        return self.shape.tree_inputs(batch.k, parents, base, meta, gen, rotary)

    def _sampling(self, reqs: list[Request], positions=None) -> SamplingTensors:
        return self._sampling_rows([r.sampling_params for r in reqs], positions)

    def _sampling_rows(self, params, positions) -> SamplingTensors:
        """Sampling tensors per row (positions: of the token each row draws, for seeded
        requests); all-greedy batches reuse cached ones (no host copies)."""
        if all(p.greedy for p in params) and not self.worker.use_rejection_sampling:
            return self.greedy(len(params))
        return SamplingTensors.build(params, positions, self.device)

    def _draft_probs(self, reqs: list[Request], draft_rows, k: int):
        """[Bg, K, V] q of each verified draft; drafts without one (padding) and those a
        host index proposed (deterministic, host_drafts.py) get a one-hot q."""
        if not self.worker.use_rejection_sampling or not reqs or k == 0:
            return None
        out = torch.zeros(len(reqs), k, self.vocab_size, device=self.device)
        for i, (req, drafts) in enumerate(zip(reqs, draft_rows)):
            q = req.features.draft_probs
            have = 0 if q is None else min(k, q.shape[0], len(req.draft_tokens))
            host = range(*host_span(req))
            for j in range(k):
                if j < have and j not in host:
                    out[i, j] = q[j]
                else:
                    out[i, j, drafts[j]] = 1.0
        return out
