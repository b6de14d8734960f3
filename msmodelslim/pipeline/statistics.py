"""The statistics the runner records for an `Observe` request: one class per kind.

A kind owns its whole life cycle: what its hook accumulates during a calibration pass, the zeros a module that saw
no token reports (so every rank reduces the same names), its exact reduction over data-parallel ranks, and the form
processors receive. A new statistic is one registered class; the runner (`answers.observe`) only drives them.

Everything runs on the run's device in Ascend-safe arithmetic (docs/npu.md): float32 and integers, matrix products
in float32, collectives in float32 or int64. Every answer is the same on a rerun and on a resume with the same
number of ranks; across rank counts:

- Hessians: float32 sums in a fixed order (`Hessian`): a routed expert's are identical on any number of ranks,
  the replicated linears' may differ in their last bits (their per-rank sums are added over ranks).
- token ranges: per token an integer on a grid of the candidate's bound, summed in int64: exact.
- maxima (absmax, head ranges): max is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import nn

from msmodelslim.core.device import cpu_bf16_products, host_values, tensor_core_fp32_matmuls
from msmodelslim.core.dist import DistContext
from msmodelslim.core.requests import Observe, Stats
from msmodelslim.core.routing import row_weights
from msmodelslim.errors import UserError
from msmodelslim.quant.modules import row_groups
from msmodelslim.quant.sensitivity import InputSums

HESSIAN_CHUNK_TOKENS = 1 << 10  # rows gathered before a product: a routed expert's calls bring a few tokens each
# On the CPU a Hessian's products fill only its upper triangle, a strip of this many rows per product: 0.6-0.85x the
# time of the whole square in float32, 0.3-0.65x as bf16 dot products (BENCHMARKS.md, issue 31); accelerators keep
# one product per chunk (one launch)
HESSIAN_CPU_STRIP = 128
HESSIAN_HELD_SLACK_BYTES = 1 << 28  # a grouped call's rows held as views: what their buffers may keep alive beyond
TOKEN_RANGE_GRID_BITS = 40  # (max|x| / bound)^2 in steps of 2^-40: int64 sums exact up to 2^23 tokens
TOKEN_RANGE_MAX_TOKENS = 1 << (63 - TOKEN_RANGE_GRID_BITS)
TOKEN_RANGE_CHUNK_ELEMENTS = 1 << 26  # candidate x row x channel products held at once (256 MB of float32)

KINDS: list[type[Statistic]] = []


def statistic(cls: type[Statistic]) -> type[Statistic]:
    """Register a kind; kinds record and reduce in registration order (the same on every rank)."""
    KINDS.append(cls)
    return cls


def width(module: nn.Module) -> int:
    return getattr(module, "in_features", None) or module.weight.shape[-1]


class Statistic:
    """One kind of statistic over one calibration pass."""

    field: ClassVar[str]  # the Observe / Stats field this kind serves
    flat_input: ClassVar[bool] = True  # the hook passes x as [tokens, channels] (else as the module got it)
    # read off each call's input and output (`record_call`, from a forward hook) rather than its input (`record`)
    reads_output: ClassVar[bool] = False

    def __init__(self, request: Observe, ranges: dict[str, torch.Tensor], device: torch.device) -> None:
        self.request = request
        self.device = device
        self.names: tuple[str, ...] = tuple(getattr(request, self.field))
        self.name_set = frozenset(self.names)

    def record(self, name: str, x: torch.Tensor) -> None:
        raise NotImplementedError

    def record_groups(self, names: Sequence[str], x: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        """The calls of one grouped position (a routed expert's w1 for each expert, say: `names[g]` read rows
        `bounds[g]` of x, in order, none empty), as `record` would get them one by one. A kind that can take
        them at once overrides it: the same values for fewer launches."""
        for name, (start, end) in zip(names, bounds, strict=True):
            self.record(name, x[start:end])

    def record_call(self, name: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    def record_call_groups(self, names: Sequence[str], modules: Sequence[nn.Module], x: torch.Tensor,
                           y: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        """`record_groups` for a kind that reads the output: names[g] (module modules[g]) read rows bounds[g] of x
        and made those rows of y."""
        for name, module, (start, end) in zip(names, modules, bounds, strict=True):
            self.record_call(name, module, x[start:end], y[start:end])

    def finish(self, modules: dict[str, nn.Module], dist: DistContext, replicated: Callable[[str], bool],
               stats: Stats) -> None:
        """Zero-fill, reduce over ranks (replicated modules only: a rank-local expert already saw every rank's
        tokens) and put the result into `stats`."""
        raise NotImplementedError


def same_input(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether b is the tensor a was, unchanged: what readers of one input (an expert's w1 and w3, q/k/v) are
    called with one after the other."""
    return a is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() \
        and a._version == b._version


