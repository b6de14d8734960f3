"""Hadamard matrices for rotations: sizes K * 2^m (Paley constructions for K), a block-diagonal fallback,
the randomised orthogonal Q = diag(+-1) H / sqrt(n) QuaRot uses, and a fast transform.

A Hadamard matrix H of order n has entries +-1 and H H^T = n I, so H / sqrt(n) is orthogonal.
- Sylvester: H_2n = [[H, H], [H, -H]], i.e. H_{2^m} = H_2 (x) ... (x) H_2.
- Paley I (q = p^k = 3 mod 4): order q + 1 from the Jacobsthal matrix of GF(q)'s quadratic character.
- Paley II (q = p^k = 1 mod 4): order 2 (q + 1).
- Kronecker: H_K (x) H_{2^m} has order K * 2^m.
Every matrix here is built and checked (H H^T = n I) at construction, so a wrong table cannot slip through.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

# The base orders QuaRot-style rotations use; every one is checked by test/quarot/test_hadamard.py.
KNOWN_BASE_ORDERS = (1, 12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172)


# ----------------------------------------------------------------------------------------------------------------
# Finite fields GF(p^k) (k <= 3: a monic cubic or quadratic with no root is irreducible)
# ----------------------------------------------------------------------------------------------------------------
def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q = p^k, p prime, or None."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)
    k, r = 0, q
    while r % p == 0:
        r //= p
        k += 1
    return (p, k) if r == 1 else None


def _quadratic_character(q: int) -> list[list[int]]:
    """chi(a - b) for all field elements a, b of GF(q): +1 nonzero square, -1 non-square, 0 for a == b.

    Elements are coefficient tuples of polynomials over GF(p) modulo a monic irreducible polynomial of degree k.
    """
    pk = _prime_power(q)
    if pk is None:
        raise ValueError(f"GF({q}) does not exist: {q} is not a prime power")
    p, k = pk
    if k > 3:
        raise ValueError(f"GF({p}^{k}): only extension degrees <= 3 are implemented")
    elements = list(itertools.product(range(p), repeat=k))  # coefficients of x^0..x^{k-1}
    # modulus x^k + c_{k-1} x^{k-1} + ... + c_0 with no root in GF(p) (irreducible for k <= 3)
    modulus = next(
        c for c in itertools.product(range(p), repeat=k)
        if k == 1 or all((pow(x, k, p) + sum(ci * pow(x, i, p) for i, ci in enumerate(c))) % p for x in range(p))
    )

    def mul(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
        prod = [0] * (2 * k - 1)
        for i, ai in enumerate(a):
            for j, bj in enumerate(b):
                prod[i + j] = (prod[i + j] + ai * bj) % p
        for d in range(2 * k - 2, k - 1, -1):  # reduce x^d = -sum c_i x^{d-k+i}
            coef = prod[d]
            prod[d] = 0
            for i, ci in enumerate(modulus):
                prod[d - k + i] = (prod[d - k + i] - coef * ci) % p
        return tuple(prod[:k])

    zero = (0,) * k
    squares = {mul(a, a) for a in elements if a != zero}
    index = {e: i for i, e in enumerate(elements)}
    chi = [0] * q
    for e in elements:
        chi[index[e]] = 0 if e == zero else (1 if e in squares else -1)

    def sub(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
        return tuple((x - y) % p for x, y in zip(a, b))

    return [[chi[index[sub(a, b)]] for b in elements] for a in elements]


def _jacobsthal(q: int) -> torch.Tensor:
    return torch.tensor(_quadratic_character(q), dtype=torch.float64)


def paley1(q: int) -> torch.Tensor:
    """Order q + 1 for a prime power q = 3 (mod 4): H = I + S, S = [[0, 1^T], [-1, Q]] (skew)."""
    if q % 4 != 3:
        raise ValueError(f"Paley I needs q = 3 mod 4, got {q}")
    jac = _jacobsthal(q)
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return torch.eye(q + 1, dtype=torch.float64) + s


def paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) for a prime power q = 1 (mod 4): C = [[0, 1^T], [1, Q]] (symmetric conference matrix),
    H = C (x) [[1, 1], [1, -1]] + I (x) [[1, -1], [-1, -1]]."""
    if q % 4 != 1:
        raise ValueError(f"Paley II needs q = 1 mod 4, got {q}")
    jac = _jacobsthal(q)
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = jac
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


