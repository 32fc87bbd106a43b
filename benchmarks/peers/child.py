"""One (model, precision) of the peers benchmark, run in a process of its own: memory, gradients, timings.

``python -m benchmarks.peers.child JOB_JSON`` prints one ``REMAT {json}`` line per record (the protocol of
:mod:`remat.bench.childproc`). On the CPU the parent starts it with the whole-process meter's allocator
settings (``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 MALLOC_TOP_PAD_=131072``: freed tensors go
back to the system); on CUDA the model, its copies and the batch live on the GPU and glibc is left alone. Then:

1. ``remat.profile`` of the model, twice: eager, and with its blocks compiled (``compile_blocks``, the job's
   backend: the table remat plans compiled blocks from); on the CPU in a process of its own started with the
   timing settings of glibc's malloc of step 4, and in CPU seconds with one intra-op thread: as the steps it
   predicts are timed; with ``holds_output=False``, since the step keeps only the loss. Then every contender
   is built.
2. Memory: per contender, warm-up steps (compilation included), then one step under the peak meter, on the
   CPU the whole-process one (:class:`remat.meters.process.ProcessPeakMeter`: growth of the resident
   high-water mark), on CUDA the allocator's (:class:`device.AllocatorPeak`: ``max_memory_allocated``
   above what was allocated before the step), and one under ``remat.measure``: the live-tensor tracker for
   eager contenders, the allocator's events (``allocations=True``, which see compiled code) for compiled
   ones. Parameter gradients exist before the measured step (zeroed in place), so both meters see the same
   transient memory: activations and gradients in flight. The hand-written contenders are
   measured at every ``k`` first; each budget gets the smallest ``k`` that fits by both meters. The
   contenders chosen by timing steps (``torch.compile``'s budget fitted by remat, ``remat.fit(compile=True)``,
   ``remat fit``) come last, after glibc is switched to the timing settings of step 4
   (:meth:`Bench.timing_allocator_for_choices`): they are measured by ``remat.measure`` alone.
3. Gradients: the measured step runs from the same seed for everyone; its gradients are compared with those
   of the contender's reference (bitwise, and the largest absolute difference).
4. Timings: on the CPU glibc is first switched to the timing settings of DESIGN.md with ``mallopt`` (what
   ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=268435456`` set at
   start: no page faults per step); then rounds over all contenders, the order reversed every other round;
   every step is one record (CPU time on the CPU; on CUDA wall-clock, the device synchronised around it).
   Forward and backward (and PGAC's update) are timed; no optimizer runs, so the weights,
   and the gradients every contender must reproduce, stay the same.
5. Head to head: at each budget, ``remat optimal`` and ``remat fit`` against each eager peer of that budget, and
   ``remat optimal`` against itself (an A/A pair), for ``duel_rounds`` more rounds of those few contenders only:
   the target compares steps within 2%, finer than rounds over every contender resolve on a shared machine; more
   rounds, up to ``duel_max_rounds``, while a ratio to a fitting peer is not yet resolved from 1.02
   (:mod:`benchmarks.peers.duel`); then ``remat.fit(compile=True)`` the same way against ``torch.compile``'s
   budgets (at the fraction, and fitted by remat).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import nn

import remat
from remat.bench import child_env, emit, parse
from remat.fitting import CompileBudgetFit, CompiledFit, PlanFit, compile_blocks, fit, fit_compile_budget, fit_compiled
from remat.meters import ProcessPeakMeter, process_meter_problem
from remat.planning import no_checkpoint_peak

from . import ckptplan as ckptplan_peer
from . import contenders as pc
from . import device as pd
from . import duel
from . import models as pm
from . import table as pt

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
TIMING_ALLOCATOR = {_M_MMAP_THRESHOLD: 33554432, _M_TRIM_THRESHOLD: 17179869184, _M_TOP_PAD: 268435456}
# The same, as the environment of a process started with them (the profile's).
TIMING_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184",
              "MALLOC_TOP_PAD_": "268435456"}


def use_timing_allocator() -> bool:
    """Switch glibc's malloc to the timing settings; False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = True
    for param, value in TIMING_ALLOCATOR.items():
        ok = bool(libc.mallopt(param, min(value, 2**31 - 1))) and ok
    return ok


