"""What the runner answers processors: statistics of calibration passes, reductions and shared jobs.

References: float64 X^T X computed directly (rel. Frobenius error < 1e-6: float32 sums of exact products); for
rank invariance, the same tokens fed in another grouping must give bit-identical Hessians when the order is kept
(a routed expert's case) and bit-identical token ranges in any order; jobs over two gloo ranks must give every rank
the single-process results, each job run once.
"""

from __future__ import annotations

import contextlib
import re
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch import nn

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.core.requests import Job, Jobs, Observe, Stats
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline import statistics
from msmodelslim.pipeline.answers import observe, run_jobs, run_processor
from msmodelslim.pipeline.hooks import UnitHook
from msmodelslim.pipeline.statistics import HESSIAN_CHUNK_TOKENS
from msmodelslim.processor.base import Processor, UnitContext

REPO = Path(__file__).resolve().parents[2]
UNIT = Unit("layers.0", "decoder", "model.layers.0.", 0)


class NoExperts:
    def is_rank_local(self, name: str) -> bool:
        return False

    def statistics_pass(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def two_readers() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(12, 5), "b": nn.Linear(12, 3)})


def context(module: nn.Module, batches: list[torch.Tensor]) -> UnitContext:
    def run() -> None:
        for x in batches:
            module["a"](x)
            module["b"](x)

    return UnitContext(UNIT, module, NoExperts(), SINGLE, run_samples=run)


