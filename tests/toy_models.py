"""Small models the foundation tests share: chains of MLP blocks, tiny Hugging Face models built from their
config classes (nothing is downloaded), synthetic cost tables, a helper that runs one training step and returns
its loss and gradients, and a device of a given memory emulated on the CPU (:class:`DeviceOf`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat import Plan, apply, find_blocks, measure
from remat.core import CHECKPOINT, KEEP, OFFLOAD, BlockCost, CostTable
from remat.meters import LiveTensorTracker


class MLPBlock(nn.Module):
    """``x -> fc2(gelu(fc1(x)))`` with dropout, plus ``x`` when the widths match (a residual block)."""

    def __init__(self, d_in: int, d_out: int | None = None, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        d_out = d_in if d_out is None else d_out
        hidden = 4 * d_in if hidden is None else hidden
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d_out)
        self.drop = nn.Dropout(dropout)
        self.residual = d_in == d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.fc2(self.act(self.fc1(x))))
        return x + y if self.residual else y


class GeluBlock(nn.Module):
    """A residual 64 -> 256 -> 64 MLP with GELU, as the compiled-route tests compile it."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MLPChain(nn.Module):
    """An input projection, a ``nn.Sequential`` chain of :class:`MLPBlock` and a scalar head.

    ``widths`` are the widths between blocks: block ``i`` maps ``widths[i]`` to ``widths[i + 1]``; ``dropout``
    is one rate for every block or one per block.
    """

    def __init__(
        self,
        widths: Sequence[int],
        d_in: int = 8,
        dropout: float | Sequence[float] = 0.0,
        hidden: int | None = None,
    ):
        super().__init__()
        n = len(widths) - 1
        rates = [float(dropout)] * n if isinstance(dropout, int | float) else list(dropout)
        self.inp = nn.Linear(d_in, widths[0])
        self.blocks = nn.Sequential(
            *[MLPBlock(widths[i], widths[i + 1], hidden=hidden, dropout=rates[i]) for i in range(n)]
        )
        self.head = nn.Linear(widths[-1], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x))).square().mean()


def uniform_chain(n_blocks: int, width: int = 32, dropout: float = 0.1, d_in: int = 8) -> MLPChain:
    return MLPChain([width] * (n_blocks + 1), d_in=d_in, dropout=dropout)


def seeded_chain(n_blocks: int = 6, dropout: float = 0.2) -> MLPChain:
    """A :func:`uniform_chain` of width 16 with the weights of seed 0."""
    torch.manual_seed(0)
    return uniform_chain(n_blocks, width=16, dropout=dropout)


def chain_input(batch: int = 5, d_in: int = 8) -> torch.Tensor:
    """A fixed input for the chains above."""
    return torch.randn(batch, d_in, generator=torch.Generator().manual_seed(11))


def chain_costs(model: nn.Module) -> CostTable:
    """:func:`uniform_costs` for the blocks ``remat.find_blocks`` finds in ``model``."""
    return uniform_costs([name for name, _ in find_blocks(model)])


def hook_count(module: nn.Module) -> int:
    """Forward hooks and pre-hooks of every kind registered on ``module`` itself."""
    return sum(
        len(getattr(module, name))
        for name in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
        )
    )


