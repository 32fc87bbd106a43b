"""The activations one transformer layer keeps for backward, from its shape alone.

:func:`transformer_layer_activation_bytes` is the formula ``s*b*h*(34 + 5*a*s/h)`` (16-bit activations,
dropout, attention that stores its scores) with its variants: no dropout, fused attention, ReLU, float32, a
fully recomputed layer. Each term is derived in the function's docstring.
"""

from __future__ import annotations


def transformer_layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    bytes_per_element: int = 2,
    mask_bytes: int = 1,
    dropout: bool = True,
    flash_attention: bool = False,
    activation: str = "gelu",
    full_recompute: bool = False,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Bytes of activations one transformer layer keeps for its backward pass.

    ``s`` sequence length, ``b`` batch size, ``h`` hidden size, ``a`` attention heads. With 16-bit
    activations (``bytes_per_element=2``), 1-byte dropout masks, dropout, GELU and attention that stores its
    scores, this is ``s*b*h*(34 + 5*a*s/h)`` = ``34sbh + 5as²b``. Term by term, with ``p`` bytes per
    element and ``m`` bytes per mask element:

    Attention block, ``x_out = softmax(QK^T/sqrt(d)) V W_o + x``:

    1. Q, K and V projections keep their common input x: ``p·sbh``.
    2. ``QK^T`` keeps Q and K: ``2p·sbh``.
    3. softmax keeps its result, ``a`` score matrices of ``s x s`` per sequence: ``p·as²b``.
    4. dropout on the attention probabilities keeps its mask: ``m·as²b``.
    5. ``probs · V`` keeps the (dropped-out) probabilities and V: ``p·as²b + p·sbh``.
    6. the output projection keeps its input, its dropout a mask: ``p·sbh + m·sbh``.

    That is ``11sbh + 5as²b`` for ``p=2, m=1``. MLP block, ``x = f(x_out W_1) W_2 + x_out`` (4h inner):

    1. the first linear keeps its input: ``p·sbh``.
    2. GELU keeps its input: ``4p·sbh``; ReLU needs only its output, which the next linear keeps anyway,
       so nothing more (``activation="relu"``; SiLU counts as GELU).
    3. the second linear keeps its input: ``4p·sbh``.
    4. dropout keeps a mask: ``m·sbh``.

    That is ``19sbh``. The two layer norms keep their inputs: ``2p·sbh`` (their per-token mean and variance
    are ignored). Total ``34sbh + 5as²b``.

    Variants: ``dropout=False`` drops the three masks, and the softmax result is then the very tensor
    ``probs · V`` keeps, so the ``s²`` term is stored once: ``32sbh + 2as²b``. ``flash_attention=True``
    (fused attention) keeps no ``s x s`` tensor at all, only Q, K, V, its output and a float32 log-sum-exp
    per row and head (``4asb``; dropout there is replayed from the RNG state, no mask):
    ``34sbh + 4asb``. ``activation="relu"``: ``26sbh + 5as²b``. ``bytes_per_element=4`` (float32, masks
    still 1 byte): ``66sbh + 9as²b``. ``mask_bytes``: GPUs keep dropout masks as 1-byte booleans; eager
    CPU dropout keeps them in the activation dtype (``mask_bytes=bytes_per_element``).
    ``full_recompute=True`` (the layer checkpointed): only the layer input stays, ``p·sbh`` (``2sbh``).

    ``tensor_parallel=t`` (Megatron-style, Korthikanti et al. 2022): the layer norms' inputs (``2p·sbh``),
    the inputs of the QKV and first MLP projections (``2p·sbh``) and the two dropout masks after attention and
    the MLP (``2m·sbh``) are replicated on every rank; everything else is split ``t`` ways, giving
    ``sbh(10 + 24/t + 5as/(ht))`` for ``p=2, m=1``. ``sequence_parallel=True`` splits the replicated part
    along the sequence too: the whole layer, and a recomputed layer's input, divided by ``t``.
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("bytes_per_element", bytes_per_element)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if activation not in ("gelu", "silu", "relu"):
        raise ValueError(f"unknown activation {activation!r}; use 'gelu' (or 'silu': keeps its input) or 'relu'")
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel}")
    t = tensor_parallel
    p, sbh = bytes_per_element, s * b * h
    if full_recompute:
        return p * sbh // t if sequence_parallel else p * sbh
    m = mask_bytes if dropout else 0
    keeps_activation_input = activation != "relu"
    per_sbh = 12 * p + (4 * p if keeps_activation_input else 0) + 2 * m
    if flash_attention:
        scores = 4 * a * s * b  # float32 log-sum-exp per row and head
    else:
        scores = a * s * s * b * ((2 * p + m) if dropout else p)
    total = per_sbh * sbh + scores
    if t == 1:
        return total
    replicated = 0 if sequence_parallel else (4 * p + 2 * m) * sbh
    return replicated + (total - replicated) // t
