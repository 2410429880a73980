"""Token sampling on rank 0 only: greedy, temperature, top-k, top-p; every draw seeded per request.

Sampling on one rank and sending the tokens in the next plan keeps every rank's sequences
identical without having to keep random generators in step across ranks.

Determinism rule: a row's token is a function of its own logits, its own parameters, its seed and
its counter (the index of the token within the request's output) only. The noise is a counter-based
hash (kernels/sampling_noise.py, kernels/reference.py), not generator state, and the path a row
takes (`path_of`: greedy, top-k by topk, larger top-k by sort, top-p rejection, plain race) depends
on its own parameters alone, so neither its neighbours in the batch nor how steps were batched,
preempted or planned ahead can change its draws.

No path waits for the GPU (async scheduling overlaps the next step's planning with this one): the
shapes come from the rows' parameters on the host, and every data-dependent decision (a top-p
row's rejections and its fallback) is taken on the device, in one Triton program per row on CUDA
(`kernels.sampling_noise.nucleus_sample`). The torch top-p path below (`_sample_nucleus`) is the
CPU path and the kernel's reference: the same rounds, noise and cut, token for token. Likewise top-k
rows (k up to `top_k_sample.TOP_K_KERNEL_MAX`, with or without top-p) take one Triton kernel pair on
CUDA (`kernels.top_k_sample`: one read of the logits, keys from the step's one packed copy, and a
sampler-graph kind for uniform batches of k up to GRAPH_TOP_K_MAX); `_sample_top_k` is their CPU path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spmd_engine.executor.device_copy import to_device_async
from spmd_engine.kernels.reference import NUCLEUS_MASS_ONE, gumbel_noise_at_reference, gumbel_noise_reference

# below this, logits / temperature overflow float32: such rows are greedy (their limit anyway)
MIN_TEMPERATURE = 1e-5
NUCLEUS_ROUNDS = 6  # rejection rounds before the exact fallback (most rows finish in the first)
SORT_ROUND = NUCLEUS_ROUNDS  # the noise round of the nucleus fallback (rounds 0.. are the rejections)
# top-k rows with k up to this take `topk` (cheap for small k); larger k sort the vocabulary
TOP_K_FAST_MAX = 1024
_UINT64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """What the sampler needs of one request (rows align with the logits rows)."""

    seq_id: int
    temperature: float
    top_p: float
    top_k: int  # -1 or 0 = off
    seed: int  # the request's noise seed (any int; its low 64 bits count)
    counter: int  # index of the token being drawn within the request's output (0 = the first)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def seed_bits(seed: int) -> int:
    """A seed's low 64 bits as a signed int64 (what the noise kernels take)."""
    bits = int(seed) & _UINT64
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def request_seed(engine_seed: int, generation: int, index: int) -> int:
    """The noise seed of a request without `sampling.seed`: drawn from a numpy generator keyed by the
    engine `seed`, the generate call (the engine's step count when it began) and the request's index,
    so a whole job is reproducible for a fixed engine seed, a resumed job draws what the first run
    would have, and two generate calls of one engine differ. Returns a uint64 value."""
    entropy = [int(engine_seed) & _UINT64, int(generation), int(index) & _UINT64]
    # = default_rng(entropy).integers(0, 1 << 64, dtype=np.uint64): a full-range uint64 draw is the bit
    # generator's next raw output (numpy's bounded-integer code returns it as is); without the Generator
    return int(np.random.PCG64(entropy).random_raw())


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, round_: int, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 Gumbel noise of the rows' (seed, counter, round) streams: Triton on CUDA,
    the reference (the same hash bit for bit) elsewhere."""
    if seeds.device.type == "cuda":
        from spmd_engine.kernels.sampling_noise import gumbel_noise as triton_gumbel_noise
        return triton_gumbel_noise(seeds, counters, round_, vocab)
    return gumbel_noise_reference(seeds, counters, round_, vocab)


def gumbel_noise_at(seeds: torch.Tensor, counters: torch.Tensor, round_: int, cols: torch.Tensor) -> torch.Tensor:
    """`gumbel_noise(seeds, counters, round_, vocab).gather(1, cols)` without the [N, vocab] noise."""
    if seeds.device.type == "cuda":
        from spmd_engine.kernels.sampling_noise import gumbel_noise_at as triton_gumbel_noise_at
        return triton_gumbel_noise_at(seeds, counters, round_, cols)
    return gumbel_noise_at_reference(seeds, counters, round_, cols)


def _host_to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor of `values` on `device`, without waiting for the GPU."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)


# path codes of SamplingBatch.paths(), in the order the groups are sampled
PATHS = ("greedy", "top_k", "top_k_sort", "top_p", "plain")
_GREEDY, _TOP_K, _TOP_K_SORT, _TOP_P, _PLAIN = range(len(PATHS))
_ALIGN_ROWS = 4  # every packed section starts 16 bytes aligned (4 float32 / 2 int64 entries)
_SECTIONS = 5  # a group's key sections before its row indices: seeds, counters, float32 pairs, top_k, top_p


@dataclass
class SamplingBatch:
    """A step's sampling rows as columns (host numpy arrays, rows align with the logits rows).

    Why: the engine gathers them once per step from per-request constants, the sampler groups the
    rows by path with a few array comparisons and sends each group's keys in one host-to-device copy;
    a Python object per row and per-row `path_of` calls cost ~0.2 ms per step at 216 rows."""

    seeds: np.ndarray  # [N] int64: `seed_bits` of each row's seed
    counters: np.ndarray  # [N] int64: index of the drawn token within the request's output
    temperatures: np.ndarray  # [N] float64 (float32 on the device, as before)
    top_p: np.ndarray  # [N] float64
    top_k: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return int(self.seeds.shape[0])

    @classmethod
    def from_rows(cls, rows: list[SamplingRow]) -> "SamplingBatch":
        return cls(np.array([seed_bits(r.seed) for r in rows], dtype=np.int64),
                   np.array([r.counter for r in rows], dtype=np.int64),
                   np.array([r.temperature for r in rows], dtype=np.float64),
                   np.array([r.top_p for r in rows], dtype=np.float64),
                   np.array([r.top_k for r in rows], dtype=np.int64))

    def paths(self) -> np.ndarray:
        """[N] int8 codes into PATHS: `path_of` of every row, as array comparisons (the same tests in
        the same order: greedy, then top-k, then top-p, else plain)."""
        code = np.full(len(self), _PLAIN, dtype=np.int8)
        top_p = self.top_p < 1.0
        code[top_p] = _TOP_P
        code[self.top_k > 0] = _TOP_K
        code[self.top_k > TOP_K_FAST_MAX] = _TOP_K_SORT
        code[self.temperatures < MIN_TEMPERATURE] = _GREEDY
        return code


@dataclass
class _GroupKeys:
    """One group's rows on the device, from the step's one packed copy."""

    seeds: torch.Tensor  # [M] int64
    counters: torch.Tensor  # [M] int64
    temperatures: torch.Tensor  # [M] float32
    top_p: torch.Tensor  # [M] float32
    index: torch.Tensor | None  # [M] int64: the group's rows of the batch (None: all rows, in order)
    top_k: torch.Tensor | None = None  # [M] int64 (the top-k kernel's keys)
    top_p64: torch.Tensor | None = None  # [M] float64: top_p as the host holds it (the top-k nucleus cut)


def _pack_groups(batch: SamplingBatch, groups: list[np.ndarray | None]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One int64 host buffer holding, per group, its seeds, counters, float32 temperatures and top_p,
    top_k, float64 top_p (the top-k kernel's keys: 16 bytes a row more, no copy of their own) and (for a
    selection of rows) its row indices; returns it and each group's (offset, rows). Every
    section starts 16-byte aligned whatever the row counts: Triton specialises pointers on 16-byte
    alignment, and counters 8 bytes off (an odd count) compiled new kernel variants mid-job."""
    layout, words = [], 0
    for members in groups:
        m = len(batch) if members is None else len(members)
        m4 = -(-m // _ALIGN_ROWS) * _ALIGN_ROWS
        layout.append((words, m))
        words += _SECTIONS * m4 + (m4 if members is not None else 0)  # seeds, counters, 2 x float32, k, p, index
    buf = np.zeros(words, dtype=np.int64)
    for (at, m), members in zip(layout, groups):
        m4 = -(-m // _ALIGN_ROWS) * _ALIGN_ROWS
        sel = slice(None) if members is None else members
        buf[at:at + m] = batch.seeds[sel]
        buf[at + m4:at + m4 + m] = batch.counters[sel]
        floats = buf[at + 2 * m4:at + 3 * m4].view(np.float32)
        floats[:m] = batch.temperatures[sel]  # float64 -> float32 rounds to nearest, as torch.tensor did
        floats[m4:m4 + m] = batch.top_p[sel]
        buf[at + 3 * m4:at + 3 * m4 + m] = batch.top_k[sel]
        buf[at + 4 * m4:at + 4 * m4 + m].view(np.float64)[:] = batch.top_p[sel]
        if members is not None:
            buf[at + _SECTIONS * m4:at + _SECTIONS * m4 + m] = members
    return buf, layout


def _unpack_group(keys: torch.Tensor, at: int, m: int, selected: bool) -> _GroupKeys:
    m4 = -(-m // _ALIGN_ROWS) * _ALIGN_ROWS
    floats = keys[at + 2 * m4:at + 3 * m4].view(torch.float32)
    index = keys[at + _SECTIONS * m4:at + _SECTIONS * m4 + m] if selected else None
    return _GroupKeys(keys[at:at + m], keys[at + m4:at + m4 + m], floats[:m], floats[m4:m4 + m], index,
                      keys[at + 3 * m4:at + 3 * m4 + m], keys[at + 4 * m4:at + 5 * m4].view(torch.float64)[:m])


class _KeyStaging:
    """The sampler's keys on their way to the device: one pinned host buffer, reused step after step
    (CUDA; elsewhere the packed array is used as is). It is reused only once the copy out of it is
    done (in the step loop the previous step's token readback has already waited for it); while that
    copy is still queued a fresh buffer is taken instead, so the host never waits for the GPU here
    (the caching host allocator keeps the old one until its copy has run)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._stream: torch.cuda.Stream | None = None  # the copies into a static buffer (made on first use)

    def put(self, packed: np.ndarray, into: torch.Tensor | None = None,
            after: torch.cuda.Event | None = None) -> torch.Tensor:
        """`packed` (int64 [n]) on the device: a new tensor, or copied into `into` (an int64 [n] device
        tensor, e.g. a CUDA graph's static key buffer) and returned. `after` (with `into`, CUDA): the
        event recorded after `into`'s last reader; the copy then runs on a stream of its own after that
        event alone, so it overlaps the forward in flight instead of waiting behind it, and the current
        stream waits for the copy only."""
        n = packed.shape[0]
        if into is not None and (into.dtype != torch.int64 or into.shape != (n,)):
            raise ValueError(f"key staging: into must be int64 [{n}], got {into.dtype} {tuple(into.shape)}")
        if self._copied is None:
            keys = torch.from_numpy(packed)
            return keys.to(self.device) if into is None else into.copy_(keys)
        if self._host is None or self._host.shape[0] < n or not self._copied.query():
            self._host = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
        self._host[:n].numpy()[:] = packed
        if into is None:
            keys = self._host[:n].to(self.device, non_blocking=True)
        elif after is not None and not torch.cuda.is_current_stream_capturing():
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_event(after)
            with torch.cuda.stream(self._stream):
                keys = into.copy_(self._host[:n], non_blocking=True)
            self._copied.record(self._stream)
            torch.cuda.current_stream(self.device).wait_event(self._copied)
            return keys
        else:
            keys = into.copy_(self._host[:n], non_blocking=True)
        self._copied.record()
        return keys


class Sampler:
    """Draws one token per logits row; stateless (each row carries its seed and counter)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging = _KeyStaging(device)
        # CUDA: the keys' persistent device buffer and the event after its last reader (the last draw), so a
        # step's key copy runs beside the forward in flight instead of between it and this draw
        self._device_keys: torch.Tensor | None = None
        self._keys_read = torch.cuda.Event() if device.type == "cuda" else None

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow] | SamplingBatch) -> np.ndarray:
        """logits [N, V] float32 -> token ids [N] (numpy int64)."""
        return self.sample_on_device(logits, rows).cpu().numpy()

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, rows: list[SamplingRow] | SamplingBatch) -> torch.Tensor:
        """logits [N, V] -> token ids [N] int64 on the logits' device, queued without waiting for the
        GPU on every path (async scheduling keeps its overlap): the shapes and the group of each row
        are known on the host from the rows' parameters, every data-dependent choice is made on the
        device.

        Rows are grouped by their own parameters only (`path_of`): greedy (argmax), top-k up to
        TOP_K_FAST_MAX (topk), larger top-k (sort), top-p alone (rejection), plain temperature (race).
        Every group's keys go to the device in one packed copy."""
        tokens = self._draw(logits, rows)
        if self._keys_read is not None:  # every reader of the device keys is queued
            self._keys_read.record()
        return tokens

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow] | SamplingBatch) -> torch.Tensor:
        batch = rows if isinstance(rows, SamplingBatch) else SamplingBatch.from_rows(rows)
        codes = batch.paths()
        n = len(batch)
        if n and (codes == codes[0]).all():  # the common case: one kind, no row selection
            if codes[0] == _GREEDY:
                return sample_uniform("greedy", logits, None, None, None)
            keys = self._keys(batch, [None])[0]
            if codes[0] == _PLAIN:  # what the sampler graphs (executor/sampler_graphs.py) replay
                return sample_uniform("plain", logits, keys.temperatures, keys.seeds, keys.counters)
            kind = PATHS[codes[0]]  # the top-k kernel reads bf16 logits as they are
            return self._sample_group(kind, logits if kind == "top_k" else logits.float(), batch, keys)
        kinds = [k for k in range(_TOP_K, len(PATHS)) if (codes == k).any()]
        out = logits.argmax(dim=-1)
        if not kinds:
            return out
        members = [np.flatnonzero(codes == k) for k in kinds]
        for kind, rows_of, keys in zip(kinds, members, self._keys(batch, members)):
            group = SamplingBatch(batch.seeds[rows_of], batch.counters[rows_of], batch.temperatures[rows_of],
                                  batch.top_p[rows_of], batch.top_k[rows_of])
            out[keys.index] = self._sample_group(PATHS[kind], logits.index_select(0, keys.index).float(), group, keys)
        return out

    def _keys(self, batch: SamplingBatch, groups: list[np.ndarray | None]) -> list[_GroupKeys]:
        packed, layout = _pack_groups(batch, groups)
        n = packed.shape[0]
        if self._keys_read is None:
            keys = self._staging.put(packed)
        elif self._device_keys is None or self._device_keys.shape[0] < n:
            # a new block may be one the compute stream still reads: copy on that stream this once
            self._device_keys = torch.empty(max(n, 1024), dtype=torch.int64, device=self.device)
            keys = self._staging.put(packed, into=self._device_keys[:n])
        else:
            keys = self._staging.put(packed, into=self._device_keys[:n], after=self._keys_read)
        return [_unpack_group(keys, at, m, members is not None) for (at, m), members in zip(layout, groups)]

    @staticmethod
    def _sample_group(kind: str, logits: torch.Tensor, batch: SamplingBatch, keys: _GroupKeys) -> torch.Tensor:
        dev = logits.device
        seeds, counters, temps = keys.seeds, keys.counters, keys.temperatures
        if kind == "plain":
            return _sample_plain(logits, temps, seeds, counters)
        if kind == "top_p" and dev.type == "cuda":  # one program per row: rejection and fallback on the GPU
            from spmd_engine.kernels.sampling_noise import nucleus_sample
            return nucleus_sample(logits.contiguous(), temps, keys.top_p, seeds, counters, NUCLEUS_ROUNDS)
        if kind == "top_k":
            if dev.type == "cuda":
                return _sample_top_k_cuda(logits, batch, keys)
            return _sample_top_k(logits.float(), temps, batch.top_k.tolist(), batch.top_p.tolist(), seeds, counters)
        z = logits / temps[:, None]  # a true division: CUDA divides by a scalar as a multiply by the
        # reciprocal, which would round otherwise than another batch's per-row division
        if kind == "top_k_sort":
            return _race(_apply_top_k_top_p(z, batch.top_k.tolist(), batch.top_p.tolist()), seeds, counters, 0)
        return _sample_nucleus(z, keys.top_p, seeds, counters)


