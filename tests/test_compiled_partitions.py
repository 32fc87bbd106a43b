"""Compiled blocks partitioned under torch.compile's activation memory budget (``partition:<budget>``): profiled
like any action, chosen per block by the planner, switched between steps without recompiling, measured within 5%
of their prediction by the allocation meter, with gradients bitwise equal to keep-all on the compiled blocks; on
blocks that draw random numbers (dropout) offered only where the variant saves what the forward drew (inductor,
a budget in (0, 1)).

The backend is mostly the counting ``aot_eager``-like one of ``test_integration_compile``, partitioning with
torch's min-cut partitioner (which reads the budget): no code generation; one test compiles with inductor."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from functorch.compile import min_cut_rematerialization_partition
from test_integration_compile import CountingCompiler
from torch import nn
from toy_models import lm_step

import remat
from remat.checkpointing import compiled_partitions
from remat.fitting import compile_blocks
from remat.planning import no_checkpoint_peak

BATCH_IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
BATCH = {"input_ids": BATCH_IDS, "labels": BATCH_IDS}
BUDGETS = (0.0, 0.5)


@pytest.fixture
def model() -> nn.Module:
    """A tiny Llama (no dropout)."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        vocab_size=256, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _applied(model: nn.Module, counter: CountingCompiler, budgets: tuple[float, ...] = BUDGETS) -> remat.RematHandle:
    handle = remat.apply(model, remat.Plan({fqn: "keep" for fqn, _ in remat.find_blocks(model)}))
    backend = counter.backend(partition_fn=min_cut_rematerialization_partition)  # the partitioner reading budgets
    compile_blocks(model, backend=backend, partition_budgets=budgets)
    return handle


def test_partitions_are_profiled_and_save_less_under_smaller_budgets(model: nn.Module) -> None:
    _applied(model, CountingCompiler())
    costs = remat.profile(model, BATCH, holds_output=False)
    for row in costs.blocks:
        assert set(row.saved_bytes) == {"keep", "checkpoint", "partition:0", "partition:0.5"}
        assert row.saved("partition:0") < row.saved("partition:0.5") < row.saved("keep")
        assert row.time_cost("partition:0") >= 0


def test_plans_with_partitions_fit_and_keep_gradients(model: nn.Module) -> None:
    counter = CountingCompiler()
    handle = _applied(model, counter)
    lm_step(model, BATCH)
    reference = lm_step(model, BATCH)  # keep-all on the compiled blocks
    costs = remat.profile(model, BATCH, holds_output=False)
    chosen = set()
    for share in (0.6, 0.75, 0.9):
        plan = remat.plan(costs, "optimal", share)
        chosen |= set(plan.actions.values())
        handle.set_plan(plan)
        lm_step(model, BATCH)  # a variant compiles on its first call
        calls = counter.calls
        with remat.measure("cpu", allocations=True) as measured:
            step = lm_step(model, BATCH)
        assert counter.calls > calls  # ran compiled, not eagerly
        assert measured.activation_bytes == pytest.approx(plan.predicted_peak_bytes, rel=0.05), plan.actions
        assert measured.activation_bytes <= share * no_checkpoint_peak(costs) * 1.02
        torch.testing.assert_close(step, reference, rtol=0, atol=0)  # loss and gradients bitwise
    assert any(compiled_partitions.is_partition(a) for a in chosen), chosen