def tokens(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(90, 12, generator=g) * torch.linspace(0.1, 20, 12)  # channels of very different ranges
    return x.to(torch.bfloat16).float()


def test_hessian_is_x_transpose_x():
    x = tokens()
    module = two_readers()
    stats = observe(context(module, [x[:40], x[40:]]), Observe(hessian=("a", "b"), absmax=("a",)))
    ref = x.double().t() @ x.double()
    for name in ("a", "b"):
        assert float((stats.hessian[name] - ref).norm() / ref.norm()) < 1e-6
        assert stats.tokens[name] == 90
    assert torch.equal(stats.absmax["a"], x.abs().amax(0))


def test_token_ranges_do_not_depend_on_the_order_or_grouping_of_tokens():
    """What data-parallel ranks change (which samples a rank sums first, which tokens share a call): nothing."""
    x = tokens(1)
    module = two_readers()
    inv = 1.0 / torch.stack([torch.ones(12), torch.linspace(0.5, 3, 12)]).double()
    request = lambda ranges: Observe(token_ranges={"a": inv}, ranges=ranges)  # noqa: E731
    ranges = observe(context(module, [x]), Observe(absmax=("a",))).absmax
    one = observe(context(module, [x]), request(ranges))
    other = observe(context(module, [x[70:], x[:13], x[13:70]]), request(ranges))
    assert torch.equal(one.token_ranges["a"], other.token_ranges["a"])
    ref = torch.stack([(x.double().abs() * inv[c]).amax(-1).square().sum() for c in range(2)])
    assert float(((one.token_ranges["a"] - ref) / ref).abs().max()) < 1e-6  # float32 per token (no device float64)


def test_token_ranges_of_all_candidates_at_once_equal_one_candidate_at_a_time(monkeypatch):
    """The record multiplies every candidate at once, in row chunks (a routed expert's call has a few rows): the
    int64 sums must be bit-identical to summing each candidate on its own, with chunks of 1 row and of many."""
    x = tokens(2)
    module = two_readers()
    inv = 1.0 / torch.stack([torch.ones(12), torch.linspace(0.5, 3, 12), torch.linspace(4, 0.2, 12)]).double()
    ranges = observe(context(module, [x]), Observe(absmax=("a",))).absmax
    found = {}
    for elements in (1, 3 * 12 * 7, 1 << 26):  # one row per chunk, 7 rows, all rows
        monkeypatch.setattr(statistics, "TOKEN_RANGE_CHUNK_ELEMENTS", elements)
        found[elements] = observe(context(module, [x[:50], x[50:]]), Observe(token_ranges={"a": inv},
                                                                               ranges=ranges)).token_ranges["a"]
    stat = statistics.TokenRanges(Observe(token_ranges={"a": inv}, ranges=ranges), ranges, torch.device("cpu"))
    quanta = stat.quanta["a"]
    one_at_a_time = torch.stack([torch.round((x.abs() * inv[c].float()).amax(-1).square() / quanta[c])
                                 .to(torch.int64).sum() for c in range(3)]).float() * quanta
    for value in found.values():
        assert torch.equal(value, one_at_a_time)


def test_a_hessian_does_not_depend_on_how_its_tokens_were_split_into_calls():
    """A routed expert gets its tokens in the global order of the micro-batches but in calls whose sizes depend on
    the rank count: its Hessian must not (rows are summed in chunks of HESSIAN_CHUNK_TOKENS whatever the calls)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3 * HESSIAN_CHUNK_TOKENS + 17, 12, generator=g) * 5).to(torch.bfloat16).float()
    module = two_readers()
    splits = [[x], [x[:5], x[5:900], x[900:2100], x[2100:]], [x[i:i + 64] for i in range(0, len(x), 64)]]
    hessians = [observe(context(module, calls), Observe(hessian=("a",))).hessian["a"] for calls in splits]
    assert all(torch.equal(hessians[0], h) for h in hessians[1:])
    ref = x.double().t() @ x.double()
    assert float((hessians[0] - ref).norm() / ref.norm()) < 1e-6


def test_rows_a_hessian_holds_until_a_chunk_fills_do_not_keep_their_whole_buffer_alive():
    """A routed expert's rows are a view of all the micro-batch's routed tokens; a rarely routed expert holds rows
    of many micro-batches before a chunk fills. What it holds must be its own rows only (storage bytes = the rows'
    bytes), or every micro-batch's buffer stays alive (on the H100: 47.7 GiB at 1M tokens). The sums stay those of
    the rows (reference: float64 X^T X, rel. 1e-6)."""
    g = torch.Generator().manual_seed(4)
    stat = statistics.Hessian(Observe(hessian=("a",)), {}, torch.device("cpu"))
    seen = []
    for _ in range(5):
        batch = torch.randn(4000, 12, generator=g).to(torch.bfloat16).float()  # all routed tokens of a batch
        stat.record("a", batch[10:13])  # this expert's 3 rows
        seen.append(batch[10:13].clone())
        del batch
    held = stat.pending["a"]
    assert sum(t.untyped_storage().nbytes() for t in held) == 5 * 3 * 12 * 4
    stats = Stats()
    stat.finish({"a": nn.Linear(12, 5)}, SINGLE, lambda n: False, stats)
    x = torch.cat(seen).double()
    assert float((stats.hessian["a"] - x.t() @ x).norm() / (x.t() @ x).norm()) < 1e-6


def test_a_wide_hessian_sums_its_upper_strips_and_mirrors_them():
    """On the CPU the products fill the upper triangle strip by strip (HESSIAN_CPU_STRIP rows, the last one
    shorter): the result is still X^T X (float64 reference, relative 1e-6), exactly symmetric, and the same however
    the rows arrived."""
    width = 2 * statistics.HESSIAN_CPU_STRIP + 44
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(HESSIAN_CHUNK_TOKENS + 300, width, generator=g) * torch.linspace(0.1, 20, width)) \
        .to(torch.bfloat16).float()
    module = nn.ModuleDict({"a": nn.Linear(width, 4), "b": nn.Linear(width, 4)})
    hessians = [observe(context(module, calls), Observe(hessian=("a",))).hessian["a"]
                for calls in ([x], [x[:7], x[7:1100], x[1100:]])]
    ref = x.double().t() @ x.double()
    assert float((hessians[0] - ref).norm() / ref.norm()) < 1e-6
    assert torch.equal(hessians[0], hessians[0].t())
    assert torch.equal(hessians[0], hessians[1])


def test_bf16_rows_on_the_cpu_give_float32_sums_of_exact_products():
    """The runner's hooks get bf16 activations; on the CPU their products run as bf16 dot products accumulating in
    float32 (`cpu_bf16_products`). Reference: float64 X^T X; every entry within the rigorous bound of a float32 sum
    of N exact products, N u sum_t |x_ti x_tj| (u = 2^-24), which a product rounded to bf16 (2^-8) would exceed by
    far; the same bytes on a rerun; and the float32 rows' result within the same bound."""
    width, rows = 2 * statistics.HESSIAN_CPU_STRIP + 44, 3 * HESSIAN_CHUNK_TOKENS + 5
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(rows, width, generator=g) * torch.linspace(0.1, 20, width)).to(torch.bfloat16)
    ref = x.double().t() @ x.double()
    bound = rows * 2.0 ** -24 * (x.double().abs().t() @ x.double().abs())

    def hessian(rows_in: torch.Tensor) -> torch.Tensor:
        h = statistics.Hessian(Observe(hessian=("a",)), {}, torch.device("cpu"))
        for call in rows_in.split(700):
            h.record("a", call)
        h._flush("a", final=True)
        return statistics._mirrored(h.sums.pop("a"))

    first, again, float_rows = hessian(x), hessian(x), hessian(x.float())
    assert bool(((first.double() - ref).abs() <= bound).all())
    assert bool(((float_rows.double() - ref).abs() <= bound).all())
    assert torch.equal(first, again)


