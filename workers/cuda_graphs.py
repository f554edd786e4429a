"""CUDA graphs for pure-decode steps: one captured forward (+ lm_head) per decode batch size.

A step where every scheduled request has exactly one token (query_len == 1 for all) and at
most max(batch_sizes) requests runs on STATIC input buffers, padded to the smallest captured
size that fits; any other step (prefill chunks, mixed, larger batches) runs eagerly as before.

    real rows   [0, n):  the step's input ids, positions, slots, block tables, seq lens
    padding     [n, b):  token 0 at position 0, slot 0 (block 0, the scheduler's null block),
                         seq_len 1, block table all zeros, one query each
                         -> each padding row writes its k/v into block 0 and reads only block 0

Block 0 is never handed to a request, and a real row reads only the pages of its own table
that cover its seq_len, so padding never touches a real request's KV and real rows never
read what padding wrote. Padding outputs are dropped: only the step's logits rows are returned.

capture=True (GPU, triton attention: its launchers never sync with the host) captures a
torch.cuda.CUDAGraph per size at construction and replays it. capture=False runs the same
forward eagerly on the same padded static buffers: the CPU test of the buffer and padding
logic (torch_ref syncs on .tolist(), so it cannot be captured).
"""

from __future__ import annotations

import torch

from workers.model import AttentionMetadata, KVCache, PagedLlamaModel

TRITON_MODULE = "workers.kernels.triton_attention"
PADDING_SLOT = 0  # slot 0 of block 0 (null block); torch_ref's index_copy_ rejects negative slots


class DecodeGraphs:
    def __init__(self, model: PagedLlamaModel, kv_caches: list[KVCache], batch_sizes: tuple[int, ...],
                 max_blocks_per_seq: int, *, capture: bool):
        sizes = tuple(sorted(set(batch_sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"cuda_graph_batch_sizes must be positive ints, got {batch_sizes!r}")
        if capture and (model.device.type != "cuda" or model.attention.__name__ != TRITON_MODULE):
            raise ValueError(
                "cuda_graph_batch_sizes needs device cuda and attention_backend triton, got device "
                f"{model.device.type} and attention module {model.attention.__name__}"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sizes
        self.max_batch_size = sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.capture = capture
        self.replays: dict[int, int] = dict.fromkeys(sizes, 0)  # padded size -> steps run at it
        device, size = model.device, self.max_batch_size
        # static buffers for the largest size; each captured size uses a prefix of them
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)  # [max_bs]
        self.positions = torch.zeros(size, dtype=torch.long, device=device)  # [max_bs]
        self.slot_mapping = torch.full((size,), PADDING_SLOT, dtype=torch.long, device=device)  # [max_bs]
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)  # [max_bs, max_blocks]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)  # [max_bs + 1], 1 query each
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)  # [max_bs]
        # per-size views, made once: the same tensor objects every step (torch_ref caches its plan by identity)
        self._views = {b: self._views_for(b) for b in sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # size -> [size, vocab] fp32 output of the graph
        if capture:
            self._capture_all()

    def _views_for(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
        )
        return self.input_ids[:b], self.positions[:b], metadata

    def padded_size(self, num_tokens: int, num_seqs: int) -> int | None:
        """The captured size a step runs at, or None for eager (not pure decode, or too big)."""
        if num_tokens != num_seqs or num_seqs > self.max_batch_size:
            return None
        return next(b for b in self.batch_sizes if b >= num_seqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            size: int) -> torch.Tensor:
        """A pure-decode step's inputs (n tokens, n sequences) -> fp32 logits [n, vocab] of its rows."""
        n = input_ids.shape[0]
        width = min(metadata.block_tables.shape[1], self.max_blocks_per_seq)  # pages past max_model_len are never read
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.block_tables[:n, :width].copy_(metadata.block_tables[:, :width])
        self.block_tables[:n, width:].zero_()
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self._reset_padding(n, size)
        self.replays[size] += 1
        if self.capture:
            self._graphs[size].replay()
            return self._logits[size][:n]
        return self._forward(size)[:n]

    def _reset_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding (see the module docstring). query_start_loc never changes."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(PADDING_SLOT)
        self.block_tables[start:end].zero_()
        self.seq_lens[start:end].fill_(1)

    def _forward(self, size: int) -> torch.Tensor:
        input_ids, positions, metadata = self._views[size]
        with torch.inference_mode():
            hidden = self.model.forward(input_ids, positions, metadata, self.kv_caches)
            return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        """Warm up every size on a side stream (Triton compiles per specialization), then
        capture the largest first so smaller graphs reuse its memory pool. The buffers hold
        padding only, so warmup and capture write block 0 and nothing else."""
        self._reset_padding(0, self.max_batch_size)
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for size in self.batch_sizes:
                for _ in range(2):
                    self._forward(size)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        torch.cuda.synchronize(self.model.device)
        pool = None
        for size in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(self.model.device)
