"""Deliberately broken plugins: the conformance suites must fail on each of them.

Each is a small change to a correct built-in, of the kind a plugin author could make by
mistake. ``test_suites_catch_bugs.py`` runs the suites on them with pytester.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F

from vlite.core.attention import AttentionMetadata
from vlite.core.hookspecs import hookimpl
from vlite.core.outputs import ModelRunnerOutput
from vlite.core.request import RequestStatus
from vlite.core.scheduler import Scheduler
from vlite.plugins.attention.torch_ref import TorchAttentionBackend, causal_mask
from vlite.plugins.executors.uniproc import UniprocExecutor
from vlite.plugins.samplers.default import DefaultSampler
from vlite.plugins.schedulers.fcfs import FcfsPolicy

#: How long the hanging executors wait before giving up (far beyond the suite's timeout).
HANG_S = 60.0
#: Set by the tests after a run, to end the threads the hanging executors left behind.
RELEASE = threading.Event()


class Api1FcfsScheduler(Scheduler):
    """FCFS written the plugin-API-1 way (a Scheduler subclass), which can override the
    mechanism itself, and so break it."""

    def waiting_sort_key(self, request):
        return (request.arrival_index,)

    def choose_victim(self, running):
        return running[-1]


class NewestArrivalVictimPolicy(FcfsPolicy):
    """Preempts "the newest request", remembered from the queue, which may not be running."""

    newest = None

    def waiting_sort_key(self, request):
        self.newest = request
        return super().waiting_sort_key(request)

    def choose_victim(self, running):
        return self.newest


class BudgetOverrunningScheduler(Api1FcfsScheduler):
    """Schedules a request's pending tokens whether or not they fit what is left."""

    def num_tokens_to_schedule(self, request, num_pending, budget):
        return num_pending


class AbortLeakingScheduler(Api1FcfsScheduler):
    """Forgets to give an aborted request's blocks back to the cache."""

    def _release(self, request):
        if request.status is RequestStatus.FINISHED_ABORTED:
            del self.requests[request.request_id]
            self._finished_since_last_step.append(request.request_id)
            return
        super()._release(request)


class LastCachedBlockDroppingBackend(TorchAttentionBackend):
    """Leaves the last full block of a cached prefix out when new tokens attend to it."""

    def _prefill(self, query, kv_cache, block_table, seq_len, window=None, soft_cap=None):
        query_len = query.shape[0]
        num_cached_blocks = (seq_len - query_len) // self.block_size
        if num_cached_blocks == 0 or window is not None or soft_cap is not None:
            return super()._prefill(query, kv_cache, block_table, seq_len, window, soft_cap)
        num_blocks = -(-seq_len // self.block_size)
        keys, values = self._gather_context(kv_cache, block_table[None], num_blocks)
        keys = keys[:, :, :seq_len].to(query.dtype)
        values = values[:, :, :seq_len].to(query.dtype)
        mask = causal_mask(query_len, seq_len, query.device).clone()
        mask[:, (num_cached_blocks - 1) * self.block_size : num_cached_blocks * self.block_size] = 0
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_queries_per_kv > 1,
        )
        return out.squeeze(0).transpose(0, 1)


class ScaleIgnoringBackend(TorchAttentionBackend):
    """Uses ``head_dim ** -0.5`` whatever scale it was built with."""

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, block_size) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size)


class PerSequenceWritingBackend(TorchAttentionBackend):
    """Writes each sequence's keys just before attending it, the last sequence first: right
    while sequences own their blocks, wrong when they share them (draft positions)."""

    def forward(self, query, key, value, kv_cache, metadata, **options):
        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        for i in reversed(range(metadata.num_seqs)):
            rows = slice(starts[i], starts[i + 1])
            num_rows = starts[i + 1] - starts[i]
            one = AttentionMetadata(
                slot_mapping=metadata.slot_mapping[rows],
                query_start_loc=torch.tensor([0, num_rows], dtype=torch.int32),
                seq_lens=metadata.seq_lens[i : i + 1],
                block_tables=metadata.block_tables[i : i + 1],
                max_query_len=num_rows,
                max_seq_len=metadata.seq_lens_cpu[i],
                query_lens_cpu=[num_rows],
                seq_lens_cpu=[metadata.seq_lens_cpu[i]],
            )
            out[rows] = super().forward(
                query[rows], key[rows], value[rows], kv_cache, one, **options
            )
        return out


