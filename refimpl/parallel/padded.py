r"""The fast path for one device: every expert in one padded batched product, and what the padding costs."""

from __future__ import annotations

from .._lib.validation import check_int
from .._lib.xp import Array, array_namespace, to_numpy
from ..config import MoEConfig
from ..layer.activations import expert_glu
from ..layer.latent_moe import (
    dispatch_by_expert,
)

# ---------------------------------------------------------------------------
# Fast path for one device: all experts in one padded batched product
# ---------------------------------------------------------------------------

def padding_waste(load: Array) -> float:
    r"""Work a padded product spends on padding, relative to the useful work: $\max_e L_e / \bar L - 1$.

    `load` `[n]` counts the slots per expert (or per rank). 0 means perfect
    balance; 1 means half of the computed rows are padding.
    """
    values = to_numpy(load)
    if values.ndim != 1 or values.shape[0] < 1:
        raise ValueError(f"load must be a non-empty 1-D array of counts, got shape {list(values.shape)}")
    if (values < 0).any():
        raise ValueError("load must hold non-negative counts")
    total = float(values.sum())
    if total == 0:
        return 0.0
    # $$\frac{\max_e L_e}{\bar L} - 1, \qquad \bar L = \tfrac{1}{n}\textstyle\sum_e L_e$$
    return float(values.max()) * values.shape[0] / total - 1.0


def padded_routed_experts(z: Array, index: Array, weights: Array, w1: Array, w3: Array, w2: Array,
                          config: MoEConfig, *, capacity: int | None = None) -> Array:
    r"""The routed sum $u_i = \sum_{e \in \mathcal{T}_i} p_{i,e} E_e(z_i)$ as one padded batched product.

    Same arguments and result as `routed_experts` (`z` `[m, l]`, `index` and
    `weights` `[m, k]`, stacks `w1`, `w3` `[n, f, l]`, `w2` `[n, l, f]`;
    returns `u` `[m, l]`). Instead of a loop over experts, every expert's
    tokens are laid out in a block of $C$ rows, $C$ = the largest load (or
    `capacity`, which must be at least that), zero rows filling the rest, and
    each weight is applied to all $n$ blocks at once: three `matmul` calls on
    `[n, C, l]` and `[n, C, f]` arrays. This is how a batched GPU kernel runs
    experts, and why balance is speed: the product computes $nC$ rows for the
    $mk$ that matter, wasting `padding_waste(load)` of the useful work.
    """
    xp = array_namespace(z, index, weights)
    m, k = index.shape
    n, ell = w2.shape[0], w2.shape[1]
    if m == 0:
        return xp.zeros((0, ell), dtype=z.dtype)
    # Slots sorted by expert, as in `routed_experts`.
    dispatch = dispatch_by_expert(index, weights, n)
    token_sorted, p_sorted = dispatch.token, dispatch.weight[:, 0]  # [m*k] each
    load = xp.asarray(dispatch.load)  # [n]
    start = xp.asarray(dispatch.start[:-1])  # [n], first sorted slot of each expert
    largest = int(dispatch.load.max())
    if capacity is None:
        capacity = largest
    capacity = check_int("capacity", capacity, low=largest)
    # Cell (e, c) of the padded layout holds sorted slot start[e] + c, for c < load[e].
    c = xp.arange(capacity, dtype=start.dtype)  # [C]
    filled = c[None, :] < load[:, None]  # [n, C]
    zero = xp.zeros((), dtype=z.dtype)
    cell_slot = xp.where(filled, start[:, None] + c[None, :], xp.zeros((), dtype=start.dtype))  # [n, C]
    cell_slot = xp.reshape(cell_slot, (n * capacity,))  # [n*C]
    z_blocks = xp.reshape(xp.take(z, xp.take(token_sorted, cell_slot), axis=0), (n, capacity, ell))
    z_blocks = xp.where(filled[:, :, None], z_blocks, zero)  # [n, C, l], zero rows as padding
    p_blocks = xp.where(filled, xp.reshape(xp.take(p_sorted, cell_slot), (n, capacity)), zero)  # [n, C]
    g, u_, d = (xp.astype(w, z.dtype, copy=False) for w in (w1, w3, w2))  # [n,f,l] [n,f,l] [n,l,f]
    # All experts at once: $$H_e = \operatorname{SiTU\text{-}GLU}(Z_e G_e^\top, Z_e U_e^\top)$$
    h = expert_glu(z_blocks @ xp.matrix_transpose(g), z_blocks @ xp.matrix_transpose(u_), config)  # [n, C, f]
    # $$O_e = (p_e \odot H_e)\, D_e^\top$$
    out = xp.reshape((p_blocks[:, :, None] * h) @ xp.matrix_transpose(d), (n * capacity, ell))  # [n*C, l]
    # Combine: slot (i, r) sits in cell index[i, r] * C + (its sorted position - start of its expert).
    first = xp.reshape(xp.take(start, xp.reshape(index, (m * k,))), (m, k))  # [m, k]
    cell = index * capacity + dispatch.position - first  # [m, k]
    u = xp.zeros((m, ell), dtype=z.dtype)  # [m, l]
    for r in range(k):
        # $$u_i \mathrel{+}= p_{i,r}\, E_{\mathcal{T}_{i,r}}(z_i)$$
        u += xp.take(out, cell[:, r], axis=0)
    return u