def test_blocks_that_draw_random_numbers_are_not_partitioned(make_gpt2: Callable[..., nn.Module]) -> None:
    torch._dynamo.reset()
    dropout = make_gpt2(n_layer=2, n_embd=32, n_head=2, seed=0)  # dropout 0.1, training mode
    handle = _applied(dropout, CountingCompiler())
    costs = remat.profile(dropout, BATCH, holds_output=False)
    assert all(set(row.saved_bytes) == {"keep", "checkpoint"} for row in costs.blocks)
    handle.set_plan(remat.Plan({fqn: "partition:0.5" for fqn, _ in remat.find_blocks(dropout)}))  # by hand
    with pytest.raises(RuntimeError, match=r"drew random numbers .* under 'partition:0.5'"):
        lm_step(dropout, BATCH)
    dropout.eval()  # draws nothing: the same variants run
    lm_step(dropout, BATCH)
    without = make_gpt2(n_layer=2, n_embd=32, n_head=2, seed=0, dropout=0.0)
    _applied(without, CountingCompiler())
    costs = remat.profile(without, BATCH, holds_output=False)
    assert all("partition:0.5" in row.saved_bytes for row in costs.blocks)


def test_inductor_partitions_keep_dropout_exact(make_gpt2: Callable[..., nn.Module]) -> None:
    """Under inductor the variants of budgets in (0, 1) save the forward's seeds (``save_draws_pass``), so blocks
    with dropout are partitioned and their gradients stay bitwise equal to keep-all on the compiled blocks. torch's
    own budget path, without the pass, recomputes the seeds in the backward and the gradients differ
    (pytorch/pytorch#190758); under a budget of 0 torch recomputes everything, so it is not offered here."""
    torch._dynamo.reset()
    model = make_gpt2(n_layer=2, n_embd=32, n_head=2, seed=0)  # dropout 0.1, training mode
    handle = remat.apply(model, remat.Plan({fqn: "keep" for fqn, _ in remat.find_blocks(model)}))
    compile_blocks(model, backend="inductor", partition_budgets=(0.0, 0.5))
    reference = lm_step(model, BATCH)
    costs = remat.profile(model, BATCH, holds_output=False)
    assert all(set(row.saved_bytes) == {"keep", "checkpoint", "partition:0.5"} for row in costs.blocks)
    fqns = [fqn for fqn, _ in remat.find_blocks(model)]
    plan = remat.Plan.from_actions(costs, ["partition:0.5"] * len(fqns))
    handle.set_plan(plan)
    with remat.measure("cpu", allocations=True) as measured:
        step = lm_step(model, BATCH)
    assert measured.activation_bytes < 0.9 * no_checkpoint_peak(costs)
    assert measured.activation_bytes == pytest.approx(plan.predicted_peak_bytes, rel=0.05)
    torch.testing.assert_close(step, reference, rtol=0, atol=0)  # loss and gradients bitwise


def test_set_plan_switches_variants_without_recompiling(model: nn.Module) -> None:
    counter = CountingCompiler()
    handle = _applied(model, counter)
    fqns = [fqn for fqn, _ in remat.find_blocks(model)]
    plans = [remat.Plan({fqn: action for fqn in fqns}) for action in ("partition:0", "partition:0.5", "keep")]
    saved = []
    for plan in plans:  # each variant compiles once
        handle.set_plan(plan)
        lm_step(model, BATCH)
    graphs = counter.graphs
    for plan in plans * 2:
        handle.set_plan(plan)
        with remat.measure("cpu", allocations=True) as measured:
            lm_step(model, BATCH)
        saved.append(measured.activation_bytes)
    assert counter.graphs == graphs
    assert saved[:3] == saved[3:]
    assert saved[0] < saved[1] < saved[2]


def test_remove_puts_each_blocks_own_compiled_call_back(model: nn.Module) -> None:
    handle = _applied(model, CountingCompiler())
    blocks = [block for _, block in remat.find_blocks(model)]
    own = [block._compiled_call_impl for block in blocks]
    handle.set_plan(remat.Plan({fqn: "partition:0" for fqn, _ in remat.find_blocks(model)}))
    assert all(block._compiled_call_impl is not o for block, o in zip(blocks, own, strict=True))
    handle.remove()
    assert all(block._compiled_call_impl is o for block, o in zip(blocks, own, strict=True))


