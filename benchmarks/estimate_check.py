"""The transformer activation formula next to a measured Hugging Face GPT-2 layer.

Run: ``python -m benchmarks.estimate_check``. One GPT-2 layer (bfloat16, dropout 0.1, GELU in its single
tanh kernel) runs forward with gradients; the bytes autograd keeps for backward are counted with
``saved_tensors_hooks`` (each storage once, weights excluded, the layer input included, as the formula
counts it) and printed next to ``transformer_layer_activation_bytes``.

On a GPU the layer is h=1024, 16 heads, s=1024, b=4, and the eager (s x s scores), no-dropout and SDPA
(fused attention) variants are measured too; dropout masks are 1-byte booleans there. On CPU the layer is
h=256, 4 heads, s=256, b=2, with eager attention; eager CPU dropout keeps its masks in bfloat16 (2 bytes),
so the formula is evaluated with ``mask_bytes=2`` as well.
"""

from __future__ import annotations

import torch
import transformers

from remat.core import format_bytes
from remat.profiling import transformer_layer_activation_bytes


def saved_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    weights = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(n for ptr, n in seen.items() if ptr not in weights)


def measure(device: str, s: int, b: int, h: int, a: int, attention: str, dropout: float) -> int:
    config = transformers.GPT2Config(
        n_embd=h, n_head=a, n_layer=1, n_positions=s, vocab_size=128, bos_token_id=0, eos_token_id=0,
        activation_function="gelu_pytorch_tanh", attn_implementation=attention,
        resid_pdrop=dropout, attn_pdrop=dropout, embd_pdrop=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = transformers.GPT2Model(config).h[0].to(device=device, dtype=torch.bfloat16).train()
    x = torch.randn(b, s, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    return saved_bytes(layer, x)


def report(name: str, measured: int, predicted: int) -> None:
    error = (predicted - measured) / measured
    print(f"{name:<44} {format_bytes(measured):>12} {format_bytes(predicted):>12} {error:>+8.1%}")


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    s, b, h, a = (1024, 4, 1024, 16) if cuda else (256, 2, 256, 4)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"GPT-2 layer, bfloat16, s={s} b={b} h={h} a={a}, on {name}")
    print(f"{'variant':<44} {'measured':>12} {'formula':>12} {'error':>8}")
    eager = measure(device, s, b, h, a, "eager", 0.1)
    report("eager attention, dropout (34sbh + 5as²b)", eager, transformer_layer_activation_bytes(s, b, h, a))
    report("  same, masks in bf16 (mask_bytes=2)", eager, transformer_layer_activation_bytes(s, b, h, a, mask_bytes=2))
    no_dropout = measure(device, s, b, h, a, "eager", 0.0)
    report("eager attention, no dropout", no_dropout, transformer_layer_activation_bytes(s, b, h, a, dropout=False))
    if cuda:
        fused = measure(device, s, b, h, a, "sdpa", 0.1)
        report(
            "SDPA (fused) attention, dropout",
            fused,
            transformer_layer_activation_bytes(s, b, h, a, flash_attention=True),
        )


if __name__ == "__main__":
    main()