def test_readers_of_one_input_share_one_hessian():
    module = two_readers()  # a and b read the same input
    stats = observe(context(module, [tokens(1), tokens(2)]), Observe(hessian=("a", "b")))
    assert stats.hessian["a"] is stats.hessian["b"] and stats.tokens["a"] == stats.tokens["b"]


def test_readers_of_one_input_reduce_its_maxima_once(monkeypatch):
    """AbsMax of a and b, which read each call's input one after the other: b takes a's maxima of that call, one
    reduction per call, not per reader, and a's running maxima where it holds the same. Reference: max |x| per
    channel over the calls; tolerance none; c, reading another tensor of the same values, reduces its own; d,
    joining a's input at the second call only, has that call's maxima, and a third call's maxima over both."""
    module = two_readers()
    calls = [tokens(1), tokens(2)]
    reductions = []
    original = torch.Tensor.amax
    monkeypatch.setattr(torch.Tensor, "amax", lambda t, *a, **k: reductions.append(1) or original(t, *a, **k))
    stats = observe(context(module, calls), Observe(absmax=("a", "b")))
    assert len(reductions) == len(calls)
    reference = torch.maximum(*(x.abs().amax(dim=0) for x in calls))
    reductions.clear()
    assert torch.equal(stats.absmax["a"], reference) and torch.equal(stats.absmax["b"], reference)
    other = statistics.AbsMax(Observe(absmax=("a", "c")), {}, torch.device("cpu"))
    other.record("a", calls[0])
    other.record("c", calls[0].clone())
    assert len(reductions) == 2
    late = statistics.AbsMax(Observe(absmax=("a", "d")), {}, torch.device("cpu"))
    third = tokens(3)
    for x, readers in ((calls[0], "a"), (calls[1], "ad"), (third, "ad")):
        for name in readers:
            late.record(name, x)
    assert torch.equal(late.values["a"], torch.maximum(reference, third.abs().amax(dim=0)))
    assert torch.equal(late.values["d"], torch.maximum(calls[1].abs().amax(dim=0), third.abs().amax(dim=0)))


def test_a_module_no_token_reached_reports_zeros():
    module = two_readers()
    stats = observe(UnitContext(UNIT, module, NoExperts(), SINGLE, run_samples=lambda: None),
                    Observe(absmax=("a",), hessian=("b",)))
    assert not stats.absmax["a"].any() and not stats.hessian["b"].any()


def test_a_generator_processor_gets_its_answers():
    """run_processor sends each answer back into the processor; a plain one just runs."""
    seen = {}

    class Asks:
        def process_unit(self, ctx):
            seen["stats"] = yield Observe(absmax=("a",))
            seen["jobs"] = yield Jobs(_jobs())

    module = two_readers()
    run_processor(Asks(), context(module, [tokens()]))
    assert torch.equal(seen["stats"].absmax["a"], tokens().abs().amax(0))
    assert torch.equal(seen["jobs"]["j1"]["y"], torch.full((2,), 1.0))


