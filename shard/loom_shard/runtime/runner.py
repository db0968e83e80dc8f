"""Executes the router's step plans: holds the model, the paged KV cache and per-request state.

A step reads like the plan: drop released requests, move blocks, admit new and
running requests, run one forward over the mixed batch, sample, fork.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loom_proto.config import ShardConfig
from loom_proto.snapshot import KVLayout
from loom_proto.step import (
    Fork,
    ModelInfo,
    NewRequest,
    Pooling,
    SeqOutput,
    StepPlan,
    StepResult,
    WarmupResult,
)
from loom_shard.attention.backend import BackendKind, select_backend
from loom_shard.attention.metadata import AttentionMetadata, GroupedMetadata, SeqSpan
from loom_shard.layers.packed_linear import pack_linears
from loom_shard.loading.quantize import quantized_summary
from loom_shard.lora.adapter import AdapterError
from loom_shard.lora.slots import HostAdapter, LoraSlots
from loom_shard.models.decoder import DecoderModel
from loom_shard.runtime.cuda_graphs import MAX_GRAPH_SEQS, StepGraphs, capture_step_graphs
from loom_shard.runtime.kv_cache import (
    CPU_POOL_SHARE,
    HOST_POOL_SHARE,
    KVCacheSpec,
    PagedKVCache,
    available_ram_bytes,
    blocks_for_bytes,
    blocks_for_tokens,
)
from loom_shard.runtime.kv_groups import KVGroups
from loom_shard.runtime.model_setup import (
    announce,
    choose_dtype,
    keep_freed_memory_mapped,
    load_model,
    resolve_device,
    select_cpu_kernels,
)
from loom_shard.runtime.plan_check import PlanCheck
from loom_shard.runtime.pooling import pool
from loom_shard.runtime.requests import (
    PENDING,
    PendingToken,
    RequestState,
    Scheduled,
    fork_state,
    logit_rows,
    new_request_state,
    prompt_logprobs,
)
from loom_shard.runtime.sampler import Sample, SampleTable, SeqSamplingState, reads_history, sample_on_device
from loom_shard.runtime.speculative import commit, draft_samples, regroup, sampling_states
from loom_shard.tracing import StepPhases
from loom_shard.transfers import to_device

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is queued: `ModelRunner.finish` reads its samples back and
    returns its StepResult (`result` once finished)."""

    start: float
    phases: StepPhases | None
    forward_start: float = 0.0
    outputs: list[SeqOutput] = field(default_factory=list)
    finishing: list[tuple[int, Scheduled]] = field(default_factory=list)  # (output index, sequence) sampled
    table: SampleTable | None = None
    pending: list[PendingToken] = field(default_factory=list)  # the finishing sequences' tokens, in order
    result: StepResult | None = None

    def ready(self) -> bool:
        """Are its samples on the host (finish would not wait for the device)?"""
        return self.table is None or self.table.ready()

    def wait(self) -> None:
        if self.table is not None:
            self.table.wait()


