"""The checkpoint API: ``remat.checkpoint``, ``checkpointed``, ``Checkpoint``, ``checkpoint_fn`` and the per-op
policies. Each behaviour is checked by what it does to memory (bytes alive after the forward), to work
(calls and operators re-run in backward) and to gradients (bit-for-bit equal to no checkpointing)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from toy_models import MLPBlock

import remat
import remat.checkpointing.api
from remat.meters import LiveTensorTracker

aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.matmul}


class CountingModule(nn.Module):
    """Wraps a module and counts its forward calls."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


class OpCounter(TorchDispatchMode):
    """Counts calls of each aten overload packet while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        packet = func.overloadpacket
        self.counts[packet] = self.counts.get(packet, 0) + 1
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> int:
        return sum(n for op, n in self.counts.items() if op in MATMULS)


def mlp(width: int = 32, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return MLPBlock(width, width, hidden=4 * width, dropout=dropout)


def bytes_after_forward(run) -> tuple[int, torch.Tensor]:  # noqa: ANN001
    """Bytes created by ``run()`` still alive when it returns (what the forward keeps for backward, plus
    its output), and the output, after a backward that must succeed."""
    tracker = LiveTensorTracker()
    with tracker:
        out = run()
        tracker.mark("forward_end")
        out.sum().backward()
    tracker.close()
    return tracker.bytes_at("forward_end", exclude_survivors=False), out


def grads_of(module: nn.Module, *leaves: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone() for x in leaves]


# ---------------------------------------------------------------- grad disabled: a plain call


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_plain_call_when_grad_is_disabled(monkeypatch: pytest.MonkeyPatch, context: Any) -> None:
    frames = []
    real = remat.checkpointing.api._torch_checkpoint
    monkeypatch.setattr(remat.checkpointing.api, "_torch_checkpoint", lambda *a, **k: frames.append(1) or real(*a, **k))
    block = CountingModule(mlp())
    x = torch.randn(4, 32, requires_grad=True)
    with context():
        y = remat.checkpoint(block, x)
        z = remat.checkpoint_fn(block, x, use_reentrant=False)
    assert frames == [] and block.calls == 2
    assert y.grad_fn is None and z.grad_fn is None
    assert torch.equal(y, block.inner(x).detach())
    remat.checkpoint(block, x)  # with grad on, the same spy sees a checkpoint frame
    assert frames == [1]


# ---------------------------------------------------------------- only inputs are saved


def test_only_the_output_is_alive_after_a_checkpointed_forward() -> None:
    block = mlp()
    x = torch.randn(16, 32, requires_grad=True)
    plain, out = bytes_after_forward(lambda: block(x))
    kept, out_ck = bytes_after_forward(lambda: remat.checkpoint(block, x))
    output_bytes = out.numel() * out.element_size()
    # Inside the region nothing is stored: the only storage created there and alive is the output.
    assert kept == output_bytes
    # Without checkpointing the hidden activations (16 x 128, twice) are stored as well.
    assert plain >= output_bytes + 2 * 16 * 128 * 4
    assert torch.equal(out, out_ck)


def test_activation_memory_of_a_chain_is_lower_and_each_block_reruns_once() -> None:
    blocks = [CountingModule(mlp(64)) for _ in range(4)]
    x = torch.randn(32, 64, requires_grad=True)

    def run(checkpointed: bool) -> int:
        for b in blocks:
            b.zero_grad(set_to_none=True)
        with remat.measure() as report:
            h = x
            for b in blocks:
                h = remat.checkpoint(b, h) if checkpointed else b(h)
            h.sum().backward()
        return report.activation_bytes

    plain = run(False)
    assert [b.calls for b in blocks] == [1] * 4
    checkpointed = run(True)
    assert [b.calls for b in blocks] == [3] * 4  # forward, then one re-run in backward
    assert checkpointed < plain / 2


def test_gradients_equal_no_checkpoint() -> None:
    block = mlp()
    x = torch.randn(8, 32, requires_grad=True)
    block(x).square().sum().backward()
    ref = grads_of(block, x)
    block.zero_grad()
    x.grad = None
    remat.checkpoint(block, x).square().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(ref, grads_of(block, x), strict=True))


def test_nested_checkpoints() -> None:
    inner, outer = CountingModule(mlp()), CountingModule(mlp())
    x = torch.randn(8, 32, requires_grad=True)

    def region(t: torch.Tensor) -> torch.Tensor:
        return outer(remat.checkpoint(inner, t)).tanh()

    region(x).sum().backward()
    ref = grads_of(inner, x) + grads_of(outer)
    inner.zero_grad(), outer.zero_grad()
    x.grad = None
    inner.calls = outer.calls = 0
    kept, out = bytes_after_forward(lambda: remat.checkpoint(region, x))
    assert kept == out.numel() * out.element_size()
    assert all(torch.equal(a, b) for a, b in zip(ref, grads_of(inner, x) + grads_of(outer), strict=True))
    assert outer.calls == 2 and inner.calls >= 2


# ---------------------------------------------------------------- containers and keyword arguments


@dataclass
class Pair:
    first: torch.Tensor
    label: str


def test_containers_of_tensors_and_other_values_in_and_out() -> None:
    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    c = torch.randn(5, requires_grad=True)
    d = torch.randn(5, requires_grad=True)

    def fn(pair: Pair, items: list[Any], table: dict[str, Any], both: tuple[Any, ...], *, scale: float):
        assert pair.label == "p" and items[1] == "text" and table["n"] == 3 and both[1] is None
        s = (pair.first.sin() * items[0] + table["t"].exp() * table["n"]) * scale
        return {"sum": s, "tag": "out"}, [s.cos(), 7], Pair(both[0].tanh() * s, "q")

    def run(checkpointed: bool) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
        for t in (a, b, c, d):
            t.grad = None
        args = (Pair(a, "p"), [b, "text"], {"t": c, "n": 3}, (d, None))
        out = remat.checkpoint(fn, *args, scale=0.5) if checkpointed else fn(*args, scale=0.5)
        table, items, pair = out
        (table["sum"].sum() + items[0].sum() + pair.first.sum()).backward()
        return [t.grad.clone() for t in (a, b, c, d)], out

    ref, ref_out = run(False)
    got, out = run(True)
    assert out[0]["tag"] == "out" and out[1][1] == 7 and isinstance(out[2], Pair) and out[2].label == "q"
    assert torch.equal(out[0]["sum"], ref_out[0]["sum"])
    assert all(torch.equal(x, y) for x, y in zip(ref, got, strict=True))


def test_keyword_arguments_pass_through_including_tensors() -> None:
    x = torch.randn(6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)

    def fn(t: torch.Tensor, *, bias: torch.Tensor, power: int = 1, name: str = "") -> torch.Tensor:
        assert name == "kw"
        return (t * bias).pow(power).sum()

    fn(x, bias=bias, power=3, name="kw").backward()
    ref = (x.grad.clone(), bias.grad.clone())
    x.grad = bias.grad = None
    remat.checkpoint(fn, x, bias=bias, power=3, name="kw").backward()
    assert torch.equal(x.grad, ref[0]) and torch.equal(bias.grad, ref[1])


# ---------------------------------------------------------------- RNG and autocast


def _dropout_grads(preserve: bool | None) -> list[torch.Tensor]:
    block = mlp(64, dropout=0.5)
    x = torch.randn(16, 64, requires_grad=True, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    if preserve is None:
        out = block(x)
    else:
        out = remat.checkpoint(block, x, preserve_rng_state=preserve)
    torch.rand(100)  # other random work between forward and backward moves the RNG on
    out.square().sum().backward()
    return grads_of(block, x)


def test_dropout_gives_exactly_the_same_gradients() -> None:
    ref = _dropout_grads(None)
    assert all(torch.equal(a, b) for a, b in zip(ref, _dropout_grads(True), strict=True))
    # Without the preserved state the recomputation draws another mask: the guarantee is not vacuous.
    assert not all(torch.equal(a, b) for a, b in zip(ref, _dropout_grads(False), strict=True))


def test_autocast_bfloat16_on_cpu() -> None:
    torch.manual_seed(0)
    block = MLPBlock(32, 16, dropout=0.2)  # no residual: the output keeps the autocast dtype
    x = torch.randn(8, 32, requires_grad=True)

    def run(checkpointed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        block.zero_grad()
        x.grad = None
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = remat.checkpoint(block, x) if checkpointed else block(x)
        out.float().square().sum().backward()
        return out, grads_of(block, x)

    ref_out, ref = run(False)
    out, got = run(True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


# ---------------------------------------------------------------- decorator and module wrapper


def test_decorator_forms() -> None:
    block = mlp()

    @remat.checkpointed
    def plain_region(t: torch.Tensor) -> torch.Tensor:
        """Doc kept."""
        return block(t)

    @remat.checkpointed(policy="dots_saveable")
    def selective_region(t: torch.Tensor) -> torch.Tensor:
        return block(t)

    assert plain_region.__name__ == "plain_region" and plain_region.__doc__ == "Doc kept."
    x = torch.randn(16, 32, requires_grad=True)
    full, out = bytes_after_forward(lambda: plain_region(x))
    selective, _ = bytes_after_forward(lambda: selective_region(x))
    nothing, _ = bytes_after_forward(lambda: block(x))
    assert full == out.numel() * out.element_size()
    assert full < selective < nothing


def test_checkpoint_module_inside_sequential() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(mlp(), nn.LayerNorm(32), mlp())
    torch.manual_seed(1)
    wrapped = nn.Sequential(remat.Checkpoint(mlp()), nn.LayerNorm(32), remat.Checkpoint(MLPBlock(32)))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert not torch.equal(wrapped[2].fc1.weight, plain[2].fc1.weight)
    wrapped.load_state_dict(plain.state_dict())  # strict: every key matches
    for key, value in plain.state_dict().items():
        assert torch.equal(wrapped.state_dict()[key], value)
    assert wrapped[2].fc1 is wrapped[2].module.fc1  # attributes reach the wrapped module

    x = torch.randn(8, 32, requires_grad=True)
    plain[2](x).sum().backward()
    ref = grads_of(plain[2], x)
    x.grad = None
    kept, _ = bytes_after_forward(lambda: wrapped[2](x))
    assert kept == 8 * 32 * 4
    assert all(torch.equal(a, b) for a, b in zip(ref, grads_of(wrapped[2].module, x), strict=True))
    counted = CountingModule(wrapped[0].module)
    wrapped[0].module = counted
    wrapped(x).sum().backward()
    assert counted.calls == 2


def test_checkpoint_module_round_trips_its_own_state_dict() -> None:
    src, dst = remat.Checkpoint(mlp()), remat.Checkpoint(MLPBlock(32, 32))
    assert set(src.state_dict()) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    dst.load_state_dict(src.state_dict())
    x = torch.randn(3, 32)
    assert torch.equal(dst(x), src(x))
    assert "policy=dots_saveable" in repr(remat.Checkpoint(mlp(), policy="dots_saveable"))


# ---------------------------------------------------------------- policies


def _backward_ops(block: nn.Module, policy: Any, use_checkpoint: bool = True) -> tuple[OpCounter, int]:
    """Operators run during the backward of one block, and the bytes alive after its forward."""
    x = torch.randn(16, 32, requires_grad=True)
    tracker = LiveTensorTracker()
    with tracker:
        out = remat.checkpoint(block, x, policy=policy) if use_checkpoint else block(x)
        tracker.mark("forward_end")
        counter = OpCounter()
        with counter:
            out.sum().backward()
    tracker.close()
    return counter, tracker.bytes_at("forward_end", exclude_survivors=False)


def test_dots_saveable_keeps_matmuls_and_recomputes_the_rest() -> None:
    block = mlp()
    plain_ops, plain_bytes = _backward_ops(block, None, use_checkpoint=False)
    full_ops, full_bytes = _backward_ops(block, None)
    dots_ops, dots_bytes = _backward_ops(block, "dots_saveable")
    assert full_bytes < dots_bytes < plain_bytes
    # The forward's linear layers are addmm; the backward's own products are mm. Under dots_saveable the
    # backward runs only its own matmuls ...
    assert plain_ops.counts.get(aten.addmm, 0) == 0
    assert dots_ops.counts.get(aten.addmm, 0) == 0 and dots_ops.matmuls() == plain_ops.matmuls()
    # ... while full checkpointing re-runs the first linear layer (the second one's output is not needed,
    # so torch stops the recomputation before it).
    assert full_ops.counts.get(aten.addmm, 0) == 1 and full_ops.matmuls() == plain_ops.matmuls() + 1
    # The GELU is recomputed under dots_saveable (its forward runs in backward), never without checkpoint.
    assert dots_ops.counts.get(aten.gelu, 0) == 1 and plain_ops.counts.get(aten.gelu, 0) == 0


def test_save_only_and_save_all_but() -> None:
    block = mlp()
    plain_ops, _ = _backward_ops(block, None, use_checkpoint=False)
    only_mm, only_mm_bytes = _backward_ops(block, remat.policies.save_only("addmm"))
    dots_ops, dots_bytes = _backward_ops(block, "dots_saveable")
    assert only_mm.matmuls() == dots_ops.matmuls() and only_mm_bytes == dots_bytes
    assert only_mm.counts.get(aten.addmm, 0) == 0 and only_mm.counts.get(aten.gelu, 0) == 1
    only_gelu, _ = _backward_ops(block, remat.policies.save_only(aten.gelu))
    assert only_gelu.counts.get(aten.addmm, 0) == 1 and only_gelu.counts.get(aten.gelu, 0) == 0
    but_gelu, _ = _backward_ops(block, remat.policies.save_all_but("aten.gelu"))
    assert but_gelu.counts.get(aten.addmm, 0) == 0 and but_gelu.counts.get(aten.gelu, 0) == 1
    assert but_gelu.matmuls() == plain_ops.matmuls()
    assert remat.policies.save_only("addmm").name == "save_only(addmm)"


def test_user_callable_policy_sees_every_forward_op() -> None:
    seen = []

    def save_linear_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append(op.overloadpacket)
        return op.overloadpacket is aten.addmm

    block = mlp()
    plain_ops, _ = _backward_ops(block, None, use_checkpoint=False)
    ops, _ = _backward_ops(block, save_linear_outputs)
    assert aten.addmm in seen and aten.gelu in seen
    assert ops.counts.get(aten.addmm, 0) == 0 and ops.matmuls() == plain_ops.matmuls()


def test_policies_give_exact_gradients() -> None:
    block = mlp(dropout=0.3)
    x = torch.randn(8, 32, requires_grad=True)
    results = []
    for policy in (None, "nothing_saveable", "everything_saveable", *remat.policies.MENU):
        block.zero_grad()
        x.grad = None
        torch.manual_seed(3)
        out = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
        out.square().sum().backward()
        results.append(grads_of(block, x))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], got, strict=True))


def test_policy_errors() -> None:
    with pytest.raises(ValueError, match="unknown policy 'dots_savable'.*dots_saveable"):
        remat.checkpoint(mlp(), torch.randn(2, 32, requires_grad=True), policy="dots_savable")
    with pytest.raises(ValueError, match="no 'not_an_op'"):
        remat.policies.save_only("aten.not_an_op")
    with pytest.raises(TypeError, match="a policy is a name"):
        remat.policies.get(3)


def test_register_a_named_policy() -> None:
    policy = remat.policies.register(remat.policies.save_only("addmm", name="test_linear_only"))
    assert remat.policies.get("test_linear_only") is policy
    assert "test_linear_only" in remat.policies.names()


# ---------------------------------------------------------------- checkpoint_fn, a drop-in replacement


def test_checkpoint_fn_drops_reentrant_and_rng_options() -> None:
    block = CountingModule(mlp())
    x = torch.randn(8, 32)  # no input requires grad: the reentrant form would give no parameter gradients
    out = remat.checkpoint_fn(block, x, use_reentrant=True, preserve_rng_state=True)
    assert "CheckpointFunction" not in type(out.grad_fn).__name__
    out.sum().backward()
    assert block.calls == 2
    assert all(p.grad is not None for p in block.parameters())


def test_checkpoint_fn_with_torch_checkpoint_wrapper() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    reference = mlp(dropout=0.5)
    counted = CountingModule(mlp(dropout=0.5))
    wrapped = checkpoint_wrapper(counted, checkpoint_fn=remat.checkpoint_fn, use_reentrant=True)
    assert list(wrapped.state_dict()) == ["inner." + k for k in reference.state_dict()]
    x = torch.randn(8, 32)
    torch.manual_seed(5)
    reference(x).square().sum().backward()
    torch.manual_seed(5)
    out = wrapped(x)
    out.square().sum().backward()
    assert counted.calls == 2
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), counted.parameters(), strict=True))


def test_checkpoint_fn_says_once_that_it_runs_the_non_reentrant_form(monkeypatch) -> None:
    from remat.checkpointing import api

    monkeypatch.setattr(api, "_REENTRANT_WARNED", False)
    block, x = mlp(), torch.randn(4, 32, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant=True and runs torch's non-reentrant checkpoint"):
        remat.checkpoint_fn(block, x, use_reentrant=True).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.checkpoint_fn(block, x, use_reentrant=True).sum().backward()  # once per process
        remat.checkpoint_fn(block, x, use_reentrant=False).sum().backward()
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        remat.checkpoint(block, x, use_reentrant=True)


def test_checkpoint_fn_refuses_a_policy_with_a_context_fn_and_names_its_own_policy_argument() -> None:
    block, x = mlp(), torch.randn(4, 32, requires_grad=True)
    with pytest.raises(ValueError, match="got policy= and context_fn="):
        remat.checkpoint_fn(block, x, policy="dots_saveable", context_fn=lambda: None)

    def scaled(t: torch.Tensor, policy: str = "double") -> torch.Tensor:
        return block(t) * (2 if policy == "double" else 1)

    with pytest.raises(ValueError, match=r"bind it first: checkpoint_fn\(functools.partial"):
        remat.checkpoint_fn(scaled, x, policy="double")
    bound = remat.checkpoint_fn(functools.partial(scaled, policy="double"), x)  # the way out the error names
    assert torch.equal(bound, scaled(x, policy="double"))