def step_clock(device: str) -> Callable[[], float]:
    """The clock the steps are timed in: CPU seconds with one intra-op thread on the CPU, however busy the
    machine; wall-clock otherwise."""
    return time.process_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def profile(job: dict[str, Any], compiled: bool = False) -> remat.CostTable:
    """``remat.profile`` of the job's model (in its precision) on its batch: eager, with the job's per-operator
    policies as selective actions, or with its blocks compiled (``compile_blocks`` with the job's backend) and
    their partitions."""
    setting = pm.ModelSetting(job["model"], job["dtype"], job["size"])
    device = pd.check_device(job.get("device", "cpu"))
    model = pm.build_model(setting, seed=job["seed"]).to(device)
    if compiled:
        compile_blocks(model, backend=job["backend"], partition_budgets=pc.PARTITION_BUDGETS)  # the chain profiled
    clock = step_clock(device)
    # The step (models.forward_backward) keeps only the loss: the logits are freed before the backward.
    with pd.precision_context(setting.dtype, device):
        policies = ("dots_saveable",) if compiled else job_policies(job)
        return remat.profile(model, pm.make_batch(setting, seed=job["seed"], device=device), clock=clock,
                             holds_output=False, policies=policies)


def wants_compiled(job: dict[str, Any]) -> bool:
    """Whether the job runs the compiled contenders (``--no-compiled`` turns them off; records written before the
    option existed ran them)."""
    return job.get("compiled", True)


def job_policies(job: dict[str, Any]) -> str | tuple[str, ...]:
    """The job's ``--policies``: ``"menu"`` or the names it lists (records written before the option existed
    profiled ``dots_saveable`` alone)."""
    names = job.get("policies", "dots_saveable")
    return "menu" if names == "menu" else tuple(n.strip() for n in names.split(",") if n.strip())


def profile_under_timing_allocator(job: dict[str, Any]) -> tuple[remat.CostTable, remat.CostTable | None]:
    """The profile taken in a process of its own started with the timing settings of glibc's malloc, as the
    steps it predicts are timed: under the meter's settings every tensor over 64 KiB is a fresh mapping, and
    page faults would double the times it measures, while switching this process to the timing settings and
    back leaves memory behind that the whole-process meter then misses. Returns the eager and the compiled
    blocks' tables."""
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--profile", json.dumps(job)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2], env=child_env(**TIMING_ENV),
                          timeout=job.get("profile_timeout", 1200))  # fmt: skip
    tables = {}
    for line in proc.stdout.splitlines():
        record = parse(line)
        if record is not None and record.get("record") == "costs":
            tables[record["compiled"]] = remat.CostTable.from_dict(record["table"])
    wanted = {False, True} if wants_compiled(job) else {False}
    if set(tables) == wanted:
        return tables[False], tables.get(True)
    tail = " | ".join(proc.stderr.strip().splitlines()[-8:])
    raise RuntimeError(f"the profile's process exited with code {proc.returncode} without the cost tables it "
                       f"owes (eager{', compiled blocks' if True in wanted else ''}): {tail}")