def test_each_answer_runs_in_a_stage_named_by_its_request_kind():
    """run_processor runs each answer inside the runner's stage for its kind (where it is timed and its device
    memory recorded): one calibration pass, one job round; the pass's statistics are complete inside it."""
    class Asks:
        def process_unit(self, ctx):
            self.absmax = (yield Observe(absmax=("a",))).absmax["a"]
            yield Jobs(_jobs())

    stages: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def stage(kind: str) -> Iterator[None]:
        stages.append((kind, "start"))
        yield
        stages.append((kind, "end"))

    asks = Asks()
    run_processor(asks, context(two_readers(), [tokens()]), stage=stage)
    assert stages == [("observe", "start"), ("observe", "end"), ("jobs", "start"), ("jobs", "end")]
    assert torch.equal(asks.absmax, tokens().abs().amax(dim=0))


def test_a_stage_records_the_device_memory_held_in_it_and_the_run_the_most_held_anywhere(monkeypatch):
    """The device keeps one peak counter (here a fake with torch's semantics: the most held since the last reset);
    each stage starts it over, so a stage's peak is its own, and what came before or between stages still counts
    for the run's peak. Reference: the allocations made, in GiB."""
    from msmodelslim.pipeline import layer_wise

    class Counter:
        held = peak = 0

        def alloc(self, gib: int) -> None:
            self.held += gib * 2**30
            self.peak = max(self.peak, self.held)

        def reset(self, _device) -> None:
            self.peak = self.held

    device = Counter()
    monkeypatch.setattr(layer_wise, "peak_device_bytes", lambda _device: device.peak)
    monkeypatch.setattr(layer_wise, "reset_peak_device_bytes", device.reset)
    runner = layer_wise.LayerWiseRunner(adapter=None, processors=[])
    device.alloc(5), device.alloc(-5)  # before the first stage
    with runner.stage("a"):
        device.alloc(2), device.alloc(-2)
    device.alloc(1)  # between stages, kept
    with runner.stage("b"):
        device.alloc(3), device.alloc(-3)
    with runner.stage("a"):
        pass
    assert runner.stats.peaks == {"a": 2.0, "b": 4.0} and runner.stats.peak == 5.0
    assert set(runner.stats.seconds) == {"a", "b"}