def _sample_top_k_cuda(logits: torch.Tensor, batch: SamplingBatch, keys: _GroupKeys) -> torch.Tensor:
    """The top-k group on CUDA: rows of k up to TOP_K_KERNEL_MAX by the Triton kernel
    (kernels/top_k_sample.py: one read of the logits, no host-to-device copy beyond the keys), larger k by
    `_sample_top_k`. Which one a row takes depends on its own k alone (the determinism rule; the two
    draw the same token, ties included)."""
    from spmd_engine.kernels.top_k_sample import TOP_K_KERNEL_MAX, k_cap_for, top_k_sample
    wide = batch.top_k > TOP_K_KERNEL_MAX
    if not wide.any():
        return top_k_sample(logits, keys.temperatures, keys.top_k, keys.top_p64, keys.seeds, keys.counters,
                            k_cap_for(int(batch.top_k.max())))
    if wide.all():
        return _sample_top_k(logits.float(), keys.temperatures, batch.top_k.tolist(), batch.top_p.tolist(),
                             keys.seeds, keys.counters)
    out = torch.empty(len(batch), dtype=torch.int64, device=logits.device)
    for rows in (np.flatnonzero(~wide), np.flatnonzero(wide)):
        index = _host_to(rows.tolist(), torch.int64, logits.device)
        sub = SamplingBatch(batch.seeds[rows], batch.counters[rows], batch.temperatures[rows], batch.top_p[rows],
                            batch.top_k[rows])
        part = _GroupKeys(*(t.index_select(0, index) for t in (keys.seeds, keys.counters, keys.temperatures,
                                                                keys.top_p)), None,
                          keys.top_k.index_select(0, index), keys.top_p64.index_select(0, index))
        out[index] = _sample_top_k_cuda(logits.index_select(0, index), sub, part)
    return out


