"""Moments of the softmax of m independent N(0, s**2) logits, by quadrature, for every m at once.

With w_j = exp(l_j) and Z = sum_j w_j, the identity 1 / Z**k = (1 / Gamma(k)) int_0^inf
t**(k-1) exp(-t Z) dt turns an expectation over m logits into one over t of a product of m
identical one-logit expectations, phi(t) = E[exp(-t w)] and psi_a(t) = E[w**a exp(-t w)]:

    E[sum_j p_j**2]        = m   int t   psi_2 phi**(m-1) dt
    E[sum_j p_j**3]        = m/2 int t**2 psi_3 phi**(m-1) dt
    E[(sum_j p_j**2)**2]   = 1/6 int t**3 (m psi_4 phi**(m-1) + m (m-1) psi_2**2 phi**(m-2)) dt

Both integrals are smooth and one-dimensional: the logit's on a uniform grid (the trapezoid
rule is spectrally accurate for these Gaussian integrands), t on a logarithmic one. Exact up
to quadrature error (below 1e-6 relative; the tests check against Monte Carlo), for any m and s.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Tuple

import numpy as np

_LOGIT_STEP = 0.05  # in units of the standard normal
_LOG_T_STEP = 0.02
_CHUNK = 256  # key counts evaluated together: bounds the (keys, t) arrays' memory


@lru_cache(maxsize=32)
def softmax_moments(max_keys: int, logit_std: float = 1.0) -> Tuple[np.ndarray, ...]:
    """(E[sum p**2], E[sum p**3], E[(sum p**2)**2]), each a float64 array over m = 1..max_keys."""
    if max_keys < 1:
        raise ValueError(f"max_keys must be at least 1, got {max_keys}")
    s = abs(float(logit_std))
    # The logit grid reaches where w**4 exp(-x**2 / 2) peaks (x = 4 s) and 12 stds beyond.
    x = np.arange(-12.0, 12.0 + 4 * s + _LOGIT_STEP, _LOGIT_STEP)
    density = np.exp(-0.5 * x**2) * (_LOGIT_STEP / math.sqrt(2 * math.pi))
    w = np.exp(s * x)
    # t ~ 1 / Z: from far below 1 / Z for any realistic m (up to e**30 keys) to where
    # exp(-t w) has removed all mass. A grid that does not depend on max_keys gives every m the
    # same value, bit for bit, whatever table it was computed in.
    log_t = np.arange(-60.0 - 4 * s, 12.0 * s + 12.0, _LOG_T_STEP)
    t = np.exp(log_t)
    decay = np.exp(-np.outer(t, w)) * density  # (t, x)
    phi = decay.sum(axis=1)
    psi = {a: decay @ w**a for a in (2, 3, 4)}
    # dt = t d(log t); the trapezoid step is folded into every integrand below.
    dt = t * _LOG_T_STEP
    square_sum = np.empty(max_keys)
    cube_sum = np.empty(max_keys)
    square_sum_squared = np.empty(max_keys)
    log_phi = np.log(np.clip(phi, 1e-300, None))
    for start in range(1, max_keys + 1, _CHUNK):
        m = np.arange(start, min(max_keys, start + _CHUNK - 1) + 1, dtype=np.float64)[:, None]
        power_one = np.exp((m - 1) * log_phi)  # phi**(m-1), (keys, t)
        power_two = np.exp(np.maximum(m - 2, 0) * log_phi)
        rows = slice(start - 1, start - 1 + m.shape[0])
        square_sum[rows] = (m * (power_one * (t * psi[2] * dt))).sum(axis=1)
        cube_sum[rows] = (m / 2 * (power_one * (t**2 * psi[3] * dt))).sum(axis=1)
        pairs = m * (m - 1) * (power_two * (t**3 * psi[2] ** 2 * dt))
        square_sum_squared[rows] = ((m * (power_one * (t**3 * psi[4] * dt)) + pairs)
                                    .sum(axis=1) / 6)
    return square_sum, cube_sum, square_sum_squared


def query_key_gradient_variance(max_keys: int, logit_std: float = 1.0) -> np.ndarray:
    """C(m) for m = 1..max_keys: the variance of the query (and key) gradient of unit-scaled
    attention over m keys, per unit of logit_std**2, for independent unit q, k, v and output
    gradient (see `U.attention_query_key_grad_scale`). C(1) = 0: one key, constant softmax."""
    square_sum, cube_sum, square_sum_squared = softmax_moments(max_keys, logit_std)
    variance = 1.0 - (2.0 * cube_sum - square_sum_squared) / square_sum
    variance[0] = 0.0
    return np.clip(variance, 0.0, None)