class WindowIgnoringBackend(TorchAttentionBackend):
    """Claims sliding windows, then attends over the whole context."""

    def forward(self, *args, sliding_window=None, logits_soft_cap=None):
        return super().forward(*args, logits_soft_cap=logits_soft_cap)


class SoftCapIgnoringBackend(TorchAttentionBackend):
    """Claims the logit soft cap, then leaves the scores uncapped."""

    def forward(self, *args, sliding_window=None, logits_soft_cap=None):
        return super().forward(*args, sliding_window=sliding_window)


class KeysInBfloat16Backend(TorchAttentionBackend):
    """Claims a float16 KV cache, but rounds the keys through bfloat16 (8 bits of mantissa
    instead of 11) before writing them."""

    kv_cache_dtypes = (torch.float16,)

    @staticmethod
    def write_kv(key, value, kv_cache, slot_mapping):
        if kv_cache.dtype == torch.float16:
            key = key.bfloat16()
        TorchAttentionBackend.write_kv(key, value, kv_cache, slot_mapping)


class TopKIgnoringSampler(DefaultSampler):
    """Samples as if no row used top-k."""

    def sample(self, logits: torch.Tensor, metadata) -> torch.Tensor:
        return super().sample(logits, dataclasses.replace(metadata, has_top_k=False))


class Int32TokensSampler(DefaultSampler):
    """Returns its tokens as int32 instead of int64."""

    def sample(self, logits: torch.Tensor, metadata) -> torch.Tensor:
        return super().sample(logits, metadata).to(torch.int32)


class HostListGraphBackend(TorchAttentionBackend):
    """Claims CUDA graphs, yet reads each step's lengths from the metadata's host lists
    (which a replayed graph never rewrites)."""

    supports_cuda_graphs = True


class WrongTokensExecutor(UniprocExecutor):
    """Reports each sampled token off by one."""

    def sample_tokens(self) -> ModelRunnerOutput:
        output = super().sample_tokens()
        return ModelRunnerOutput(
            {rid: [t + 1 for t in tokens] for rid, tokens in output.sampled_token_ids.items()}
        )


class HangingExecutor(UniprocExecutor):
    """Loses a failed forward pass and then waits for a result that never comes, as a
    multi-process executor waiting on a dead worker's reply would."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.has_failed = False

    def execute_model(self, scheduler_output) -> None:
        try:
            super().execute_model(scheduler_output)
        except Exception:
            self.has_failed = True

    def sample_tokens(self) -> ModelRunnerOutput:
        if self.has_failed:
            RELEASE.wait(HANG_S)
            raise RuntimeError("gave up waiting")
        return super().sample_tokens()


class ThreadLeakingExecutor(UniprocExecutor):
    """Starts a helper thread that its shutdown() never stops."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        threading.Thread(target=RELEASE.wait, args=(HANG_S,), daemon=True).start()


@hookimpl
def register_schedulers(register) -> None:
    register("budget-overrunning", BudgetOverrunningScheduler)
    register("abort-leaking", AbortLeakingScheduler)
    register("newest-arrival-victim", NewestArrivalVictimPolicy)


@hookimpl
def register_attention_backends(register) -> None:
    register("last-cached-block-dropping", LastCachedBlockDroppingBackend)
    register("scale-ignoring", ScaleIgnoringBackend)
    register("per-sequence-writing", PerSequenceWritingBackend)
    register("window-ignoring", WindowIgnoringBackend)
    register("soft-cap-ignoring", SoftCapIgnoringBackend)
    register("host-list-graph", HostListGraphBackend)
    register("keys-in-bfloat16", KeysInBfloat16Backend)


@hookimpl
def register_samplers(register) -> None:
    register("top-k-ignoring", TopKIgnoringSampler)
    register("int32-tokens", Int32TokensSampler)


@hookimpl
def register_executors(register) -> None:
    register("wrong-tokens", WrongTokensExecutor)
    register("hanging", HangingExecutor)
    register("thread-leaking", ThreadLeakingExecutor)