class ModelRunner:
    """One shard's executor. Build with a ShardConfig; pass `model` to skip loading (tests, benches)."""

    def __init__(self, config: ShardConfig, model: DecoderModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device, config.gpu_index)
        if self.device.type == "cpu":
            self.kernels = select_cpu_kernels(config.cpu_kernels)
        self.dtype, why = choose_dtype(config.dtype, self.device)
        announce(self.device, self.dtype, why)
        if model is None:
            model, self.weights_hash = load_model(config, self.dtype, self.device)
        else:
            self.weights_hash = "unhashed"
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if self.device.type == "cpu":
            linears = pack_linears(self.model)  # each shape's GEMM chosen (and probed) here: row-invariant
            if linears != "none":
                log.info("dense linears: %s", linears)
            keep_freed_memory_mapped()
        self.lora: LoraSlots | None = None  # --enable-lora: LoraLinear around the projections, device slots
        if config.enable_lora:
            self.lora = LoraSlots(self.model, config.max_loras_per_batch, config.max_lora_rank, config.rank,
                                  config.world_size)
        mc = self.model.config
        self.kv_groups = KVGroups.of(mc.layer_windows)
        self.kv_spec = KVCacheSpec(self.kv_groups.num_slots, self.model.num_kv_heads, mc.head_dim, config.block_size,
                                   self.dtype)
        self.attention = select_backend(self.device, self.dtype)
        self.kv_cache: PagedKVCache | None = None
        self.step_graphs: StepGraphs | None = None  # captured with the KV cache (CUDA)
        self.requests: dict[int, RequestState] = {}
        self._unfinished: deque[LaunchedStep] = deque()  # launched, in order, not finished yet
        self._last_end = 0.0  # when the last finished step ended

    @property
    def block_size(self) -> int:
        return self.kv_spec.block_size

    def info(self) -> ModelInfo:
        c = self.model.config
        return ModelInfo(
            architecture=c.architecture,
            num_layers=c.num_layers,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            max_position_embeddings=c.max_position_embeddings,
            dtype=str(self.dtype).removeprefix("torch."),
            weights_hash=self.weights_hash,
            device=str(self.device),
            block_size=self.block_size,
            rank=self.config.rank,
            world_size=self.config.world_size,
            quantization=quantized_summary(self.model),
            cpu_kernels=self.kernels.describe() if self.device.type == "cpu" else "",
            kv_group_windows=self.kv_groups.windows,
        )

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int,
                          max_step_tokens: int = MAX_GRAPH_SEQS) -> PagedKVCache:
        """The KV pools, and on CUDA the step graphs up to `max_step_tokens` (warmup: the router's
        prefill budget, which counts a step's decodes too)."""
        self.drain()
        self.kv_cache = self.step_graphs = None  # free the old pool (and graphs reading it) first
        graphs = (self.device.type == "cuda" and self.config.cuda_graphs and self.attention.kind is BackendKind.TRITON
                  and self.kv_groups.num_groups == 1)  # graphs replay one set of tables
        self.kv_cache = PagedKVCache(self.kv_spec, num_blocks, num_host_blocks, self.device, num_scratch_blocks=int(graphs))
        if graphs:
            self.step_graphs = capture_step_graphs(self.model, self.kv_cache.device_blocks, self.attention.kernel,
                                                   num_blocks, self.block_size, max_step_tokens)
        return self.kv_cache

    @torch.inference_mode()
    def warmup(self, max_prefill_tokens: int, max_batch_total_tokens: int | None = None) -> WarmupResult:
        """Run the largest prefill once, then size and allocate the KV pools.

        Device blocks: `max_batch_total_tokens` when given (else the config's), else
        free memory (CUDA: free * memory_fraction less the warmup's peak; CPU:
        cpu_kv_cache_bytes or a share of available RAM).
        """
        self.clear()
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        peak_bytes = self._dry_run(max_prefill_tokens)
        total_tokens = max_batch_total_tokens or self.config.max_batch_total_tokens
        if total_tokens is not None:  # tokens of every layer: a block per KV group for each block of tokens
            num_blocks = blocks_for_tokens(total_tokens, self.block_size) * self.kv_groups.num_groups
        else:
            num_blocks = blocks_for_bytes(self._device_pool_bytes(peak_bytes), self.kv_spec)
        host_bytes = self.config.host_kv_cache_bytes
        if host_bytes is None:
            host_bytes = int(available_ram_bytes() * HOST_POOL_SHARE)
        num_host_blocks = blocks_for_bytes(host_bytes, self.kv_spec)
        if num_blocks < blocks_for_tokens(max_prefill_tokens, self.block_size) * self.kv_groups.num_groups:
            raise ValueError(f"{num_blocks} KV blocks cannot hold a prefill of {max_prefill_tokens} tokens")
        self.allocate_kv_cache(num_blocks, num_host_blocks, max_prefill_tokens)
        return WarmupResult(num_blocks=num_blocks, num_host_blocks=num_host_blocks, block_size=self.block_size)

    def _dry_run(self, num_tokens: int) -> int:
        """The largest prefill (num_tokens) and, on CUDA, the largest decode batch (one token per
        sequence, as wide as the largest CUDA graph) into a throwaway cache, each with its logits
        and log-softmax; returns the peak activation bytes (CUDA)."""
        prefill_blocks = blocks_for_tokens(num_tokens, self.block_size)
        groups = self.kv_groups.num_groups  # every group's table the same scratch blocks
        steps = [[SeqSpan(0, num_tokens, [b for b in range(prefill_blocks) for _ in range(groups)])]]
        if self.device.type == "cuda":
            steps.append([SeqSpan(0, 1, [i] * groups) for i in range(MAX_GRAPH_SEQS)])
        scratch = PagedKVCache(self.kv_spec, max(prefill_blocks, len(steps[-1])), 0, self.device)
        for spans in steps:
            meta = self._metadata(spans)
            ids = torch.zeros(meta.num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, scratch.device_blocks, meta)
            self.model.compute_logits(hidden[-len(spans) :]).log_softmax(dim=-1)
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak

    def _device_pool_bytes(self, peak_bytes: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.memory_fraction) - peak_bytes
        if self.config.cpu_kv_cache_bytes is not None:
            return self.config.cpu_kv_cache_bytes
        return int(available_ram_bytes() * CPU_POOL_SHARE)

    def release(self, request_ids: list[int]) -> None:
        """Drop per-request state; unknown ids are ignored (the router may release twice)."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def clear(self) -> None:
        self.drain()
        self.requests.clear()

    @torch.inference_mode()
    def step(self, plan: StepPlan, phases: StepPhases | None = None) -> StepResult:
        """Run one plan. Raises ValueError (touching nothing) when the plan is inconsistent.
        `phases` (tracing on) receives the instants of the step's phases."""
        return self.finish(self.launch(plan, phases, wait=True))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, phases: StepPhases | None = None, wait: bool = False) -> LaunchedStep:
        """Queue one plan's device work without waiting for its samples (`finish` returns them), so
        that the host can prepare the next step while the device computes this one. A decode of a
        token still on the device reads it there. A plan that needs such a token's value (penalties,
        a chunk, drafts or forks over it) or moves blocks first finishes the steps before it.
        `wait`: read the samples back at once (as `step` does). Raises ValueError (touching nothing)
        when the plan is inconsistent."""
        launched = LaunchedStep(time.perf_counter(), phases)
        kv = self._require_cache()
        PlanCheck(self.requests, kv, self.model.config.vocab_size, self.kv_groups.num_groups).validate(plan)
        self._check_new(plan)
        if self._unfinished and self._needs_values(plan):
            self.drain()
        self.release(plan.released_ids)
        kv.swap_out(plan.swap_out)
        kv.swap_in(plan.swap_in)
        scheduled = self._admit(plan)
        launched.forward_start = time.perf_counter()
        if scheduled:
            self._launch(launched, scheduled, plan.allowed_token_masks, wait)
        self._unfinished.append(launched)
        return launched

    @torch.inference_mode()
    def finish(self, launched: LaunchedStep) -> StepResult:
        """A launched step's result, once its samples are on the host; the steps launched before it
        finish first."""
        while launched.result is None:
            self._finish(self._unfinished.popleft())
        return launched.result

    def drain(self) -> None:
        """Finish every launched step (before anything that reads or moves what steps write)."""
        while self._unfinished:
            self._finish(self._unfinished.popleft())

    def _needs_values(self, plan: StepPlan) -> bool:
        """Does the plan need the value of a token that an unfinished step sampled?"""
        if plan.swap_in or plan.swap_out or plan.allowed_token_masks:
            return True
        requests = self.requests
        for running in plan.running_requests:
            state = requests[running.request_id]
            if state.pending is not None and (running.num_compute != 1 or running.draft_token_ids or running.forks
                                              or reads_history(state.sampling)):
                return True
        return False

    def _check_new(self, plan: StepPlan) -> None:
        """The plan's adapters and embedding requests can run (ValueError before anything changes)."""
        for new in plan.new_requests:
            if new.pooling is Pooling.MEAN and new.num_cached:
                raise ValueError(f"request {new.request_id}: mean pooling needs every prompt token computed")
            if new.pooling is not Pooling.NONE and (new.forks or new.num_prompt_tokens != len(new.token_ids)):
                raise ValueError(f"request {new.request_id}: an embedding request has one choice and no output")
        lora_ids = {new.lora_id for new in plan.new_requests if new.lora_id is not None}
        if self.lora is None:  # then no running request names one: each was checked here when it came
            if lora_ids:
                raise ValueError("a request names a LoRA adapter; this shard serves none (--enable-lora)")
            return
        released = set(plan.released_ids)
        lora_ids |= {self.requests[r.request_id].lora_id for r in plan.running_requests
                     if r.request_id not in released and self.requests[r.request_id].lora_id is not None}
        self.lora.check(lora_ids)

    def load_lora(self, lora_id: int, path: str) -> None:
        """Read and keep an adapter (loom_shard.lora.adapter.AdapterError: a bad one, nothing changed)."""
        self.add_lora(lora_id, self.read_lora(path))

    def read_lora(self, path: str) -> HostAdapter:
        """An adapter's factors read and checked, touching no state (beside steps). Raises AdapterError."""
        if self.lora is None:
            raise AdapterError("LoRA is off on this shard: start it with --enable-lora or --lora-adapter")
        return self.lora.read(path)

    def add_lora(self, lora_id: int, adapter: HostAdapter) -> None:
        assert self.lora is not None
        self.drain()  # a launched step may still read the slot this takes
        self.lora.add(lora_id, adapter)

    def unload_lora(self, lora_id: int) -> bool:
        self.drain()
        return self.lora is not None and self.lora.unload(lora_id)

    def _require_cache(self) -> PagedKVCache:
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated: call warmup() or allocate_kv_cache() first")
        return self.kv_cache

    def _admit(self, plan: StepPlan) -> list[Scheduled]:
        # Prefill chunks first, decodes last (each in plan order): the attention batches all decodes in one call.
        chunks: list[Scheduled] = []
        decodes: list[Scheduled] = []
        for new in plan.new_requests:
            (decodes if new.num_compute == 1 else chunks).append(Scheduled(self._add(new), new.num_compute))
        requests = self.requests
        for running in plan.running_requests:
            state = requests[running.request_id]
            if running.new_block_ids:
                state.block_table.extend(running.new_block_ids)
            if running.forks:
                state.pending_forks.extend(running.forks)  # n > 1 whose prompt completes in a later chunk
            drafts = running.draft_token_ids
            if drafts:
                state.token_ids.extend(drafts)  # replaced by the kept samples (commit)
            (decodes if running.num_compute == 1 else chunks).append(Scheduled(state, running.num_compute, len(drafts)))
        return chunks + decodes

    def _add(self, new: NewRequest) -> RequestState:
        state = new_request_state(new)
        self.requests[new.request_id] = state
        return state

    def _launch(self, launched: LaunchedStep, scheduled: list[Scheduled], masks: dict[int, bytes],
                wait: bool) -> None:
        """The forward, the logits and the sampler's device work; what the step reports besides
        its samples (prompt logprobs, embeddings). Its samples are read back at once with `wait`
        or where the step makes forks or verifies drafts, else in `finish`."""
        rows, sample_rows, logprob_rows = logit_rows(scheduled)
        if any(s.state.pooling is not Pooling.NONE for s in scheduled):  # pooling reads every row
            hidden = self._forward(*_input_ids(scheduled), scheduled)
            embeddings = pool(self.model.norm, hidden, scheduled)
            hidden = _select_rows(hidden, rows)
        else:  # only the rows that need logits come out (rows may be empty)
            hidden, embeddings = self._forward(*_input_ids(scheduled), scheduled, rows), {}
        logits = self.model.compute_logits(hidden)
        if launched.phases is not None:
            self._mark_sampling(launched.phases)
        logprobs, prompt_tops = prompt_logprobs(logits, scheduled, logprob_rows)
        # A sample row: the chunk reaches its sequence's end and the request generates (no pooling)
        finishing = [(i, s) for i, s in enumerate(scheduled) if sample_rows[i] is not None]
        launched.finishing = finishing
        launched.table = self._sample(logits, [(sample_rows[i], s.state, s.num_drafts) for i, s in finishing], masks)
        launched.outputs = [SeqOutput(s.state.request_id, None, None, prompt_logprobs=lp, prompt_top_tokens=tops)
                            for s, lp, tops in zip(scheduled, logprobs, prompt_tops)]
        for i, vector in embeddings.items():
            launched.outputs[i].embedding = vector
        for s in scheduled:
            s.state.num_computed += s.num_compute - s.num_drafts  # accepted drafts: in commit
        if wait or any(s.num_drafts or s.state.pending_forks for _, s in finishing):
            self._finish_now(launched, logits, sample_rows, masks)
            return
        for row, (_, s) in enumerate(finishing):  # the values come in finish
            state = s.state
            state.token_ids.append(PENDING)
            state.pending = PendingToken(launched.table.token_ids, row, len(state.token_ids) - 1)  # type: ignore[union-attr]
            launched.pending.append(state.pending)

    def _finish_now(self, launched: LaunchedStep, logits: torch.Tensor, sample_rows: list[int | None],
                    masks: dict[int, bytes]) -> None:
        """Read the samples back now and commit them (`wait`; forks copy their parent's tokens, drafts
        are kept or dropped)."""
        samples = self._read_samples(launched)
        fork_outputs = self._fork_all(logits, launched.finishing, sample_rows, masks)
        for (_, s), smps in zip(launched.finishing, samples):
            commit(s.state, s.num_drafts, smps, self.block_size, self.kv_groups.num_groups)
        launched.outputs += fork_outputs
        launched.table = None

    def _finish(self, launched: LaunchedStep) -> None:
        if launched.table is not None:  # the sampled tokens take their places
            samples = self._read_samples(launched)
            for (_, s), pending, smps in zip(launched.finishing, launched.pending, samples):
                s.state.token_ids[pending.index] = smps[0].token_id
                if s.state.pending is pending:
                    s.state.pending = None
        end = time.perf_counter()
        phases = launched.phases
        if phases is not None:
            phases.start, phases.forward_start, phases.end = launched.start, launched.forward_start, end
        # A step launched ahead counts from the end of the one before: no time is counted twice.
        since = self._last_end
        launched.result = StepResult(launched.outputs, forward_ms=(end - max(launched.forward_start, since)) * 1e3,
                                     total_ms=(end - max(launched.start, since)) * 1e3)
        self._last_end = end

    def _read_samples(self, launched: LaunchedStep) -> list[list[Sample]]:
        """The step's samples per finishing sequence (waits for the device), into its outputs."""
        flat = launched.table.samples() if launched.table is not None else []
        samples = regroup(flat, [s.num_drafts + 1 for _, s in launched.finishing])
        for (i, _), smps in zip(launched.finishing, samples):
            output, first = launched.outputs[i], smps[0]
            output.token_id, output.logprob, output.top_tokens = first.token_id, first.logprob, list(first.top_tokens)
            if len(smps) > 1:
                output.draft_samples = draft_samples(smps)
        return samples

    def _mark_sampling(self, phases: StepPhases) -> None:
        """Where the forward ends and sampling begins; on CUDA only after the forward's kernels
        finished (one sync more per step, with tracing on only), so that the spans are true."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        phases.sample_start = time.perf_counter()

    def _forward(self, input_ids: list[int], pending: list[tuple[int, PendingToken]],
                 scheduled: list[Scheduled], rows: list[int] | None = None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden], or of the token `rows` alone: a graph replay
        where one fits, else eager; with LoRA deltas for the sequences that name an adapter.
        `pending`: (position, token) of each input still on the device."""
        spans = [s.span for s in scheduled]
        patch = _pending_patch(pending) if pending else None
        if self.lora is None:
            return self._forward_spans(input_ids, spans, patch, rows)
        lora_ids = {s.state.lora_id for s in scheduled if s.state.lora_id is not None}
        slots = self.lora.assign(lora_ids)
        self.lora.batch.prepare([(slots.get(s.state.lora_id), s.num_compute) for s in scheduled],  # type: ignore[arg-type]
                                self.lora.num_slots, self.device)
        try:
            return self._forward_spans(input_ids, spans, patch, rows)
        finally:
            self.lora.batch.clear()

    def _forward_spans(self, input_ids: list[int], spans: list[SeqSpan],
                       patch: Callable[[torch.Tensor], None] | None, rows: list[int] | None) -> torch.Tensor:
        lora_active = self.lora is not None and self.lora.batch.active
        graphs = self.step_graphs
        if graphs is not None and not lora_active and graphs.can_run(spans, len(input_ids)):
            hidden = graphs.run(input_ids, spans, patch)
            return hidden if rows is None else _select_rows(hidden, rows)
        meta = self._metadata(spans)
        if graphs is not None and meta.max_position > graphs.spec.max_position:
            self.step_graphs = None  # the rotary table grows past what the graphs captured
        ids = to_device(input_ids, self.device)
        if patch is not None:
            patch(ids)
        keep = None if rows is None or _every_row(rows, len(input_ids)) else to_device(rows, self.device)
        return self.model(ids, self._cache(), meta, keep)

    def _metadata(self, spans: list[SeqSpan]) -> AttentionMetadata | GroupedMetadata:
        """The step's attention metadata: one per KV group when layers keep their KV in groups,
        each from the group's blocks of the spans' (interleaved) block tables."""
        groups = self.kv_groups
        if groups.num_groups == 1:
            return self.attention.build_metadata(spans, self.block_size)
        metas = [self.attention.build_metadata([SeqSpan(s.num_cached, s.num_compute, groups.table(s.block_table, g))
                                                for s in spans], self.block_size)
                 for g in range(groups.num_groups)]
        return GroupedMetadata(metas, groups.layer_groups, groups.layer_slots)

    def _cache(self) -> torch.Tensor:
        return self._require_cache().device_blocks

    def _sample(self, logits: torch.Tensor, picks: list[tuple[int | None, RequestState, int]],
                masks: dict[int, bytes]) -> SampleTable | None:
        """Sample each (logits row, sequence, drafts) on the device: one row, or one per verified
        position; None when nothing is sampled."""
        rows: list[int] = []
        states: list[SeqSamplingState] = []
        for row, state, num_drafts in picks:
            assert row is not None
            rows.extend(range(row, row + num_drafts + 1))
            states.extend(sampling_states(state, num_drafts, masks.get(state.request_id) if masks else None))
        return sample_on_device(_select_rows(logits, rows), states) if rows else None

    def _fork_all(
        self, logits: torch.Tensor, finishing: list[tuple[int, Scheduled]], sample_rows: list[int | None],
        masks: dict[int, bytes],
    ) -> list[SeqOutput]:
        """Create the forks of every parent whose prompt completed; sample their first tokens."""
        parents = [(i, s.state) for i, s in finishing if s.state.pending_forks]
        forks = [(sample_rows[i], self._create_fork(parent, fork)) for i, parent in parents for fork in parent.pending_forks]
        for _, parent in parents:
            parent.pending_forks = []
        table = self._sample(logits, [(row, state, 0) for row, state in forks], masks)
        samples = table.samples() if table is not None else []
        for (_, state), smp in zip(forks, samples):
            state.token_ids.append(smp.token_id)
        return [_output(state.request_id, smp, []) for (_, state), smp in zip(forks, samples)]

    def _create_fork(self, parent: RequestState, fork: Fork) -> RequestState:
        num_tokens, groups = len(parent.token_ids), self.kv_groups.num_groups
        last = (num_tokens - 1) // self.block_size
        if num_tokens % self.block_size:  # the partly filled last block, each group's
            entries = range(last * groups, (last + 1) * groups)
            pairs = [(parent.block_table[i], fork.block_table[i]) for i in entries
                     if parent.block_table[i] != fork.block_table[i]]
            self._require_cache().copy(pairs)
        state = fork_state(parent, fork)
        self.requests[fork.request_id] = state
        return state

    # ---- snapshots: KV bytes of one sequence, to and from host memory -------------------

    @torch.inference_mode()  # the cache is an inference tensor (allocated by warmup)
    def read_kv(self, block_ids: list[int], num_tokens: int) -> tuple[KVLayout, memoryview]:
        """A host copy of the first num_tokens tokens' KV in block_ids, as raw bytes."""
        kv = self._require_cache()
        self._check_one_group()
        _check_block_ids(block_ids, kv.num_blocks)
        self.drain()
        if not 0 < num_tokens <= len(block_ids) * self.block_size:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens")
        host = kv.read_blocks(block_ids, num_tokens).contiguous()  # [layers, 2, tokens, kv_heads, head_dim]
        spec = self.kv_spec
        layout = KVLayout(spec.num_layers, num_tokens, spec.num_kv_heads, spec.head_dim, _dtype_name(self.dtype))
        return layout, memoryview(host.view(torch.uint8).numpy()).cast("B")

    @torch.inference_mode()  # the cache is an inference tensor (allocated by warmup)
    def write_kv(self, block_ids: list[int], block_indices: list[int], layout: KVLayout, kv: memoryview) -> None:
        """Write full blocks of a sequence's KV (laid out as `read_kv` returns it) into
        block_ids: block_ids[i] gets tokens [b * block_size, (b + 1) * block_size), b = block_indices[i]."""
        cache = self._require_cache()
        self._check_one_group()
        _check_block_ids(block_ids, cache.num_blocks)
        self.drain()
        spec, bs = self.kv_spec, self.block_size
        if (layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim) != (
                _dtype_name(self.dtype), spec.num_layers, spec.num_kv_heads, spec.head_dim):
            raise ValueError(f"KV layout {layout} does not fit this shard's cache {spec}")
        if len(block_ids) != len(block_indices) or any(not 0 <= b < layout.num_tokens // bs for b in block_indices):
            raise ValueError(f"block indices {block_indices} do not match {len(block_ids)} full blocks "
                             f"of {layout.num_tokens} tokens")
        tokens = torch.frombuffer(kv, dtype=self.dtype).view(layout.shape)
        positions = (torch.tensor(block_indices, dtype=torch.long)[:, None] * bs + torch.arange(bs)).flatten()
        cache.write_blocks(block_ids, tokens[:, :, positions])

    def _check_one_group(self) -> None:
        if self.kv_groups.num_groups > 1:  # sliding layers' early KV is gone once out of their window
            raise ValueError("KV snapshots are not supported for models with sliding-window layers")


def _input_ids(scheduled: list[Scheduled]) -> tuple[list[int], list[tuple[int, PendingToken]]]:
    """The tokens each sequence computes this step, in order (a decode's one token without a slice:
    this runs for every sequence of every step), and (position, token) of each decode whose token
    is still on the device (0 in its place)."""
    ids: list[int] = []
    pending: list[tuple[int, PendingToken]] = []
    for s in scheduled:
        state = s.state
        if s.num_compute == 1:
            token = state.token_ids[state.num_computed]
            if token == PENDING:
                assert state.pending is not None and state.pending.index == state.num_computed
                pending.append((len(ids), state.pending))
                token = 0
            ids.append(token)
        else:
            ids += state.token_ids[state.num_computed : state.num_computed + s.num_compute]
    return ids, pending


def _pending_patch(pending: list[tuple[int, PendingToken]]) -> Callable[[torch.Tensor], None]:
    """Writes each pending token from its step's sampled ids into a step's input ids, on the device."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # per step's sampled ids: positions, rows
    for position, token in pending:
        values, positions, rows = groups.setdefault(id(token.values), (token.values, [], []))
        positions.append(position)
        rows.append(token.row)

    def patch(ids: torch.Tensor) -> None:
        for values, positions, rows in groups.values():
            ids[to_device(positions, ids.device)] = values[to_device(rows, values.device)]

    return patch


def _every_row(rows: list[int], num_rows: int) -> bool:
    """rows are all of num_rows rows in order (an all-decode step)."""
    return len(rows) == num_rows and rows == list(range(num_rows))


def _select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows]; x itself when rows are all of its rows in order, which saves a copy of up to
    [batch, vocab] float32 per use."""
    return x if _every_row(rows, x.shape[0]) else x[to_device(rows, x.device)]


def _check_block_ids(block_ids: list[int], num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} outside 0..{num_blocks - 1}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _output(request_id: int, smp: Sample, prompt_logprobs: list[float]) -> SeqOutput:
    return SeqOutput(request_id, smp.token_id, smp.logprob, list(smp.top_tokens), prompt_logprobs)