# the paths a whole batch can take with one fixed sequence of launches (no row selection): the sampler
# graphs' kinds (executor/sampler_graphs.py)
UNIFORM_KINDS = ("greedy", "plain", "top_k")
# the largest top_k of a "top_k" sampler graph's rows: the kernel's smaller compiled capacity
# (kernels/top_k_sample.K_CAPS[0]; Qwen3's generation_config asks for 20)
GRAPH_TOP_K_MAX = 32


def uniform_kind(batch: SamplingBatch) -> str | None:
    """"greedy", "plain" or "top_k" (with or without top-p, k up to GRAPH_TOP_K_MAX) when every row of the
    batch takes that path, else None (top-p alone, a larger k or a mix of paths: the sampler's eager
    grouping)."""
    codes = batch.paths()
    if not len(codes) or not (codes == codes[0]).all():
        return None
    if codes[0] == _TOP_K:
        return "top_k" if int(batch.top_k.max()) <= GRAPH_TOP_K_MAX else None
    return {_GREEDY: "greedy", _PLAIN: "plain"}.get(int(codes[0]))


def sample_uniform(kind: str, logits: torch.Tensor, temperatures: torch.Tensor | None, seeds: torch.Tensor | None,
                   counters: torch.Tensor | None, out: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The draw of a batch whose rows all take path `kind` ("greedy": argmax; "plain": the race over
    logits / T with round-0 noise; "top_k": the top-k kernel, `top_k` int64 and `top_p` float64 [N] keys,
    k up to GRAPH_TOP_K_MAX, `scratch` its candidate buffer or None): logits [N, V] and keys [N] on one
    device -> tokens [N] int64 (into `out` [N] if given: the sampler graphs draw into the runner's token feed).
    Why one function: the eager sampler and the sampler graphs (which capture it) run the same
    launches on the same inputs, so a row's token does not depend on which of them drew it."""
    if kind == "greedy":
        return logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)
    if kind == "top_k":
        if logits.device.type == "cuda":
            from spmd_engine.kernels.top_k_sample import top_k_sample
            return top_k_sample(logits, temperatures, top_k, top_p, seeds, counters, GRAPH_TOP_K_MAX, out, scratch)
        drawn = (temperatures > 0).tolist()  # CPU: the eager torch path on the real rows (padding: T = 0)
        rows = [i for i, real in enumerate(drawn) if real]
        tokens = out if out is not None else torch.zeros(logits.shape[0], dtype=torch.int64)
        if rows:
            index = torch.tensor(rows)
            tokens[index] = _sample_top_k(logits[index].float(), temperatures[index], top_k[index].tolist(),
                                          top_p[index].tolist(), seeds[index], counters[index])
        return tokens
    if kind != "plain":
        raise ValueError(f"sample_uniform: kind must be one of {UNIFORM_KINDS}, got {kind!r}")
    return _sample_plain(logits.float(), temperatures, seeds, counters, out)


def _sample_plain(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain temperature sampling: the fused race on CUDA (the noise never leaves the registers), the
    race over z = logits / T elsewhere (the same tokens)."""
    if logits.device.type == "cuda":
        from spmd_engine.kernels.sampling_noise import gumbel_race
        return gumbel_race(logits, temps, seeds, counters, out=out)
    # a true division: CUDA divides by a scalar as a multiply by the reciprocal, which would round
    # otherwise than another batch's per-row division
    tokens = _race(logits / temps[:, None], seeds, counters, 0)
    return tokens if out is None else out.copy_(tokens)


def path_of(row: SamplingRow) -> str:
    """The sampling path of a row, from its own parameters alone (the determinism rule)."""
    if row.is_greedy:
        return "greedy"
    if row.top_k > 0:
        return "top_k" if row.top_k <= TOP_K_FAST_MAX else "top_k_sort"
    return "top_p" if row.top_p < 1.0 else "plain"


def _sample_top_k(logits: torch.Tensor, temps: torch.Tensor, top_ks: list[int], top_ps: list[float],
                  seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The top-k path without a sort of the vocabulary: `topk` of the group's largest k (at most
    TOP_K_FAST_MAX) ranked by (logit, lowest column), each row masking the ranks past its own k, top-p
    within the renormalised top-k, and the race over the candidates with the round-0 noise of their
    original columns.

    The token of `kernels.top_k_sample` (and its `reference.top_k_sample_reference`) bit for bit, on CPU
    and CUDA: tied logits rank lowest column first, at the k-th rank as inside the top-k (torch.topk orders
    them as it likes, which moved the nucleus cut or the k-th rank between tied tokens); z = logits / T by
    a true division; the nucleus masses are fixed-point integer sums of exp(z - z_max) (`NUCLEUS_MASS_ONE`:
    exact whatever order a scan adds them in; only the float64 exp is the device's), a rank kept when the
    mass of the better ranks is < top_p * the top-k's mass; the scores one float32 add z + noise.
    The same token as `_race(_apply_top_k_top_p(z, ...), seeds, counters, 0)` (the sort path) but where
    ties or the float32 softmax of the sort path move a row's cut."""
    vocab = logits.shape[-1]
    width = min(max(top_ks), vocab)
    k = _host_to([min(kk, width) for kk in top_ks], torch.int64, logits.device)
    values, cols = _ranked_top_k(logits, k, width)
    values = values / temps[:, None]  # the same true division as z's
    keep = torch.arange(width, device=logits.device)[None, :] < k[:, None]
    shifted = (values.double() - values[:, :1].double()).masked_fill(~keep | (values == float("-inf")), float("-inf"))
    weights = (shifted.exp() * NUCLEUS_MASS_ONE).long()  # truncated, as the kernel's
    cumulative = weights.cumsum(dim=-1)
    total = cumulative.gather(1, k[:, None] - 1).double()
    # top_p 1 masks nothing (a sum rounding past 1 must not cut the tail)
    p = _host_to(top_ps, torch.float64, logits.device)[:, None]
    cut = torch.where(p < 1.0, p * total, float("inf"))
    keep &= (cumulative - weights).double() < cut
    scores = (values + gumbel_noise_at(seeds, counters, 0, cols)).masked_fill(~keep, float("-inf"))
    best = scores.max(dim=-1, keepdim=True).values
    return torch.where(scores == best, cols, vocab).min(dim=-1).values


def _ranked_top_k(logits: torch.Tensor, k: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` largest logits and their columns, ranked by (logit descending, column
    ascending), whose first k[row] are the row's k largest with ties at the k-th rank to the lowest
    columns (the top-k kernel's rule): a second `topk`, of a key that puts the logits above the row's
    k-th value first and its ties next by column, then a stable sort of the few kept."""
    kth = logits.topk(width, dim=-1).values.gather(1, k[:, None] - 1)
    columns = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.float32)  # < 2**24: exact
    key = torch.where(logits > kth, float("inf"), torch.where(logits == kth, -columns, float("-inf")))
    cols = key.topk(width, dim=-1).indices.sort(dim=-1).values
    values = logits.gather(1, cols)
    values, order = values.masked_fill(values == 0, 0.0).sort(dim=-1, descending=True, stable=True)  # -0.0: +0.0
    return values, cols.gather(1, order)


def _race(z: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, round_: int) -> torch.Tensor:
    """Gumbel-max (the exponential race argmax(p / E) in log space): argmax(z + G) draws from softmax(z);
    -inf entries never win."""
    return (z + gumbel_noise(seeds, counters, round_, z.shape[-1])).argmax(dim=-1)


def _sample_nucleus(z: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor
                    ) -> torch.Tensor:
    """Exact top-p sampling without sorting the vocabulary (a sort of [N, V] costs ms per step).

    Token i is in the nucleus iff the mass of strictly likelier tokens is < top_p, so the nucleus
    is every token whose logit is above some cut. Draw from p over the tokens still allowed; a
    draw outside the nucleus shows that it and every token not likelier are outside, so those
    are excluded and the row draws again. An accepted draw is distributed as p restricted to the
    nucleus, exactly as with the sort. Round r uses the row's own (seed, counter, r) noise, so
    whether and when a row is accepted depends on that row alone. Rows still unresolved after a
    few rounds use the exact nucleus (here a sort; the CUDA kernel bisects for the same cut) with
    their own round-NUCLEUS_ROUNDS noise.

    Exactness: every round draws from p restricted to a set that still holds the whole nucleus, so
    a draw accepted in any round is distributed as p restricted to the nucleus; the cuts and the
    number of rounds depend only on rejected draws and the round streams are independent, so the
    mixture over "accepted in round r" and "fallback" is that distribution too. The CPU path and
    the reference of `kernels.sampling_noise.nucleus_sample`, which runs the same rounds on the
    device without a host sync (this one syncs per round to shrink the batch; CPU has no queue).
    """
    probs = torch.softmax(z, dim=-1)
    drawn = torch.empty(z.shape[0], dtype=torch.int64, device=z.device)
    todo = torch.arange(z.shape[0], device=z.device)
    cut: torch.Tensor | None = None  # per row: tokens with logits <= cut are known to be outside
    for round_ in range(NUCLEUS_ROUNDS):
        scores = z + gumbel_noise(seeds, counters, round_, z.shape[-1])
        if cut is not None:
            scores.masked_fill_(z <= cut[:, None], float("-inf"))
        candidate = scores.argmax(dim=-1)
        cand_logit = z.gather(1, candidate[:, None])
        likelier = torch.where(z > cand_logit, probs, 0.0).sum(dim=-1)
        accepted = ((likelier < top_p) | (top_p >= 1.0)).cpu()  # top_p 1: no nucleus (rounding aside)
        done = accepted.nonzero().squeeze(1).to(z.device)
        drawn[todo[done]] = candidate[done]
        if bool(accepted.all()):
            return drawn
        rest = (~accepted).nonzero().squeeze(1).to(z.device)
        todo, z, probs, top_p = todo[rest], z[rest], probs[rest], top_p[rest]
        seeds, counters = seeds[rest], counters[rest]
        cut = cand_logit[rest, 0]
    masked = _apply_top_k_top_p(z, [-1] * z.shape[0], top_p.tolist())
    drawn[todo] = _race(masked, seeds, counters, SORT_ROUND)
    return drawn


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (one sort for both)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = _host_to([kk if kk > 0 else vocab for kk in top_ks], torch.int64, logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    mask = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    # top_p 1 masks nothing (a cumsum rounding past 1 must not cut the tail)
    p = _host_to([pp if pp < 1.0 else float("inf") for pp in top_ps], torch.float32, logits.device)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