def _jobs(calls: list | None = None) -> list[Job]:
    def make(i: int):
        def run():
            if calls is not None:
                calls.append(i)
            return {"y": torch.full((i + 1,), float(i)), "q": torch.arange(i + 3, dtype=torch.int8)}
        return run

    return [Job(f"j{i}", cost=10 - i, run=make(i), outputs={"y": ((i + 1,), torch.float32), "q": ((i + 3,), torch.int8)},
                local=i == 3) for i in range(5)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jobs_rank(rank: int, world: int, port: int, out: Path) -> None:
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        calls: list[int] = []
        results = run_jobs(DistContext(rank, world, torch.device("cpu")), _jobs(calls))
        torch.save({"results": results, "calls": calls}, out / f"rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.slow
def test_shared_jobs_run_once_and_reach_every_rank(tmp_path):
    mp.spawn(_jobs_rank, args=(2, _free_port(), tmp_path), nprocs=2, join=True)
    single = run_jobs(SINGLE, _jobs())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    shared = sorted(c for r in ranks for c in r["calls"] if c != 3)
    assert shared == [0, 1, 2, 4]  # each shared job on one rank
    assert all(3 in r["calls"] for r in ranks)  # the local job on each
    for r in ranks:
        for key, outs in single.items():
            for name, t in outs.items():
                assert torch.equal(r["results"][key][name], t), (key, name)


def test_processors_issue_no_collective():
    """The runner owns every collective: no torch.distributed and no DistContext collective in processor/."""
    pattern = re.compile(r"torch\.distributed|torch_dist|all_reduce|broadcast\(|\.barrier\(")
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in (REPO / "msmodelslim" / "processor").rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


class OneUnitAdapter(ModelAdapter):
    """One unit, `two_readers`, reading each sample's `x` [tokens, 12]; counts the forwards."""

    def __init__(self) -> None:
        self.module = two_readers()
        self.forwards = 0

    def units(self) -> list[Unit]:
        return [UNIT]

    def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
        return self.module

    def prepare_samples(self, records: list[Any]) -> list[dict[str, torch.Tensor]]:
        return records

    def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        self.forwards += 1
        module["a"](state["x"])
        module["b"](state["x"])
        return state

    def checkpoint_name(self, unit: Unit, live_name: str) -> str:
        return live_name

    def checkpoint_state(self, unit: Unit, module: nn.Module) -> Iterator[tuple[str, Any]]:
        return iter(())


class CappedRanges(Processor):
    """Asks the token ranges of `a` on the first `tokens` calibration tokens, after an uncapped absmax pass (`keep`:
    which asks for the inputs of that sample to be kept; `hessian`: the capped request asks for a's Hessian too)."""

    def __init__(self, tokens: int | None, keep: bool = False, hessian: bool = False) -> None:
        self.tokens, self.keep, self.hessian, self.forwards, self.stats = tokens, keep, hessian, [], None

    def process_unit(self, ctx: UnitContext) -> Any:
        sample = ("a",) if self.keep else ()
        ranges = (yield Observe(absmax=("a",), sample=sample, sample_tokens=self.tokens)).absmax
        before = ctx.adapter.forwards
        self.stats = yield Observe(token_ranges={"a": INV}, ranges=ranges, tokens=self.tokens,
                                   hessian=("a",) if self.hessian else ())
        self.forwards = ctx.adapter.forwards - before


INV = 1.0 / torch.stack([torch.ones(12), torch.linspace(0.5, 3, 12)])


def test_a_capped_pass_observes_only_the_first_samples_of_the_dealing_order():
    """Observe(tokens=580) over samples of 5, 300, 7, 280, 6, 290 and 8 tokens: the dealing order starts 300, 290,
    so the pass forwards those two samples only and its token ranges are theirs. Reference: the same request
    uncapped over a unit that sees just those two samples (exact: integer sums); without a cap every sample."""
    from msmodelslim.pipeline.assembly import place_tokens, split_samples
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner, Schedule

    g = torch.Generator().manual_seed(3)
    samples = [{"input_ids": torch.zeros(1, n, dtype=torch.long), "x": torch.randn(n, 12, generator=g)}
               for n in (5, 300, 7, 280, 6, 290, 8)]
    found = {}
    for cap in (580, None):
        adapter, probe = OneUnitAdapter(), CappedRanges(cap)
        LayerWiseRunner(adapter, [probe], schedule=Schedule(place_tokens=place_tokens(samples)), background=False).run(
            split_samples(samples, 0, 1))
        found[cap] = probe
    module = two_readers()
    ranges = observe(context(module, [s["x"] for s in samples]), Observe(absmax=("a",))).absmax  # every sample
    reference = observe(context(module, [samples[1]["x"], samples[5]["x"]]),
                        Observe(token_ranges={"a": INV}, ranges=ranges))
    assert found[580].forwards == 2 and found[None].forwards == 7
    assert found[580].stats.range_tokens["a"] == 590 and found[None].stats.range_tokens["a"] == 896
    assert torch.equal(found[580].stats.token_ranges["a"], reference.token_ranges["a"])


def test_a_capped_observe_of_a_kept_sample_runs_no_pass_and_gives_the_capped_pass_statistics():
    """The smoothing search's one-pass form: the first pass keeps the inputs of the samples of the first 1500 tokens
    (the dealing order's 1300 and 290: `Observe.sample`), and the capped request is answered from them. Reference:
    the same request answered by a capped pass (as before issue 50). Tolerance: none (token ranges, their token count and the Hessian's bytes)."""
    from msmodelslim.pipeline.assembly import place_tokens, split_samples
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner, Schedule

    g = torch.Generator().manual_seed(4)
    samples = [{"input_ids": torch.zeros(1, n, dtype=torch.long),
                "x": torch.randn(n, 12, generator=g).to(torch.bfloat16).float()} for n in (5, 1300, 7, 280, 6, 290)]
    found = {}
    for keep in (False, True):
        adapter, probe = OneUnitAdapter(), CappedRanges(1500, keep=keep, hessian=True)
        runner = LayerWiseRunner(adapter, [probe], schedule=Schedule(place_tokens=place_tokens(samples)),
                                 background=False)
        runner.run(split_samples(samples, 0, 1))
        found[keep] = probe, runner.stats.passes[UNIT.name]
    (kept, kept_passes), (capped, capped_passes) = found[True], found[False]
    assert kept.forwards == 0 and capped.forwards == 2
    assert kept_passes == capped_passes - 1
    assert kept.stats.range_tokens == capped.stats.range_tokens == {"a": 1590}
    assert torch.equal(kept.stats.token_ranges["a"], capped.stats.token_ranges["a"])
    assert torch.equal(kept.stats.hessian["a"], capped.stats.hessian["a"]) and kept.stats.tokens == {"a": 1590}


class ReadsTheForward(UnitHook):
    """A runner hook asking a's absmax off the forward that makes the next unit's inputs."""

    def __init__(self, tokens: int | None) -> None:
        self.tokens, self.stats = tokens, None

    def observe(self, unit: Unit, module: nn.Module) -> Observe:
        return Observe(absmax=("a",), tokens=self.tokens)

    def observed(self, run: Any, unit: Unit, module: nn.Module, stats: Stats) -> None:
        self.stats = stats


def test_a_hooks_statistic_is_read_off_the_forward_and_the_last_unit_runs_only_for_its_samples():
    """A hook's Observe on the propagate pass (the quant report's way): no pass of its own, and the last unit (whose
    outputs feed nothing) forwarded only over the samples of the first 580 tokens (the dealing order's 300 and 290).
    Reference: the absmax of `observe` over those two samples (exact: a max); uncapped, every sample."""
    from msmodelslim.pipeline.assembly import place_tokens, split_samples
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner, Schedule

    g = torch.Generator().manual_seed(5)
    samples = [{"input_ids": torch.zeros(1, n, dtype=torch.long), "x": torch.randn(n, 12, generator=g)}
               for n in (5, 300, 7, 280, 6, 290, 8)]
    for cap, forwarded in ((580, [1, 5]), (None, range(7))):
        adapter, hook = OneUnitAdapter(), ReadsTheForward(cap)
        runner = LayerWiseRunner(adapter, [], [hook], schedule=Schedule(place_tokens=place_tokens(samples)),
                                 background=False)
        runner.run(split_samples(samples, 0, 1))
        reference = observe(context(two_readers(), [samples[i]["x"] for i in forwarded]), Observe(absmax=("a",)))
        assert adapter.forwards == len(forwarded) and runner.stats.passes[UNIT.name] == 1
        assert torch.equal(hook.stats.absmax["a"], reference.absmax["a"])


def test_the_resumable_state_written_in_line_has_the_bytes_of_the_background_write(tmp_path):
    """A CPU run writes its resumable state in line (no thread), accelerators in the background: the same files,
    byte for byte, and only the background run starts the writer thread."""
    from msmodelslim.pipeline.hooks import ResumeHook
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner
    from msmodelslim.pipeline.resume import ResumeState

    class Recorded(ResumeState):  # the files as the run leaves them, before its end drops the state
        def invalidate(self) -> None:
            self.files = {p.name: p.read_bytes() for p in sorted(self.root.glob("rank0/*"))}
            super().invalidate()

    g = torch.Generator().manual_seed(4)
    samples = [{"input_ids": torch.zeros(1, n, dtype=torch.long), "x": torch.randn(n, 12, generator=g)}
               for n in (5, 9)]
    written = {}
    for background in (True, False):
        resume = Recorded(tmp_path / str(background))
        resume.start({})
        hook = ResumeHook(resume)
        LayerWiseRunner(OneUnitAdapter(), [], [hook], background=background).run(samples)
        assert (hook.writer is not None) == background
        written[background] = resume.files
    assert written[True] == written[False] and any(name.endswith(".pt") for name in written[True])


def test_a_unit_output_passed_through_untouched_goes_back_as_its_host_tensor(monkeypatch):
    """HostCopies: of a state moved to a device (here `meta`, which copies) the unit returns one input unchanged, one
    written in place and one new tensor. Only the first comes back as the host tensor it came from; the others are
    copied back (here: a stand-in copy of zeros)."""
    from msmodelslim.pipeline import layer_wise

    monkeypatch.setattr(layer_wise, "to_host", lambda t: torch.zeros(t.shape, dtype=t.dtype))
    host = {"kept": torch.ones(3), "written": torch.ones(3), "blocks": [torch.ones(2)]}
    copies = layer_wise.HostCopies()
    moved = copies.to_device(host, torch.device("meta"))
    assert moved["kept"].device.type == "meta"
    moved["written"].add_(1)  # in place: the host tensor no longer holds its values
    back = copies.to_host({**moved, "new": torch.empty(4, device="meta")})
    assert back["kept"] is host["kept"] and back["blocks"][0] is host["blocks"][0]
    assert back["written"] is not host["written"] and back["new"].shape == (4,)


def test_the_pass_that_makes_the_next_units_inputs_drops_each_input_once_its_outputs_are_finite():
    """Host memory of the samples' state: while a unit's last pass makes the next unit's states, each input state
    leaves the runner one sample after its forward (when its outputs' finite flag is read), so old and new states
    together stay about one state's size. Reference: weak references to unit 0's outputs (unit 1's inputs, held by
    nothing but the runner), read at each step of unit 1's last pass: steps before the previous one are gone
    (exact; CPython frees a tensor with its last reference), also with a resumable state written after unit 0 (it
    takes a list of its own, which its write drops)."""
    import weakref

    from msmodelslim.pipeline.hooks import ResumeHook
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner
    from msmodelslim.pipeline.resume import ResumeState

    units = [Unit(f"layers.{i}", "decoder", f"model.layers.{i}.", i) for i in range(3)]

    class ThreeUnits(OneUnitAdapter):
        def __init__(self) -> None:
            super().__init__()
            self.made: list[weakref.ref] = []  # unit 0's outputs

        def units(self) -> list[Unit]:
            return units

        def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
            return two_readers()  # (a freed unit's module is left on the meta device)

        def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
            out = {"x": super().forward_unit(unit, module, state)["x"] * 2}  # a new tensor
            if unit is units[0]:
                self.made.append(weakref.ref(out["x"]))
            return out

    class Watch(UnitHook):
        def __init__(self) -> None:
            self.alive: list[list[int]] = []  # per step of unit 1's last pass: unit 0's outputs still alive

        def keep(self, run: Any, step: int, state: Any) -> Any:
            if run.position == 1:
                self.alive.append([i for i, ref in enumerate(adapter.made) if ref() is not None])
                if step == 4:
                    unit1_read.set()
            return state

    unit1_read = threading.Event()

    class Kept(ResumeState):  # unit 0's resumable state as the run leaves it, before its end drops the state
        def save(self, rank: int, unit: int, state: dict[str, Any], shards: dict[str, str]) -> None:
            if unit == 0 and threading.current_thread() is not threading.main_thread():
                unit1_read.wait(timeout=60)  # in the background: only once unit 1's last pass has read every state
            super().save(rank, unit, state, shards)

        def invalidate(self) -> None:
            self.unit0 = self.load(0, 0)["states"]
            super().invalidate()

    g = torch.Generator().manual_seed(5)
    samples = [{"x": torch.randn(4, 12, generator=g)} for _ in range(5)]
    for resumable, background in ((False, False), (True, False), (True, True)):
        unit1_read.clear()
        adapter, watch = ThreeUnits(), Watch()
        hooks: list[UnitHook] = [watch]
        if resumable:
            resume = Kept(Path(tempfile.mkdtemp()))
            resume.start({})
            hooks.append(ResumeHook(resume))
        LayerWiseRunner(adapter, [], hooks, background=background).run(samples)
        if not background:  # (a write in the background holds its states until it is done)
            assert watch.alive == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1, 2, 3, 4], [2, 3, 4], [3, 4]], resumable
        if resumable:  # written while unit 1 dropped them: every state of unit 0's outputs
            assert [torch.equal(kept["x"], s["x"] * 2) for kept, s in zip(resume.unit0, samples, strict=True)] \
                == [True] * 5