@statistic
class AbsMax(Statistic):
    """Per input channel max |x| (float32 [d]). A reader called with the input the previous call had (an expert's
    w3 after its w1) takes that call's maxima, not another reduction, and where it held the same maxima as that
    reader before (it has read what that one read), their new maxima too. A grouped position's calls
    (`record_groups`) reduce into one table per width, a row per reader: a few launches for every expert at once
    (max is exact: the same values), merged with the per-call maxima at the end."""

    field = "absmax"

    def __init__(self, request: Observe, ranges: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__(request, ranges, device)
        self.values: dict[str, torch.Tensor] = {}
        # the last call: its input, the input's maxima, and the reader's maxima before and after it
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
        self.tables: dict[int, torch.Tensor] = {}  # width -> float32 [readers, width], zeros where none was read
        self.slots: dict[str, int] = {}  # reader -> its row in its width's table
        # the last grouped call: its input, its bounds and each group's maxima
        self._last_groups: tuple[torch.Tensor, tuple[tuple[int, int], ...], torch.Tensor] | None = None

    def record(self, name: str, x: torch.Tensor) -> None:
        last = self._last
        if last is not None and same_input(last[0], x):
            prev = self.values.get(name)
            self.values[name] = last[3] if prev is last[2] else last[1] if prev is None else \
                torch.maximum(prev, last[1])
            return
        amax = x.abs().amax(dim=0).float()
        prev = self.values.get(name)
        self.values[name] = amax if prev is None else torch.maximum(prev, amax)
        self._last = (x, amax, prev, self.values[name])  # holding x keeps its address unique while it is compared

    def record_groups(self, names: Sequence[str], x: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        bounds = tuple(bounds)
        last = self._last_groups
        if last is not None and same_input(last[0], x) and last[1] == bounds:
            maxima = last[2]
        else:
            maxima = group_maxima(x, row_groups(bounds, x.shape[0], x.device), len(bounds))
            self._last_groups = (x, bounds, maxima)
        d = x.shape[1]
        table = self.tables.get(d)
        if table is None:
            # a row for every reader of any width: slots count readers over the widths
            table = self.tables[d] = torch.zeros(len(self.names), d, dtype=torch.float32, device=x.device)
        rows = [self.slots.setdefault(name, len(self.slots)) for name in names]
        table.scatter_reduce_(0, host_values(rows, x.device)[:, None].expand(-1, d), maxima, "amax")

    def finish(self, modules: dict[str, nn.Module], dist: DistContext, replicated: Callable[[str], bool],
               stats: Stats) -> None:
        self._last = self._last_groups = None
        for name, slot in self.slots.items():
            grouped = self.tables[width(modules[name])][slot]
            prev = self.values.get(name)
            self.values[name] = grouped if prev is None else torch.maximum(prev, grouped)
        for name in self.names:
            self.values.setdefault(name, torch.zeros(width(modules[name]), dtype=torch.float32, device=self.device))
        shared = dist.all_reduce_max({n: v for n, v in self.values.items() if replicated(n)})
        stats.absmax.update({**self.values, **shared})


def group_maxima(x: torch.Tensor, groups: torch.Tensor, count: int) -> torch.Tensor:
    """max |x| over each group's rows (`groups`: `row_groups`) as float32 [count, d]: one scatter reduction (exact:
    the same values as each group's `amax`)."""
    maxima = torch.zeros(count + 1, x.shape[1], dtype=x.dtype, device=x.device)
    maxima.scatter_reduce_(0, groups[:, None].expand(-1, x.shape[1]), x.abs(), "amax")
    return maxima[:count].float()


def group_sums(values: torch.Tensor, groups: torch.Tensor, count: int) -> torch.Tensor:
    """float32 values [rows, k] summed over each group's rows (`groups`: `row_groups`), [count, k]: one float32 GEMM
    with the groups' indicator rows, deterministic on every device (an index_add's atomics are not)."""
    indicator = torch.zeros(count + 1, values.shape[0], dtype=torch.float32, device=values.device)
    indicator.scatter_(0, groups[None, :], 1.0)
    return (indicator @ values)[:count]


def _too_many_tokens(name: str, limit: int) -> str:
    return (f"{name}: more than {limit} calibration tokens reach this linear; its statistics would no longer sum "
            f"exactly (lower spec.max_samples or spec.max_seq_len)")


@statistic
class Hessian(Statistic):
    """X^T X over every token (float32 [d, d]) and the token count.

    The inputs' 16-bit products are exact in float32, and the sums accumulate in float32 (TF32 / HF32 tensor cores
    on accelerators, which hold bf16 values exactly) in a fixed order: the rows of each micro-batch, then the
    micro-batches in the order the runner forwards them. A routed expert's Hessian therefore has the same bytes on
    any number of ranks (its rank sees every micro-batch's tokens in the global order), and the replicated
    linears' per-rank sums are added over ranks in float32, which may move their last bits with the rank count
    (docs/dev/architecture.md: what that does to the output). One product per ~2^10 rows is ~25x cheaper per
    token than exact integer sums of 8-bit digits at a full-size width (bench/hessian_arith.py).

    Readers of one input (an expert's w1 and w3; q, k and v) keep one Hessian: the same tensor object under each
    name. A reader is linked to the one before it when both saw the same tensor at every call.

    Rows that come with router weights (`core.routing.row_weights`: a routed expert under
    `spec.affinity_guided_experts`) are summed as sqrt(w) x, and the sum is scaled by tokens / sum(w) at the end:
    sum_t w_t x_t x_t^T on the scale of an unweighted Hessian of as many tokens (GPTQ's damping is relative, and
    the smoothing search weighs it against the activation noise of that many tokens)."""

    field = "hessian"

    def __init__(self, request: Observe, ranges: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__(request, ranges, device)
        self.sums: dict[str, torch.Tensor] = {}  # leader -> float32 [d, d]
        self.pending: dict[str, list[torch.Tensor]] = {}  # leader -> rows not yet summed (< a chunk)
        self.pending_rows: dict[str, int] = {}
        self.tokens: dict[str, int] = {}  # leader -> rows recorded on this rank
        self.leader: dict[str, str] = {}  # every recorded name -> the name whose sums it shares
        self.weights: dict[str, torch.Tensor] = {}  # leader -> sum of its rows' router weights (weighted rows only)
        self._last: tuple[str, torch.Tensor] | None = None  # (leader, input) of the last call
        # (readers, input, bounds) of the last grouped call (`record_groups`)
        self._last_groups: tuple[tuple[str, ...], torch.Tensor, tuple[tuple[int, int], ...]] | None = None

    def record(self, name: str, x: torch.Tensor) -> None:
        last = self._last
        same = last is not None and same_input(last[1], x)
        leader = self.leader.get(name)
        if leader is not None and leader != name:  # a follower: its leader just recorded this input
            if not same or last[0] != leader:
                raise RuntimeError(f"{name} shared its input with {leader} and then read another one")
            return
        if leader is None and same:  # first call: reads what the previous reader read
            self.leader[name] = last[0]
            return
        self.leader[name] = name
        self._last_groups = None
        source = x  # what a reader after this one is compared with
        weights = row_weights()
        if weights is not None:  # float32 rows sqrt(w) x: x W^T's rows are exact in it, the weights are not
            if weights.shape[0] != x.shape[0]:
                raise RuntimeError(f"{name}: {x.shape[0]} rows came with {weights.shape[0]} router weights")
            weights = weights.to(x.device, torch.float32)
            total = self.weights.get(name)
            self.weights[name] = weights.sum() if total is None else total + weights.sum()
            x = x.float() * weights.clamp(min=0).sqrt()[:, None]
        self.pending.setdefault(name, []).append(x)
        self.pending_rows[name] = self.pending_rows.get(name, 0) + x.shape[0]
        self.tokens[name] = self.tokens.get(name, 0) + x.shape[0]
        if self.pending_rows[name] >= HESSIAN_CHUNK_TOKENS:
            self._flush(name)
        elif x.untyped_storage().nbytes() > x.numel() * x.element_size():
            # held until a chunk fills: a routed expert's rows are a view of all its micro-batch's routed tokens,
            # and a rarely routed expert holds rows from many micro-batches, so its views kept every one of those
            # buffers alive (a device peak growing with the tokens: 47.7 GiB at 1M tokens against 26 at 256k)
            self.pending[name][-1] = x.clone()
        self._last = (name, source)  # holding it keeps its address unique while it is compared

    def record_groups(self, names: Sequence[str], x: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        """Each group's rows, held as views of x until a chunk fills (no copy per expert): the same rows in the same
        order per reader as its calls bring them, so the same sums. Readers of the last grouped call's input and
        bounds (w3 after w1) follow its readers, group by group. What the views keep alive is bounded
        (`_compact`)."""
        if row_weights() is not None:  # router weights come with one expert's call
            super().record_groups(names, x, bounds)
            return
        bounds = tuple(bounds)
        last = self._last_groups
        same = last is not None and same_input(last[1], x) and last[2] == bounds
        full = []
        for g, (name, (start, end)) in enumerate(zip(names, bounds, strict=True)):
            leader = self.leader.get(name)
            if leader is not None and leader != name:  # a follower: its leader just recorded this input
                if not same or last[0][g] != leader:
                    raise RuntimeError(f"{name} shared its input with {leader} and then read another one")
                continue
            if leader is None and same:  # first call: reads what the previous grouped reader read
                self.leader[name] = last[0][g]
                continue
            self.leader[name] = name
            self.pending.setdefault(name, []).append(x[start:end])
            self.pending_rows[name] = self.pending_rows.get(name, 0) + end - start
            self.tokens[name] = self.tokens.get(name, 0) + end - start
            if self.pending_rows[name] >= HESSIAN_CHUNK_TOKENS:
                full.append(name)
        for name in full:
            self._flush(name)
        self._last, self._last_groups = None, (tuple(names), x, bounds)
        self._compact()

    def _compact(self) -> None:
        """Rows held as views keep their whole buffers alive (a rarely routed expert's, one call's grouped input
        per call): past twice the held rows (and HESSIAN_HELD_SLACK_BYTES), every held row is copied into one
        buffer per width (one launch each), which the views then take."""
        buffers: dict[int, int] = {}
        held = 0
        for rows in self.pending.values():
            for t in rows:
                buffers[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                held += t.numel() * t.element_size()
        if sum(buffers.values()) <= 2 * held + HESSIAN_HELD_SLACK_BYTES:
            return
        by_kind: dict[tuple[torch.dtype, int], list[str]] = {}
        for name, rows in self.pending.items():
            if rows:
                by_kind.setdefault((rows[0].dtype, rows[0].shape[1]), []).append(name)
        for names in by_kind.values():
            parts = [t for name in names for t in self.pending[name]]
            packed = torch.cat(parts)
            at = 0
            for name in names:
                n = self.pending_rows[name]
                self.pending[name] = [packed[at:at + n]]
                at += n

    def _flush(self, name: str, final: bool = False) -> None:
        """Add the rows held for `name` to its sums, in chunks of exactly HESSIAN_CHUNK_TOKENS rows (the last one
        shorter, at the end of the pass): the float32 sums then depend on the sequence of rows only, never on how
        they arrived in calls (a routed expert's come a few at a time, differently with another rank count), and
        one product over many rows costs far less than many over a few."""
        rows = self.pending.pop(name, None)
        self.pending_rows.pop(name, None)
        if not rows:
            return
        x = rows[0] if len(rows) == 1 else torch.cat(rows)
        del rows
        end = x.shape[0] if final else x.shape[0] // HESSIAN_CHUNK_TOKENS * HESSIAN_CHUNK_TOKENS
        if end < x.shape[0]:
            self.pending[name], self.pending_rows[name] = [x[end:].clone()], x.shape[0] - end
        # 16-bit inputs are exact in TF32 / HF32, and bf16 rows in the CPU's bf16 dot products
        bf16_on_cpu = x.device.type == "cpu" and x.dtype == torch.bfloat16
        with tensor_core_fp32_matmuls(x.device), cpu_bf16_products(bf16_on_cpu):
            for start in range(0, end, HESSIAN_CHUNK_TOKENS):
                self._add(name, x[start:min(start + HESSIAN_CHUNK_TOKENS, end)].float())

    def _add(self, name: str, chunk: torch.Tensor) -> None:
        """sums[name] += chunk^T chunk: the whole square on accelerators; on the CPU the upper triangle's strips
        (`_mirrored` completes it once the sums are final)."""
        h = self.sums.get(name)
        if chunk.device.type != "cpu":
            self.sums[name] = chunk.t() @ chunk if h is None else h.addmm_(chunk.t(), chunk)
            return
        if h is None:
            h = self.sums[name] = torch.zeros(chunk.shape[1], chunk.shape[1], dtype=torch.float32)
        for first in range(0, chunk.shape[1], HESSIAN_CPU_STRIP):
            last = first + HESSIAN_CPU_STRIP
            h[first:last, first:].addmm_(chunk[:, first:last].t(), chunk[:, first:])

    def _agree_on_leaders(self, dist: DistContext, replicated: Callable[[str], bool]) -> None:
        """A rank that forwarded no token cannot see which replicated readers share an input: it takes the sharing
        the others saw (every rank must reduce the same sums), from one max-reduction of leader indices."""
        shared = sorted(n for n in self.names if replicated(n))
        if not dist.is_distributed or not shared:
            return
        index = {n: i for i, n in enumerate(shared)}
        mine = torch.tensor([float(index[self.leader[n]]) if n in self.leader else -1.0 for n in shared],
                            device=self.device)
        agreed = dist.all_reduce_max({"leaders": mine})["leaders"].tolist()
        for name, leader in zip(shared, agreed, strict=True):
            if name not in self.leader and leader >= 0:
                self.leader[name] = shared[int(leader)]

    def finish(self, modules: dict[str, nn.Module], dist: DistContext, replicated: Callable[[str], bool],
               stats: Stats) -> None:
        self._last = self._last_groups = None
        for name in list(self.pending):
            self._flush(name, final=True)
        self._agree_on_leaders(dist, replicated)
        for name in self.names:  # a module that saw no token: zeros of its own
            if self.leader.setdefault(name, name) == name and name not in self.sums:
                d = width(modules[name])
                self.sums[name] = torch.zeros(d, d, dtype=torch.float32, device=self.device)
                self.tokens[name] = 0
        for name, total in self.weights.items():  # affinity-weighted: back on the scale of its token count
            if self.tokens.get(name):
                self.sums[name].mul_(self.tokens[name] / total.clamp(min=torch.finfo(torch.float32).tiny))
        leaders = sorted(self.sums)
        shared = [n for n in leaders if replicated(n)]
        counts = {n: torch.tensor([self.tokens[n]], dtype=torch.int64, device=self.device) for n in shared}
        reduced = dist.all_reduce_sum({f"h:{n}": self.sums[n] for n in shared})
        reduced.update(dist.all_reduce_sum({f"n:{n}": counts[n] for n in shared}))
        for n in leaders:
            h = reduced[f"h:{n}"] if n in shared else self.sums.pop(n)
            self.sums.pop(n, None)
            h = _mirrored(h)
            stats.hessian[n] = h
            stats.tokens[n] = int(reduced[f"n:{n}"]) if n in shared else self.tokens[n]
        for name in self.names:
            stats.hessian[name] = stats.hessian[self.leader[name]]
            stats.tokens[name] = stats.tokens[self.leader[name]]


def _mirrored(h: torch.Tensor) -> torch.Tensor:
    """The symmetric X^T X from its sums: on the CPU the upper triangle copied below it; elsewhere the mean of the
    two triangles (one GEMM's two triangles may round differently)."""
    if h.device.type == "cpu":
        return h.triu_().add_(h.triu(1).t())
    return (h + h.t()).mul_(0.5)


@statistic
class TokenRanges(Statistic):
    """Per candidate c, sum over tokens of (max_j |x_j| * inv[c, j])^2 (float32 [c]), as int64 sums on a grid of
    the largest value the candidate can reach."""

    field = "token_ranges"

    def __init__(self, request: Observe, ranges: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__(request, ranges, device)
        self.sums: dict[str, torch.Tensor] = {}
        self.quanta: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        for name, inv in request.token_ranges.items():
            bound = (ranges[name].float().to(device)[None, :] * inv.float().to(device)).amax(dim=-1)
            self.quanta[name] = torch.where(bound > 0, bound * bound, torch.ones_like(bound)) \
                * 2.0 ** -TOKEN_RANGE_GRID_BITS

    def record(self, name: str, x: torch.Tensor) -> None:
        inv = self.request.token_ranges[name].to(x.device, torch.float32)
        quanta = self.quanta[name].to(x.device)[:, None]
        xa = x.abs().float()
        # every candidate at once, in row chunks of at most TOKEN_RANGE_CHUNK_ELEMENTS products: a routed expert's
        # call brings a few rows and a loop over candidates cost a few launches per candidate (the same values: a
        # product, an exact max, the same rounding per element)
        rows = max(1, TOKEN_RANGE_CHUNK_ELEMENTS // max(1, inv.numel()))
        sums = self.sums.get(name)
        for chunk in xa.split(rows):
            peaks = (chunk[None] * inv[:, None, :]).amax(dim=-1)  # [candidates, rows]
            part = torch.round(peaks.square() / quanta).to(torch.int64).sum(dim=-1)
            sums = part if sums is None else sums.add_(part)
        if sums is not None:
            self.sums[name] = sums
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]
        if self.counts[name] > TOKEN_RANGE_MAX_TOKENS:
            raise UserError(_too_many_tokens(name, TOKEN_RANGE_MAX_TOKENS))

    def finish(self, modules: dict[str, nn.Module], dist: DistContext, replicated: Callable[[str], bool],
               stats: Stats) -> None:
        for name, inv in self.request.token_ranges.items():
            self.sums.setdefault(name, torch.zeros(inv.shape[0], dtype=torch.int64, device=self.device))
        shared = [n for n in self.names if replicated(n)]
        counts = {f"n:{n}": torch.tensor([self.counts.get(n, 0)], dtype=torch.int64, device=self.device)
                  for n in shared}
        reduced = dist.all_reduce_sum({**{n: self.sums[n] for n in shared}, **counts})
        for name in self.names:
            total = reduced[name] if name in shared else self.sums[name]
            stats.token_ranges[name] = total.float() * self.quanta[name]
            stats.range_tokens[name] = int(reduced[f"n:{name}"]) if name in shared else self.counts.get(name, 0)


def recall_window(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [rows, n]: the narrowest range [low, high] of sorted values that holds int(ratio * n) of
    them (the first such window on ties), as msModelSlim's RecallWindowObserver picks it; float32 [rows] each.
    Only the n - keep + 1 smallest and largest values can bound such a window, so two top-k's find it."""
    x = x.float()
    n = x.shape[1]
    keep = int(ratio * n)
    if keep >= n or keep < 1:
        return x.amin(dim=1), x.amax(dim=1)
    count = n - keep + 1
    lows = torch.topk(x, count, dim=1, largest=False, sorted=True).values  # sorted[i], i = 0 .. n - keep
    highs = torch.topk(x, count, dim=1, largest=True, sorted=True).values.flip(1)  # sorted[keep - 1 + i]
    best = (highs - lows).argmin(dim=1, keepdim=True)
    return lows.gather(1, best).squeeze(1), highs.gather(1, best).squeeze(1)


@statistic
class HeadRanges(Statistic):
    """Per head of a [batch, heads, seq, dim] input (an FA3 point): the min of the per-sample recall-window lows
    and the max of the highs (float32 [heads] each). Attention is replicated: every rank holds every head."""

    field = "head_ranges"
    flat_input = False  # the 4-D input as the attention point got it

    def __init__(self, request: Observe, ranges: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__(request, ranges, device)
        self.values: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(self, name: str, x: torch.Tensor) -> None:
        heads, ratio = self.request.head_ranges[name]
        if x.dim() != 4 or x.shape[1] != heads:
            raise ValueError(f"{name}: expected an input [batch, {heads}, seq, dim], got {list(x.shape)}")
        for sample in x.detach().split(1):  # a window per sample, also when a micro-batch holds several
            low, high = recall_window(sample[0].reshape(heads, -1), ratio)
            prev = self.values.get(name)
            self.values[name] = (low, high) if prev is None else (torch.minimum(prev[0], low),
                                                                  torch.maximum(prev[1], high))

    def finish(self, modules: dict[str, nn.Module], dist: DistContext, replicated: Callable[[str], bool],
               stats: Stats) -> None:
        for name, (heads, _) in self.request.head_ranges.items():  # a range always holds 0 (scales read |x|)
            zeros = torch.zeros(heads, dtype=torch.float32, device=self.device)
            self.values.setdefault(name, (zeros, zeros.clone()))
        bounds = {f"low:{n}": -low for n, (low, _) in self.values.items()}
        bounds.update({f"high:{n}": high for n, (_, high) in self.values.items()})
        bounds = dist.all_reduce_max(bounds)
        stats.head_ranges.update({n: (-bounds[f"low:{n}"], bounds[f"high:{n}"]) for n in self.names})


@statistic
class QuantError(Statistic):
    """The quant report's sums of a quantized linear (`quant.sensitivity.InputSums`) over the tokens observed: its
    input in the weight's basis, what the kernel multiplied by in its place (`QuantLinear.kernel_input`, the same
    values as its forward's) and its output. The replicated linears' float32 sums are added over ranks (the report
    is a diagnostic: its numbers are kept to 4 significant digits and agree across rank counts within that), the
    token counts as int64, the maxima by max; a routed expert under EP already saw every rank's tokens."""

    field = "quant_error"
    reads_output = True
    summed: ClassVar[tuple[str, ...]] = ("squares", "act_error", "moments", "output_squares")

    def __init__(self, request: Observe, ranges: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__(request, ranges, device)
        self.sums: dict[str, InputSums] = {}
        # grouped calls (`record_call_groups`), per input width: a row per linear of [squares | act_error | the 4
        # moments | output squares] and of the maxima, its token counts on the host
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.slots: dict[str, int] = {}
        self.table_tokens: dict[str, int] = {}

    def record_call(self, name: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        x, x_quant = module.kernel_input(x)
        if name not in self.sums:
            self.sums[name] = InputSums.zeros(module.in_features, self.device)
        self.sums[name].record(x, x_quant, y)

    def record_call_groups(self, names: Sequence[str], modules: Sequence[nn.Module], x: torch.Tensor,
                           y: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> None:
        """Every group's `InputSums.record` at once, for linears of one activation scheme without a rotation (the
        rows' kernel input is then the same for all): per-row quantities, summed per group by one GEMM
        (`group_sums`), the maxima by one scatter reduction, into one table row per linear. The same sums in
        another order: a diagnostic's last bits."""
        first = modules[0]
        if any(getattr(m, "online_rotation", True) is not None or m.scheme.act != first.scheme.act
               for m in modules):
            super().record_call_groups(names, modules, x, y, bounds)
            return
        x, x_quant = first.kernel_input(x)
        flat = x.reshape(-1, x.shape[-1]).float()
        d = flat.shape[1]
        squares = flat.square()
        columns = [squares, (x_quant.reshape(flat.shape).float() - flat).square() if x_quant is not None
                   else torch.zeros_like(flat), flat.sum(dim=1, keepdim=True), squares.sum(dim=1, keepdim=True),
                   (squares * flat).sum(dim=1, keepdim=True), squares.square().sum(dim=1, keepdim=True),
                   y.reshape(flat.shape[0], -1).float().square().sum(dim=1, keepdim=True)]
        groups = row_groups(bounds, flat.shape[0], flat.device)
        summed = group_sums(torch.cat(columns, dim=1), groups, len(bounds))
        maxima = group_maxima(flat, groups, len(bounds))
        if d not in self.tables:
            self.tables[d] = (torch.zeros(len(self.names), 2 * d + 5, dtype=torch.float32, device=flat.device),
                              torch.zeros(len(self.names), d, dtype=torch.float32, device=flat.device))
        sums, absmax = self.tables[d]
        slots = host_values([self.slots.setdefault(name, len(self.slots)) for name in names], flat.device)
        sums.scatter_add_(0, slots[:, None].expand(-1, summed.shape[1]), summed)  # a row per linear: one addition each
        absmax.scatter_reduce_(0, slots[:, None].expand(-1, d), maxima, "amax")
        for name, (start, end) in zip(names, bounds, strict=True):
            self.table_tokens[name] = self.table_tokens.get(name, 0) + end - start

    def _merge_tables(self, modules: dict[str, nn.Module]) -> None:
        """The grouped calls' table rows into each linear's InputSums."""
        for name, slot in self.slots.items():
            d = width(modules[name])
            sums, absmax = self.tables[d]
            row = sums[slot]
            grouped = InputSums(row[:d].clone(), row[d:2 * d].clone(), absmax[slot].clone(), row[2 * d:2 * d + 4].clone(),
                                row[2 * d + 4].clone(), torch.tensor(self.table_tokens[name], device=self.device))
            own = self.sums.get(name)
            if own is not None:
                for k in self.summed:
                    setattr(grouped, k, getattr(grouped, k) + getattr(own, k))
                grouped.absmax = torch.maximum(grouped.absmax, own.absmax)
                grouped.tokens = grouped.tokens + own.tokens
            self.sums[name] = grouped

    def finish(self, modules: dict[str, nn.Module], dist: DistContext, replicated: Callable[[str], bool],
               stats: Stats) -> None:
        self._merge_tables(modules)
        for name in self.names:
            self.sums.setdefault(name, InputSums.zeros(width(modules[name]), self.device))
        shared = [(n, self.sums[n]) for n in self.names if replicated(n)]
        floats = dist.all_reduce_sum({f"{n}/{k}": getattr(s, k) for n, s in shared for k in self.summed})
        tokens = dist.all_reduce_sum({n: s.tokens for n, s in shared})
        absmax = dist.all_reduce_max({n: s.absmax for n, s in shared})
        for name, sums in shared:
            for k in self.summed:
                setattr(sums, k, floats[f"{name}/{k}"])
            sums.tokens, sums.absmax = tokens[name], absmax[name]
        stats.quant_error.update({n: self.sums[n] for n in self.names})


def kinds_for(request: Observe) -> list[type[Statistic]]:
    return [k for k in KINDS if getattr(request, k.field)]