def test_partition_actions_name_what_is_missing(model: nn.Module) -> None:
    eager = copy.deepcopy(model)
    handle = _applied(model, CountingCompiler())
    fqns = [fqn for fqn, _ in remat.find_blocks(model)]
    with pytest.raises(ValueError, match=r"not compiled for that budget \(it has \['partition:0', 'partition:0.5'\]"):
        handle.set_plan(remat.Plan({fqn: "partition:0.3" for fqn in fqns}))
    assert handle.plan.actions == {fqn: "keep" for fqn in fqns}  # the refused plan left the handle as it was
    with pytest.raises(ValueError, match=r"budget in \[0, 1\)"):
        remat.Plan({fqn: "partition:1.5" for fqn in fqns})
    with pytest.raises(ValueError, match="partition_budgets="):
        remat.apply(eager, remat.Plan({fqn: "partition:0.5" for fqn in fqns}))
    with pytest.raises(ValueError, match="is not compiled"):
        compiled_partitions.add_partitions(nn.Linear(2, 2), [0.5])
    with pytest.raises(ValueError, match="called more than once"):
        compiled_partitions.variants_for([("layers.0", eager.model.layers[0])], [{"partition:0.5", "keep"}])


def test_save_draws_pass_marks_seeded_operators_after_the_passes_before_it() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    draw = graph.call_function(torch.ops.aten.rand_like.default, (x,))
    plain = graph.call_function(torch.ops.aten.mul.Tensor, (x, draw))
    graph.output(plain)
    seen: list[str] = []
    mark = compiled_partitions.save_draws_pass([lambda g: seen.append("first"), lambda g: seen.append("second")])
    mark(graph)
    assert seen == ["first", "second"]
    assert draw.meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert "recompute" not in plain.meta
    assert compiled_partitions.save_draws_pass().uuid() != mark.uuid()
    assert compiled_partitions.saves_draws_under("inductor", None, 0.5)
    assert not compiled_partitions.saves_draws_under("inductor", None, 0.0)
    assert not compiled_partitions.saves_draws_under("aot_eager", None, 0.5)
    assert not compiled_partitions.saves_draws_under("inductor", {"joint_custom_post_pass": None}, 0.5)


class _Marks:
    """A tracker's readings by mark, as ``ByteTerms.from_trackers`` reads them."""

    def __init__(self, fwd_peak: int, saved: int, bwd_peak: int) -> None:
        self.fwd_peak, self.saved, self.bwd_peak = fwd_peak, saved, bwd_peak

    def bytes_at(self, mark: str) -> int:
        assert mark == "fwd_end"
        return self.saved

    def summits_between(self, start: str, end: str) -> list[int]:
        """A run whose forward and backward each have one summit, their peak."""
        return [self.fwd_peak if (start, end) == ("start", "fwd_end") else self.bwd_peak]


def test_a_partitions_backward_term_is_its_own_peak_below_or_above_keeps() -> None:
    """A partitioned backward recomputes only what the compiled backward needs next, so its peak may stay below
    keep's; its forward computes what keep's does while saving less, so its own forward peak bounds it too."""
    from remat.profiling.block_bytes import ByteTerms

    keep = _Marks(fwd_peak=100, saved=80, bwd_peak=120)
    lower = ByteTerms.from_trackers({"keep": keep, "partition:0.1": _Marks(fwd_peak=100, saved=10, bwd_peak=60)})
    assert lower.bwd_extra == {"partition:0.1": 100 - 120}  # the forward's peak, above the backward's
    low = ByteTerms.from_trackers({"keep": keep, "partition:0.1": _Marks(fwd_peak=40, saved=10, bwd_peak=60)})
    assert low.bwd_extra == {"partition:0.1": 60 - 120}
    checkpointed = ByteTerms.from_trackers({"keep": keep, "checkpoint": _Marks(fwd_peak=40, saved=10, bwd_peak=60)})
    assert checkpointed.bwd_extra == {}  # others are read as rebuilding keep's saved tensors, never lower