def test_the_run_times_each_unit_from_its_load_to_its_hooks_and_the_runs_end_apart():
    """`RunStats.unit_seconds`: each unit's wall, its load, processors, forward and hooks' `unit_done` included (what
    a model's layer count multiplies in `--plan`'s record), and the run's end (`loop_done`) in none of them.
    Reference: sleeps of 0.3 s in unit 1's forward, in a hook's `unit_done` after unit 2 and in its `loop_done`;
    tolerance: the other units under 0.3 s, every unit's wall within the run's."""
    import time

    from msmodelslim.pipeline.layer_wise import LayerWiseRunner

    units = [Unit(f"layers.{i}", "decoder", f"model.layers.{i}.", i) for i in range(3)]

    class ThreeUnits(OneUnitAdapter):
        def units(self) -> list[Unit]:
            return units

        def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
            return two_readers()  # (a freed unit's module is left on the meta device)

        def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
            if unit is units[1]:
                time.sleep(0.3 / 2)  # two samples
            return super().forward_unit(unit, module, state)

    class Slow(UnitHook):
        def unit_done(self, run: Any, index: int, states: Any, last: bool) -> None:
            if index == 2:
                time.sleep(0.3)

        def loop_done(self, run: Any) -> None:
            time.sleep(0.3)

    samples = [{"x": torch.randn(4, 12)} for _ in range(2)]
    runner = LayerWiseRunner(ThreeUnits(), [], [Slow()], background=False)
    start = time.perf_counter()
    walls = runner.run(samples).unit_seconds
    total = time.perf_counter() - start
    assert list(walls) == ["layers.0", "layers.1", "layers.2"]
    assert walls["layers.0"] < 0.3 <= walls["layers.1"] and walls["layers.2"] >= 0.3
    assert sum(walls.values()) + 0.3 <= total