class Bench:
    """The measurements of one (model, precision), emitted as records as they are made."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.setting = pm.ModelSetting(job["model"], job["dtype"], job["size"])
        self.base = {"model": self.setting.model, "dtype": self.setting.dtype}
        self.device = pd.check_device(job.get("device", "cpu"))
        self.batch = pm.make_batch(self.setting, seed=job["seed"], device=self.device)
        self.meter_problem = process_meter_problem() if self.device == "cpu" else None
        self.memory: dict[str, dict[str, Any]] = {}
        self.reference_grads: dict[str, list[torch.Tensor]] = {}
        self.costs: remat.CostTable | None = None  # the profile remat plans are predicted from (eager)
        self.ran: remat.Plan | None = None  # the remat plan of the last step, where it had one
        self.ran_costs: remat.CostTable | None = None  # and the profile it is predicted from
        self.ran_own_s = 0.0  # and what the contender's own work adds (PGAC's scoring and update)

    def predicted(self, plan: remat.Plan | None, costs: remat.CostTable | None) -> dict[str, Any]:
        """remat's predictions for a step under ``plan`` (the simulator on ``costs``): peak activation
        bytes and step seconds, plus the seconds of the contender's own work (PGAC's); empty without a plan."""
        if plan is None or costs is None:
            return {}
        sim = remat.simulate(costs, plan.actions)
        return {"predicted_peak_bytes": sim.peak_bytes, "predicted_step_s": sim.step_s + self.ran_own_s}

    def emit(self, record: str, **fields: Any) -> None:
        emit({"record": record, **self.base, **fields})

    # ----- one step
    def step(self, c: pc.Contender, seed: int) -> tuple[float, float]:
        """Zero the gradients, switch to ``c``, run one step from ``seed``; returns its wall-clock and CPU
        seconds (the process's CPU time: with one intra-op thread, what the step would take on a machine of
        its own, however busy this one is; on CUDA the host's share only). The device is synchronised before
        and after, so the wall-clock covers the GPU's work."""
        for p in c.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        c.select()
        self.ran, self.ran_costs = c.plan(), c.costs or self.costs
        torch.manual_seed(seed)
        pd.synchronize(self.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        with c.step_context():
            pm.forward_backward(c.forward, self.batch, self.setting.dtype, self.device)
        c.after_backward()
        pd.synchronize(self.device)
        self.ran_own_s = c.own_s()
        return time.perf_counter() - start, time.process_time() - cpu_start

    def grads(self, c: pc.Contender) -> list[torch.Tensor]:
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in c.model.parameters()]

    # ----- memory and gradients
    def measure(self, c: pc.Contender) -> dict[str, Any]:
        if c.key in self.memory:
            return self.memory[c.key]
        seed = self.job["seed"] + 1
        warmup = self.job["warmup"] + (1 if c.group == pc.COMPILED else 0)
        started = time.perf_counter()
        for i in range(warmup):
            self.step(c, seed + 100 + i)
        process = allocator = None
        if self.device == "cuda":
            with pd.AllocatorPeak(self.device) as peak:
                self.step(c, seed)
            allocator = peak.bytes
        elif self.meter_problem is None:
            with ProcessPeakMeter() as meter:
                self.step(c, seed)
            process = meter.activation_bytes
        else:
            self.step(c, seed)
        grads = self.grads(c)
        predicted = self.predicted(self.ran, self.ran_costs)  # the plan of the peak meter's step
        tracker = None
        if c.tracker or c.allocations:  # the live-tensor tracker (eager), the allocator's events (compiled)
            with remat.measure(self.device, allocations=c.allocations) as mem:
                self.step(c, seed)
            tracker = mem.activation_bytes
        result = {"key": c.key, "process_bytes": process, "allocator_bytes": allocator, "tracker_bytes": tracker,
                  **predicted, **self._compare(c, grads),
                  "info": c.info(), "setup_s": time.perf_counter() - started}
        self.memory[c.key] = result
        self.emit("memory", **result)
        return result

    def _compare(self, c: pc.Contender, grads: list[torch.Tensor]) -> dict[str, Any]:
        reference = self.reference_grads.setdefault(c.grad_reference, grads)
        bitwise = all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, reference, strict=True))
        scale = max(float(b.float().abs().max()) for b in reference)
        return {"grad_reference": c.grad_reference, "grads_bitwise": bitwise, "grad_max_abs_diff": diff,
                "grad_max_abs": scale}

    # ----- the hand-written contenders: measured at every k, the smallest fitting k per budget
    def choose_k(self, cs: pc.ContenderSet, budgets: list[float]) -> None:
        """Each hand-written peer's k per budget: the least k that fits it by every meter (the table's rule)."""
        hand = cs.hand_written()
        reference = self.memory["none"]
        for mode in ("plain", "selective"):
            chosen: dict[float, pc.Contender] = {}
            probe = None
            for k in range(1, hand.n + 1):  # memory falls as k grows: stop once every budget has its k
                probe = pc.hand_contender(hand, mode, k)
                memory = self.measure(probe)
                ratios = pt.meter_ratios(memory, reference)
                if not any(r is not None for r in ratios):
                    raise RuntimeError(f"{memory['key']}: no meter gave a figure")
                for budget in budgets:
                    if budget not in chosen and pt.fits_by_every_meter(budget, *ratios):
                        chosen[budget] = probe
                if len(chosen) == len(budgets):
                    break
            for budget in budgets:
                cs.add(chosen.get(budget, probe), budget)

    def timing_allocator_for_choices(self) -> None:
        """The choices made by timing steps (``fit_compile_budget``'s grid, ``fit_compiled``'s rounds) run under
        the timing settings of glibc's malloc, as the table's rounds do: under the meter's, every tensor over
        64 KiB is a fresh mapping, and its page faults slow the routes unequally (on Llama under bf16,
        ``fit_compiled`` chose blocks at 1.07x torch's budget so, and the whole model at 1.00x under the timing
        settings). Switching back leaves memory behind that the whole-process meter then misses (it read
        0.00 of the reference for plans measured after a switch and back), so the switch is for good: the
        contenders measured after it, those two, fit by the allocator's events alone."""
        if self.device == "cpu" and self.meter_problem is None:
            self.emit("timing_setup", allocator_switched=use_timing_allocator(), before="choices")
            self.meter_problem = "measured after the switch to the timing settings of glibc's malloc"

    # ----- timings
    def time_rounds(self, keys: list[str], contenders: dict[str, pc.Contender]) -> None:
        allocator = use_timing_allocator() if self.device == "cpu" else None
        self.emit("timing_setup", allocator_switched=allocator, threads=torch.get_num_threads())
        for key in keys:  # one warm-up step each after the allocator switch
            self.step(contenders[key], self.job["seed"] + 7)
        for r in range(self.job["rounds"]):
            order = keys if r % 2 == 0 else keys[::-1]
            for key in order:
                fields = self.timed(contenders[key], self.job["seed"] + 1000 + r)
                step = self.predicted(self.ran, self.ran_costs).get("predicted_step_s")  # of the plan this step ran
                self.emit("timing", key=key, round=r, **fields, predicted_step_s=step)

    def timed(self, c: pc.Contender, seed: int) -> dict[str, float]:
        """One step of ``c`` as a timing record's fields: ``seconds`` (wall-clock) and, on the CPU,
        ``cpu_seconds`` (on CUDA wall-clock only)."""
        wall, cpu = self.step(c, seed)
        return {"seconds": wall, "cpu_seconds": cpu} if self.device == "cpu" else {"seconds": wall}