def step(model: nn.Module, *inputs: torch.Tensor, seed: int = 1234) -> tuple[torch.Tensor, dict[str, Any]]:
    """One forward and backward from a fixed RNG seed; returns the loss and every gradient (parameters by
    name, and the inputs as ``"input:<i>"``), cloned."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    loss = model(*leaves)
    loss.backward()
    grads: dict[str, Any] = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    for i, leaf in enumerate(leaves):
        grads[f"input:{i}"] = None if leaf.grad is None else leaf.grad.clone()
    return loss.detach(), grads


def assert_same_step(a: tuple[torch.Tensor, dict[str, Any]], b: tuple[torch.Tensor, dict[str, Any]]) -> None:
    """Bit-for-bit equal losses and gradients."""
    assert torch.equal(a[0], b[0]), f"losses differ: {a[0].item()} vs {b[0].item()}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        ga, gb = a[1][name], b[1][name]
        assert (ga is None) == (gb is None), f"gradient of {name} is None in one run only"
        if ga is not None:
            assert torch.equal(ga, gb), f"gradient of {name} differs (max abs diff {(ga - gb).abs().max()})"


def uniform_costs(fqns: Sequence[str], *, keep: int = 1000, io: int = 100, temp: int = 50) -> CostTable:
    """A synthetic cost table of identical blocks (bytes and seconds chosen by hand)."""
    rows = [
        BlockCost(
            fqn=f,
            fwd_s=1e-3,
            bwd_s=2e-3,
            input_bytes=io,
            output_bytes=io,
            saved_bytes={
                KEEP: keep,
                CHECKPOINT: io,
                OFFLOAD: io,
                "selective:dots_saveable": keep // 2,
                "selective:everything_saveable": keep,
            },
            recompute_s={
                KEEP: 0.0,
                CHECKPOINT: 1e-3,
                OFFLOAD: 5e-4,
                "selective:dots_saveable": 4e-4,
                "selective:everything_saveable": 0.0,
            },
            fwd_temp_bytes=temp,
            bwd_temp_bytes=temp,
        )
        for f in fqns
    ]
    return CostTable(rows, stem_bytes=io, head_bytes=io)


class ScaledInPlace(nn.Module):
    """A block that changes a matmul's output in place after the matmul (as ``router_top_value /= ...`` does in
    Mixtral's router, or ``hidden += residual`` in ResNet): a policy saving the matmul output cannot run here."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        h /= h.detach().abs().amax() + 1
        return torch.tanh(h) + x


def tiny_gpt2_config(
    n_layer: int = 2,
    n_embd: int = 64,
    *,
    n_head: int = 4,
    n_positions: int = 128,
    vocab: int = 256,
    dropout: float = 0.1,
    use_cache: bool = False,
    attn_implementation: str | None = "eager",
    **overrides: Any,
) -> Any:
    """A small ``GPT2Config``: dropout ``dropout`` in the embeddings, attention and residuals, token 0 as BOS and
    EOS, no KV cache and eager attention (the ``s x s`` scores exist) unless asked otherwise;
    ``attn_implementation=None`` leaves the library's default. ``overrides`` are further config fields."""
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=vocab,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=use_cache,
        attn_implementation=attn_implementation,
        **overrides,
    )


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, *, seed: int | None = None, **config_options: Any) -> nn.Module:
    """A ``GPT2LMHeadModel`` from :func:`tiny_gpt2_config` in training mode (nothing is downloaded); its weights
    are drawn from the global RNG, seeded with ``seed`` first when one is given."""
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2_config(n_layer, n_embd, **config_options)
    if seed is not None:
        torch.manual_seed(seed)
    return GPT2LMHeadModel(config).train()


def lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """One step of a language model returning ``.loss`` (dropout drawn from seed 5): loss and gradients."""
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def planned_lm_step(
    model: nn.Module, batch: dict[str, torch.Tensor], costs: CostTable, actions: Sequence[str]
) -> tuple[tuple[torch.Tensor, dict[str, Any]], int, Plan]:
    """:func:`lm_step` under the plan of ``actions`` on ``costs``: the step, its measured activation bytes
    and the plan (removed from the model afterwards)."""
    plan = Plan.from_actions(costs, list(actions))
    handle = apply(model, plan)
    try:
        with measure() as measured:
            result = lm_step(model, batch)
    finally:
        handle.remove()
    return result, measured.activation_bytes, plan


def resident_bytes(model: nn.Module, *optimizers: torch.optim.Optimizer) -> int:
    """What a training step starts with on the device: parameters, their gradients where they exist, and the
    optimizers' state, each storage once (a sharded tensor's local shard)."""
    tensors: list[Any] = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    for optimizer in optimizers:
        tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in local}.values())


class DeviceOf(LiveTensorTracker):
    """A device of ``capacity`` bytes, on the CPU: while the mode is active every storage an operator makes counts
    as long as it lives, and the allocation that takes the count beyond ``capacity`` raises
    ``torch.OutOfMemoryError``, as CUDA's allocator does. What existed before (parameters, optimizer state) is
    not counted: ``capacity`` is what the steps may add to it. ``refused`` counts the allocations refused."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.refused = 0

    def allocated(self, event_id: int, t: torch.Tensor) -> None:
        if self.live_bytes > self.capacity:
            self.refused += 1
            raise torch.OutOfMemoryError(
                f"emulated device: {t.untyped_storage().nbytes()} bytes asked with {self.live_bytes} of "
                f"{self.capacity} in use"
            )