def _is_hadamard(h: torch.Tensor) -> bool:
    n = h.shape[0]
    return bool(h.abs().eq(1).all()) and torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))


@functools.cache
def _base(k: int) -> torch.Tensor | None:
    """A checked +-1 Hadamard matrix of order k built without a power-of-two factor, or None."""
    if k in (1, 2):
        return torch.tensor([[1.0]] if k == 1 else [[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if k % 4:
        return None
    h = None
    if _prime_power(k - 1) and (k - 1) % 4 == 3:
        h = paley1(k - 1)
    elif _prime_power(k // 2 - 1) and (k // 2 - 1) % 4 == 1:
        h = paley2(k // 2 - 1)
    elif k in _WILLIAMSON_SEARCH:
        h = _williamson(k)
    if h is not None and not _is_hadamard(h):
        raise AssertionError(f"internal error: constructed matrix of order {k} is not Hadamard")
    return h


def factor_order(n: int) -> tuple[int, int] | None:
    """(K, m) with n = K * 2^m and a constructible K (the largest power of two first), or None."""
    m = (n & -n).bit_length() - 1 if n > 0 else 0
    for mm in range(m, -1, -1):
        if _base(n >> mm) is not None:
            return n >> mm, mm
    return None


def has_hadamard(n: int) -> bool:
    return n > 0 and factor_order(n) is not None


@functools.lru_cache(maxsize=16)
def _hadamard_cached(n: int) -> torch.Tensor:
    km = factor_order(n)
    if km is None:
        raise ValueError(f"no Hadamard matrix of order {n} is constructible here (need K * 2^m, K in {KNOWN_BASE_ORDERS})")
    k, m = km
    h = _base(k)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    for _ in range(m):
        h = torch.kron(h, h2)
    return h


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """+-1 Hadamard matrix of order n = K * 2^m: H_K (x) H_2 (x) ... (x) H_2 (H H^T = n I)."""
    return _hadamard_cached(n).to(dtype).clone()


def largest_hadamard_block(n: int, limit: int | None = None) -> int:
    """Largest b dividing n (b <= limit when given) with a constructible Hadamard matrix of order b."""
    for b in range(min(n, limit or n), 0, -1):
        if n % b == 0 and has_hadamard(b):
            return b
    return 1


def orthogonal_hadamard(n: int, block_size: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """H / sqrt(n), or when n has no Hadamard matrix, block-diagonal copies of H_b / sqrt(b).

    block_size (optional) caps the fallback block; it must divide n and be constructible.
    """
    if has_hadamard(n):
        return hadamard_matrix(n, dtype) / math.sqrt(n)
    if block_size is not None:
        if n % block_size or not has_hadamard(block_size):
            raise ValueError(f"block_size {block_size} must divide {n} and be a Hadamard order K * 2^m")
        b = block_size
    else:
        b = largest_hadamard_block(n)
    block = hadamard_matrix(b, dtype) / math.sqrt(b)
    return torch.block_diag(*([block] * (n // b)))


def random_signs(n: int, seed: int) -> torch.Tensor:
    """n values +-1 drawn from a CPU generator seeded with `seed` (the same on every rank and device)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).mul(2).sub(1).to(torch.float64)


def random_hadamard(n: int, seed: int, block_size: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Q = diag(s) H / sqrt(n), s = +-1 from `seed`: orthogonal (Q^T Q = I), entries +-1/sqrt(n)."""
    return (random_signs(n, seed)[:, None] * orthogonal_hadamard(n, block_size, torch.float64)).to(dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ (H_n / sqrt(n))^T over the last dim, n = K * 2^m: a Walsh-Hadamard butterfly over the 2^m factor and
    one small matmul with H_K (row-major x viewed as [K, 2^m]: (A (x) B) vec(X) = vec(A X B^T))."""
    n = x.shape[-1]
    km = factor_order(n)
    if km is None:
        raise ValueError(f"hadamard_transform: no Hadamard matrix of order {n}")
    k, m = km
    y = x.reshape(*x.shape[:-1], k, 1 << m)
    h = 1
    while h < (1 << m):  # butterfly: pairs (i, i + h) -> (a + b, a - b)
        y = y.reshape(*y.shape[:-1], -1, 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], k, 1 << m)
        h *= 2
    if k > 1:
        y = torch.einsum("ab,...bj->...aj", _base(k).to(y.dtype).to(y.device), y)
    return y.reshape(x.shape) / math.sqrt(n)


# ----------------------------------------------------------------------------------------------------------------
# Williamson construction: four symmetric circulant +-1 matrices A, B, C, D of odd order w with
# A^2 + B^2 + C^2 + D^2 = 4w I give a Hadamard matrix of order 4w through the Williamson array.
# ----------------------------------------------------------------------------------------------------------------
def _circulant(first_row: list[int]) -> torch.Tensor:
    r = torch.tensor(first_row, dtype=torch.float64)
    return torch.stack([torch.roll(r, i) for i in range(len(first_row))])


def williamson(a: list[int], b: list[int], c: list[int], d: list[int]) -> torch.Tensor:
    """[[A, B, C, D], [-B, A, -D, C], [-C, D, A, -B], [-D, -C, B, A]] from circulant first rows a, b, c, d."""
    ma, mb, mc, md = (_circulant(r) for r in (a, b, c, d))
    return torch.cat([
        torch.cat([ma, mb, mc, md], 1),
        torch.cat([-mb, ma, -md, mc], 1),
        torch.cat([-mc, md, ma, -mb], 1),
        torch.cat([-md, -mc, mb, ma], 1),
    ])


def _orbits(w: int, group: set[int]) -> list[list[int]]:
    left, out = set(range(1, w)), []
    while left:
        orbit = sorted({x * g % w for g in group for x in (min(left),)})
        out.append(orbit)
        left -= set(orbit)
    return out


def williamson_search(w: int, multiplier: int) -> tuple[list[int], ...] | None:
    """Williamson matrices of odd order w whose first rows are constant on the orbits of the multiplier group
    {+-multiplier^i} of Z_w^* (so symmetric), with a_0 = 1 (Williamson's own reduction of the search).

    Condition: the circulants commute and are diagonalised by the DFT, so A^2 + B^2 + C^2 + D^2 = 4w I holds iff
    |F_a(k)|^2 + |F_b(k)|^2 + |F_c(k)|^2 + |F_d(k)|^2 = 4w at every frequency k; pairs (a, b) and (c, d) are matched
    through a hash of their summed power spectra (meet in the middle). Returns the four first rows or None.
    """
    group, x = {1, w - 1}, multiplier % w
    while x not in group:
        group |= {x, w - x}
        x = x * multiplier % w
    orbits = _orbits(w, group)
    rows = []
    for signs in itertools.product((1.0, -1.0), repeat=len(orbits)):
        row = torch.ones(w, dtype=torch.float64)
        for sign, orbit in zip(signs, orbits):
            row[orbit] = sign
        rows.append(row)
    seqs = torch.stack(rows)
    power = torch.fft.fft(seqs).real ** 2  # symmetric rows: the spectrum is real
    keep = (power <= 4 * w + 1e-9).all(dim=1)
    seqs, power = seqs[keep], power[keep]
    pairs: dict[tuple[float, ...], tuple[int, int]] = {}
    for i in range(len(seqs)):
        for j in range(i, len(seqs)):
            total = power[i] + power[j]
            if bool((total <= 4 * w + 1e-9).all()):
                pairs.setdefault(tuple(total.round(decimals=6).tolist()), (i, j))
    for key, (i, j) in pairs.items():
        need = tuple(round(4 * w - v, 6) + 0.0 for v in key)
        if need in pairs:
            k, m = pairs[need]
            return tuple(seqs[n].long().tolist() for n in (i, j, k, m))
    return None


# order 4w -> (w, multiplier) of a multiplier-invariant Williamson search that succeeds (about 0.1 s, checked);
# 156 = 4 * 39 has no solution with multiplier symmetry here and falls back to block-diagonal blocks.
_WILLIAMSON_SEARCH: dict[int, tuple[int, int]] = {172: (43, 6)}


def _williamson(k: int) -> torch.Tensor | None:
    found = williamson_search(*_WILLIAMSON_SEARCH[k])
    return None if found is None else williamson(*found)