def fit_whole_model(job: dict[str, Any], bench: Bench, model: nn.Module) -> CompileBudgetFit:
    """``fit_compile_budget``'s trials on ``model`` with the unit's batch, precision and backend: no budget and
    each of the unit's fractions (graphs the unit compiled already, :func:`compiled_contenders`) measured once, to
    be chosen from per byte budget (``CompileBudgetFit.refit``)."""
    # the steps (Bench.step) zero the gradients in place: measured so, a compiled backward's gradients add up
    return fit_compile_budget(model, bench.batch, 1.0, budgets=[float(b) for b in job["budgets"]],
                              backend=job["backend"], autocast=unit_autocast(bench),
                              clock=step_clock(bench.device), holds_output=False, set_to_none=False)


def compilation_counts() -> dict[str, int]:
    """What dynamo compiled in this process: frames compiled and distinct graphs handed to a backend."""
    from torch._dynamo.utils import counters

    return {"frames_compiled": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"])}


def unit_autocast(bench: Bench) -> torch.dtype | bool:
    """The unit's precision as remat's ``autocast=`` argument: bf16 autocast, or none."""
    return torch.bfloat16 if bench.setting.dtype == "bf16" else False


def fit_eager_at(job: dict[str, Any], bench: Bench, model: nn.Module, budget: float) -> PlanFit:
    """``remat.fitting.measured_fit.fit`` on ``model`` at the fraction ``budget`` of the eager profile's predicted peak,
    with the unit's batch and precision (the steps run in its autocast context, as the profile's did), ``choice_rounds``
    rounds head to head."""
    with pd.precision_context(bench.setting.dtype, bench.device):
        return fit(model, bench.batch, budget, costs=bench.costs, rounds=max(1, job.get("choice_rounds", 5)),
                   clock=step_clock(bench.device), holds_output=False, set_to_none=False)


def fit_compiled_at(job: dict[str, Any], bench: Bench, model: nn.Module, max_bytes: int | float,
                    whole: CompileBudgetFit | None) -> CompiledFit:
    """``fit_compiled`` on ``model`` at ``max_bytes`` with the unit's batch, precision and backend, the whole-model
    trials ``whole`` reused where they ran, ``choice_rounds`` rounds head to head, and remat's eager ``optimal`` plan
    for the same bytes as a third route (where one fits), as ``remat.fit(..., compile=True)`` sets them against
    each other."""
    try:
        eager = remat.plan(bench.costs, "optimal", budget=max_bytes)
    except remat.BudgetError:
        eager = None
    return fit_compiled(model, bench.batch, max_bytes, whole=whole, partition_budgets=pc.PARTITION_BUDGETS,
                        eager=eager, backend=job["backend"], autocast=unit_autocast(bench),
                        rounds=job.get("choice_rounds", 5), clock=step_clock(bench.device), holds_output=False,
                        set_to_none=False)


def run(job: dict[str, Any]) -> None:
    torch.set_num_threads(job["threads"])
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    bench = Bench(job)
    setting = bench.setting
    budgets = [float(b) for b in job["budgets"]]
    base = pm.build_model(setting, seed=job["seed"]).to(bench.device)
    with_compiled = wants_compiled(job)
    if bench.device == "cpu":
        costs, compiled_costs = profile_under_timing_allocator(job)
    else:
        costs, compiled_costs = profile(job), profile(job, compiled=True) if with_compiled else None
    bench.costs = costs
    bench.emit("unit_start", setting=setting.describe(), blocks=len(costs), budgets=budgets,
               device=bench.device, device_name=pd.device_name(bench.device),
               backend=job["backend"], threads=torch.get_num_threads(), torch=torch.__version__,
               predicted_none_bytes=no_checkpoint_peak(costs), meter_problem=bench.meter_problem,
               predicted_none_compiled_bytes=no_checkpoint_peak(compiled_costs) if compiled_costs else None,
               profile_s=costs.info.get("profile_s"), outside_s=costs.outside_s,
               blocks_s=sum(b.fwd_s + b.bwd_s for b in costs.blocks))
    cs = pc.ContenderSet(base, pm.block_list, costs, job["backend"], compiled_costs)
    cs.references(compiled=with_compiled)
    for key in list(cs.contenders):
        bench.measure(cs.contenders[key])
    bench.choose_k(cs, budgets)
    plain = pm.build_model(setting, seed=job["seed"]).to(bench.device)
    ckptplan = ckptplan_peer.try_ckptplan(plain, pm.block_list(plain), bench.batch["input_ids"], budgets,
                                          job.get("ckptplan_path"))
    del plain
    bench.emit("ckptplan", **ckptplan)
    for budget in budgets:
        checkpointed = ckptplan.get("checkpointed", {}).get(f"{budget:g}")
        if checkpointed is not None:
            cs.add(pc.ckptplan_contender(cs.hand_written(), checkpointed), budget)
    for budget in budgets:
        cs.remat_static(budget)
        cs.remat_pgac(budget)
        cs.remat_dtr(budget)
    for key in list(cs.contenders):
        bench.measure(cs.contenders[key])
    if with_compiled:
        compiled_contenders(job, bench, cs, budgets)
    bench.timing_allocator_for_choices()  # where the compiled contenders did not switch already
    for budget in budgets:
        cs.remat_fit(budget, functools.partial(fit_eager_at, job, bench))
    for key in list(cs.contenders):
        bench.measure(cs.contenders[key])
    bench.emit("rows", rows=[r.__dict__ for r in cs.rows], refused=[r.__dict__ for r in cs.refused],
               contenders={k: {"name": c.name, "group": c.group, "exact": c.exact, "detail": c.detail,
                               "note": c.note, "grad_reference": c.grad_reference}
                           for k, c in cs.contenders.items()})
    bench.time_rounds(list(cs.contenders), cs.contenders)
    duel.duel_rounds(bench, cs)
    bench.emit("compilations", phase="unit", **compilation_counts())
    bench.emit("unit_done")


def compiled_contenders(job: dict[str, Any], bench: Bench, cs: pc.ContenderSet, budgets: list[float]) -> None:
    """``torch.compile``'s budgets and remat's compiled answers at each budget, built and measured after the eager
    contenders, each measured as soon as it is built (compilation is lazy: the measurement compiles).

    Whole-model compilations are shared: one backend per budget (``budget_backend``, remat's, one callable per
    budget in the process) compiles the reference (budget 1), each fraction's contender and the fit's trials,
    whose grid is the unit's fractions, so the unit compiles the whole model once per distinct budget. With
    ``compile_seconds`` in the job, no compiled contender is built once the compiled part has run that long; those
    not built are listed as refused, saying so."""
    started = time.perf_counter()
    limit = job.get("compile_seconds")
    before = compilation_counts()

    def out_of_time(budget: float, name: str) -> bool:
        spent = time.perf_counter() - started
        if limit is None or spent <= limit:
            return False
        cs.refused.append(pc.Refused(budget, name, pc.COMPILED, f"not built: the unit's compiled part had run "
                                     f"{spent:.0f} s of its {limit:g} s (--compile-seconds)"))
        return True

    graphs_by_contender: dict[str, int] = {}

    def measure_new() -> None:
        for key in list(cs.contenders):
            if key in bench.memory:
                continue
            graphs = compilation_counts()["graphs"]
            bench.measure(cs.contenders[key])
            graphs_by_contender[key] = compilation_counts()["graphs"] - graphs

    # Budgets of remat on compiled blocks: shares of torch.compile's peak by the allocator's events, the meter
    # whose figures the compiled blocks' profile predicts (the peak meters' where it did not run).
    compiled = bench.memory["compiled"]
    compiled_bytes = compiled["tracker_bytes"] or compiled["allocator_bytes"] or compiled["process_bytes"]
    compiled_share = {b: int(b * compiled_bytes) if compiled_bytes else None for b in budgets}
    for budget in budgets:
        if not out_of_time(budget, "torch.compile + activation_memory_budget"):
            cs.compile_budget(budget)
            measure_new()
        if not out_of_time(budget, "remat optimal on compiled blocks"):
            cs.remat_compiled(budget, compiled_share[budget])
            measure_new()
    bench.timing_allocator_for_choices()
    def counted(label: str, build: Callable[[], None]) -> None:
        graphs = compilation_counts()["graphs"]
        build()
        graphs_by_contender[label] = compilation_counts()["graphs"] - graphs
        measure_new()

    for budget in budgets:
        if not out_of_time(budget, pc.FITTED):
            counted(f"trials of {pc.FITTED} at {budget:g}", lambda b=budget: cs.compile_fitted(
                b, compiled_share[b], functools.partial(fit_whole_model, job, bench)))
        if job.get("choice_rounds", 5) and not out_of_time(budget, pc.FIT_COMPILED):
            counted(f"trials of {pc.FIT_COMPILED} at {budget:g}", lambda b=budget: cs.remat_fit_compiled(
                b, compiled_share[b], functools.partial(fit_compiled_at, job, bench)))
    after = compilation_counts()
    bench.emit("compilations", phase="compiled contenders", seconds=time.perf_counter() - started,
               by_contender=graphs_by_contender, **{k: after[k] - before[k] for k in after})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--profile":  # the profile's own process
        job = json.loads(args[1])
        torch.set_num_threads(job["threads"])
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        for compiled in (False, True) if wants_compiled(job) else (False,):
            emit({"record": "costs", "compiled": compiled, "table": profile(job, compiled).to_dict()})
        return 0
    if len(args) != 1:
        print("usage: python -m benchmarks.peers.child JOB_JSON (started by python -m benchmarks.peers)",
              file=sys.stderr)
        return 2
    with contextlib.suppress(BrokenPipeError):
        run(json.loads(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