@pytest.mark.parametrize("background", [False, True], ids=["in line", "in the background"])
def test_the_next_unit_loads_once_the_processors_of_the_current_one_are_done(background):
    """The processors make the device's peak (Hessians, token samples, GPTQ's batches): the next unit (a full-size
    K3 layer, ~8.4 GiB on the device) starts loading after them, behind the forward that makes its inputs. Reference:
    the order of the adapter's loads and the processor's calls over three units."""
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner

    units = [Unit(f"layers.{i}", "decoder", f"model.layers.{i}.", i) for i in range(3)]
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    class ThreeUnits(OneUnitAdapter):
        def units(self) -> list[Unit]:
            return units

        def load_unit(self, unit: Unit, device: torch.device, reader: Any = None) -> nn.Module:
            with lock:
                events.append(("load", unit.name))
            return two_readers()

    class Marks(Processor):
        def process_unit(self, ctx: UnitContext) -> Iterator[Observe]:
            with lock:
                events.append(("process start", ctx.unit.name))
            yield Observe(absmax=("a",))
            with lock:
                events.append(("process end", ctx.unit.name))

    LayerWiseRunner(ThreeUnits(), [Marks(None)], background=background).run([{"x": torch.randn(4, 12)}])
    for i in range(2):
        assert events.index(("process end", f"layers.{i}")) < events.index(("load", f"layers.{i + 1}")), events
    assert [e for e in events if e[0] == "load"] == [("load", u.name) for u in units]
