"""Random calls against the float64 oracle: a search for defects the fixed batteries miss.

    python tests/random_search.py attention --backend numpy --path copied -n 1500
    python tests/random_search.py attention --backend cupy --path tensor-core -n 300 --max-seqlen 140
    python tests/random_search.py attention --max-batch 24 --max-seqlen 130 -n 300  # NumPy's dense groups
    python tests/random_search.py varlen --backend cupy --path hopper -n 100 --dtypes float16,bfloat16
    python tests/random_search.py cache --backend numpy -n 300
    python tests/random_search.py jax -n 80        # flashcupy.jax under jit and grad (NumPy backend)
    python tests/random_search.py jvp -n 80        # flashcupy.jax's forward mode under jit (NumPy backend)
    python tests/random_search.py probs -n 80      # flashcupy.jax.attention_probs and its jvp (NumPy backend)
    python tests/random_search.py torch -n 80      # torch autograd (NumPy backend)
    python tests/random_search.py dask -n 100      # flashcupy.dask over random chunkings

Each case draws its shapes, dtype, layout and modifiers from its own seed (printed), runs the
public entry points (forward, backward with a gradient of lse too, where the surface has one) and
checks every output with conftest.assert_matches_oracle, the one tolerance rule. A case prints
"ok" or "FAIL" and why; the exit status is the number of failures (capped at 100). --path and the
emulator's thread order as contract.CONTEXTS takes them (cupy: simt, tensor-core, hopper; numpy:
copied, in-place); numba needs NUMBA_ENABLE_CUDASIM=1 without a GPU. tests/test_harness.py runs a
few cases of every surface so that this script cannot rot; what the searches found is in
benchmarks/results/random_search.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contract  # noqa: E402
from conftest import (BF16, assert_matches_oracle, assert_probs_match_oracle, assert_tangent_matches_oracle,  # noqa: E402
                      bf16_bits, make_qkv)

import flashcupy  # noqa: E402
from reference.compare import error_ratio, expected  # noqa: E402

LAYOUTS = ("bshd", "bhsd", "sliced", "reversed")


def _values(dtype: str):
    return BF16 if dtype.startswith("bfloat16") else np.dtype(dtype)


def _broadcast_shape(rng, full):
    return tuple(d if rng.random() < 0.6 else 1 for d in full)


def _modifiers(rng, B, Sq, Sk, Hq, dtype):
    """Random window, softcap, ALiBi, bias (broadcast, of any rank from 2) and mask keywords."""
    kw = {"causal": bool(rng.random() < 0.4)}
    if rng.random() < 0.3:
        kw["window"] = tuple(None if rng.random() < 0.3 else int(rng.integers(0, 40)) for _ in range(2))
    if rng.random() < 0.2:
        kw["softcap"] = float(rng.uniform(0.3, 5))
    if rng.random() < 0.2:
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, (Hq,) if rng.random() < 0.5 else (B, Hq)).astype(np.float32)
    if rng.random() < 0.2:
        shape = _broadcast_shape(rng, (B, Hq, Sq, Sk))[int(rng.integers(0, 3)):]
        wide = dtype == "float64" or rng.random() < 0.3
        kw["bias"] = rng.standard_normal(shape).astype(np.float32 if wide else _values(dtype))
    if rng.random() < 0.2:
        kw["mask"] = rng.random(_broadcast_shape(rng, (B, Hq, Sq, Sk))) < 0.7
    if rng.random() < 0.3:
        kw["scale"] = float(rng.uniform(0.05, 2))
    return kw


def _dropout(rng) -> dict:
    """Dropout's keywords in a quarter of the draws: any p, a seed of any 64 bits."""
    if rng.random() >= 0.25:
        return {}
    return {"dropout_p": float(rng.uniform(0.05, 0.9)), "dropout_seed": int(rng.integers(0, 2**64, dtype=np.uint64))}


def _describe(**fields) -> str:
    return " ".join(f"{name}={getattr(x, 'shape', x)}" for name, x in fields.items())


def attention_case(rng, args):
    """attention and attention_backward (with dlse) of one random call on args.backend / args.path."""
    B, Hkv = int(rng.integers(1, args.max_batch + 1)), int(rng.integers(1, 3))
    Hq = Hkv * int(rng.integers(1, 4))
    Sq, Sk = (int(rng.integers(1, args.max_seqlen)) for _ in range(2))
    D, dtype = int(rng.choice(args.head_dims)), str(rng.choice(args.dtypes))
    Dv = int(rng.choice(args.head_dims)) if rng.random() < 0.3 else D  # v's head_dim of its own in 30 %
    layout = str(rng.choice(LAYOUTS))
    kw = _modifiers(rng, B, Sq, Sk, Hq, dtype) if args.modifiers else {"causal": bool(rng.random() < 0.4)}
    kw.update(_dropout(rng))
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, _values(dtype), layout=layout, head_dim_v=Dv)
    dout = rng.standard_normal((B, Sq, Hq, Dv)).astype(_values(dtype))
    call, ref, given = dict(kw), dict(kw), (q, k, v, dout)
    if dtype == "bfloat16-bits":  # what CuPy users pass
        given = tuple(bf16_bits(x) for x in given)
        call["dtype"] = ref["dtype"] = "bfloat16"
        if call.get("bias") is not None and call["bias"].dtype == BF16:
            call["bias"] = bf16_bits(call["bias"])
    yield _describe(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, dtype=dtype, layout=layout, **kw)
    with contract.CONTEXTS[args.backend](args.path, args.order):
        out, lse = flashcupy.attention(*given[:3], return_lse=True, backend=args.backend, **call)
        dlse = rng.standard_normal(lse.shape).astype(lse.dtype)
        grads = flashcupy.attention_backward(given[3], *given[:3], out, lse, dlse=dlse, backend=args.backend, **call)
        yield assert_matches_oracle((out, lse, *grads), q, k, v, dout, backend=args.backend, dlse=dlse, **ref)


def varlen_case(rng, args):
    """attention_varlen and its backward (with dlse) of one random packed batch, empty sequences among them."""
    import varlen_checks

    n = int(rng.integers(1, 6))
    lengths_q = [int(x) for x in rng.integers(0, args.max_seqlen, n)]
    lengths_k = list(lengths_q) if rng.random() < 0.3 else [int(x) for x in rng.integers(0, args.max_seqlen, n)]
    Hkv = int(rng.integers(1, 3))
    Hq, D, dtype = Hkv * int(rng.integers(1, 3)), int(rng.choice(args.head_dims)), str(rng.choice(args.dtypes))
    mods = {"causal": bool(rng.random() < 0.5)}
    if rng.random() < 0.3:
        mods["window"] = (int(rng.integers(0, 50)), None if rng.random() < 0.5 else int(rng.integers(0, 50)))
    if rng.random() < 0.2:
        mods["softcap"] = float(rng.uniform(0.5, 4))
    if rng.random() < 0.2:
        mods["alibi_slopes"] = "per-seq" if rng.random() < 0.5 else rng.uniform(0.05, 0.5, (Hq,)).astype(np.float32)
    backward, deterministic = bool(rng.random() < 0.7), bool(rng.random() < 0.3)
    yield _describe(lengths_q=lengths_q, lengths_k=lengths_k, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, backward=backward,
                    deterministic=deterministic, **mods)
    with contract.CONTEXTS[args.backend](args.path, args.order):
        varlen_checks.packed_batch_matches_the_oracle(rng, args.backend, (lengths_q, lengths_k),
                                                      _values(dtype.replace("-bits", "")), D, (Hq, Hkv), mods,
                                                      backward, deterministic)
    yield {}


def cache_case(rng, args):
    """attention_with_kvcache of one random step: contiguous or paged (shuffled blocks, spare ones), appends,
    splits, modifiers; each sequence against the oracle on its keys, the caches as appended."""
    import varlen_checks

    B, Hkv = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    dtypes = [d for d in args.dtypes if not d.startswith("bfloat16")]  # a cache of bfloat16 bits: not drawn
    Hq, D, dtype = Hkv * int(rng.integers(1, 4)), int(rng.choice(args.head_dims)), np.dtype(str(rng.choice(dtypes)))
    new = int(rng.integers(0, 4))
    Sq = max(new, 1)
    lengths = rng.integers(0, args.max_seqlen, B).astype(np.int32)
    need = int(lengths.max()) + new
    block = None if rng.random() < 0.5 else int(rng.choice([1, 3, 8, 16, 48, 256]))
    if block is None:
        table, capacity = None, need + int(rng.integers(0, 10))
        k_cache, v_cache = (rng.standard_normal((B, capacity, Hkv, D)).astype(dtype) for _ in range(2))
    else:
        per = -(-max(need, 1) // block) + int(rng.integers(0, 2))
        total = B * per + int(rng.integers(0, 3))
        table = rng.permutation(total)[:B * per].astype(np.int32).reshape(B, per)
        k_cache, v_cache = (rng.standard_normal((total, block, Hkv, D)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((B, Sq, Hq, D)).astype(dtype)
    k_new, v_new = (rng.standard_normal((B, new, Hkv, D)).astype(dtype) if new else None for _ in range(2))
    mods = {"causal": bool(rng.random() < 0.6)}
    if rng.random() < 0.3:
        mods["window"] = (int(rng.integers(0, 60)), None)
    if rng.random() < 0.2:
        mods["softcap"] = float(rng.uniform(0.5, 4))
    if rng.random() < 0.2:
        mods["alibi_slopes"] = rng.uniform(0.05, 0.5, (Hq,) if rng.random() < 0.5 else (B, Hq)).astype(np.float32)
    splits = None if rng.random() < 0.5 else int(rng.integers(1, 5))
    yield _describe(B=B, Sq=Sq, new=new, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype.name,
                    block_size=block, lengths=lengths.tolist(), num_splits=splits, **mods)
    rows = varlen_checks.appended_rows(k_cache, v_cache, table, lengths, k_new, v_new)
    with contract.CONTEXTS[args.backend](args.path, args.order):
        out, lse = flashcupy.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                                    block_table=table, num_splits=splits, return_lse=True,
                                                    backend=args.backend, **mods)
    for b in range(B):
        n = lengths[b] + new
        if table is None:
            np.testing.assert_array_equal(k_cache[b], rows[b][0])
        one = dict(mods)
        if one.get("alibi_slopes") is not None and one["alibi_slopes"].ndim == 2:
            one["alibi_slopes"] = one["alibi_slopes"][b]
        assert_matches_oracle((out[b:b + 1], lse[b:b + 1]), q[b:b + 1], rows[b][0][None, :n], rows[b][1][None, :n],
                              backend=args.backend, **one)
    yield {}


def _leading_and_bias(rng, dtype):
    """Random leading dimensions, heads, lengths and a bias of rank 2 or more (or None)."""
    lead = tuple(int(x) for x in rng.integers(1, 3, int(rng.integers(1, 3))))
    Hkv = int(rng.integers(1, 3))
    Hq, D = Hkv * int(rng.integers(1, 3)), int(rng.choice([1, 8, 24, 64]))
    Sq, Sk = int(rng.integers(1, 70)), int(rng.integers(1, 70))
    bias = None
    if rng.random() < 0.4:
        shape = _broadcast_shape(rng, lead + (Hq, Sq, Sk))
        shape = shape[len(shape) - int(rng.integers(2, len(shape) + 1)):]
        bias = rng.standard_normal(shape).astype(np.float32 if dtype == "float64" or rng.random() < 0.5
                                                 else _values(dtype))
    kw = {"causal": bool(rng.random() < 0.5)}
    if rng.random() < 0.3:
        kw["window"] = (int(rng.integers(0, 30)), None)
    if rng.random() < 0.3:
        kw["softcap"] = float(rng.uniform(0.5, 3))
    return lead, Hq, Hkv, D, Sq, Sk, bias, kw


def jax_case(rng, args):
    """flashcupy.jax.attention under jit and grad, through out and lse, with leading dimensions and a bias."""
    import jax
    import jax.numpy as jnp

    import flashcupy.jax as fj

    dtype = str(rng.choice(["float16", "float32", "float64", "bfloat16"]))
    lead, Hq, Hkv, D, Sq, Sk, bias, kw = _leading_and_bias(rng, dtype)
    values = _values(dtype)
    q, k, v, dout = (rng.standard_normal(lead + shape).astype(values)
                     for shape in ((Sq, Hq, D), (Sk, Hkv, D), (Sk, Hkv, D), (Sq, Hq, D)))
    acc = np.float64 if dtype == "float64" else np.float32
    dlse = rng.standard_normal(lead + (Hq, Sq)).astype(acc)
    kw.update(_dropout(rng))
    yield _describe(lead=lead, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, bias=bias, **kw)
    call = dict(kw)
    if kw.get("dropout_p") and rng.random() < 0.5:  # the seed as an operand: two uint32 words
        seed = kw["dropout_seed"]
        call["dropout_seed"] = jnp.array([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32)

    def loss(q, k, v, b):
        out, lse = fj.attention(q, k, v, bias=b, return_lse=True, **call)
        return jnp.sum(out.astype(acc) * jnp.asarray(dout).astype(acc)) + jnp.sum(lse * dlse), (out, lse)

    wrt = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    with jax.enable_x64(dtype == "float64"):  # float64 arrays stay float64 (and lse with them)
        (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=wrt, has_aux=True))(
            *map(jnp.asarray, (q, k, v)), None if bias is None else jnp.asarray(bias))
    ref = dict(kw) | ({} if bias is None else {"bias": bias})
    yield assert_matches_oracle([np.asarray(x) for x in (out, lse, *grads)], q, k, v, dout, backend="numpy",
                                dlse=dlse, **ref)


def jvp_case(rng, args):
    """flashcupy.jax.attention's forward mode under jit: tangents of a random subset of q, k and v (v of its
    own head dim at times) and, half the time, of the bias where there is one and no dropout, through out
    and lse, with leading dimensions and dropout; on args.backend (numpy, or cupy on the emulator: its
    calls on several kernel families, so the tolerance charges every family's liberties)."""
    import jax
    import jax.numpy as jnp

    import flashcupy.jax as fj

    dtype = str(rng.choice([d.replace("-bits", "") for d in args.dtypes]))  # JAX's bfloat16 is its own dtype
    lead, Hq, Hkv, D, Sq, Sk, bias, kw = _leading_and_bias(rng, dtype)
    Dv = D if rng.random() < 0.7 else int(rng.choice([1, 8, 40]))
    values = _values(dtype)
    q, k, v = (rng.standard_normal(lead + shape).astype(values) for shape in ((Sq, Hq, D), (Sk, Hkv, D),
                                                                                  (Sk, Hkv, Dv)))
    given = [bool(x) for x in rng.random(3) < 0.7]
    if not any(given):
        given[int(rng.integers(0, 3))] = True
    tangents = [rng.standard_normal(x.shape).astype(values) if g else None for x, g in zip((q, k, v), given)]
    kw.update(_dropout(rng))
    if bias is not None and not kw.get("dropout_p") and rng.random() < 0.5:
        tangents.append(rng.standard_normal(bias.shape).astype(bias.dtype))
        given.append(True)
    yield _describe(lead=lead, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, dtype=dtype, bias=bias,
                    tangents="".join(n for n, g in zip("qkvb", given) if g), **kw)
    wrt = [i for i, g in enumerate(given) if g]

    def f(*wrt_values):
        arrays = [None if x is None else jnp.asarray(x) for x in (q, k, v, bias)]
        for i, x in zip(wrt, wrt_values):
            arrays[i] = x
        return fj.attention(*arrays[:3], bias=arrays[3], return_lse=True, backend=args.backend, **kw)

    with jax.enable_x64(dtype == "float64"), contract.CONTEXTS[args.backend](args.path, args.order):
        (out, lse), (out_t, lse_t) = jax.jit(lambda p, t: jax.jvp(f, p, t))(
            tuple(jnp.asarray((q, k, v, bias)[i]) for i in wrt), tuple(jnp.asarray(tangents[i]) for i in wrt))
    ref = dict(kw) | ({} if bias is None else {"bias": bias})
    family = "numpy" if args.backend == "numpy" else None
    ratios = assert_matches_oracle([np.asarray(out), np.asarray(lse)], q, k, v, backend=family, **ref)
    yield ratios | assert_tangent_matches_oracle(out_t, lse_t, q, k, v, tangents, backend=family, **ref)


def probs_case(rng, args):
    """flashcupy.jax.attention_probs under jit and jvp: random rows (None, a slice, indices with negative
    ones), tangents of q, k or both (and, half the time, of the bias where there is one), lse from
    flashcupy.jax.attention (its tangent the jvp's), leading dimensions, the window and softcap; on
    args.backend as jvp_case."""
    import jax
    import jax.numpy as jnp

    import flashcupy.jax as fj

    dtype = str(rng.choice([d.replace("-bits", "") for d in args.dtypes]))
    lead, Hq, Hkv, D, Sq, Sk, bias, kw = _leading_and_bias(rng, dtype)
    values = _values(dtype)
    q, k = (rng.standard_normal(lead + shape).astype(values) for shape in ((Sq, Hq, D), (Sk, Hkv, D)))
    given = [bool(x) for x in rng.random(2) < 0.7]
    if not any(given):
        given[int(rng.integers(0, 2))] = True
    tangents = [rng.standard_normal(x.shape).astype(values) if g else None for x, g in zip((q, k), given)]
    draw = rng.random()
    if draw < 0.3:
        rows = None
    elif draw < 0.6:
        rows = slice(int(rng.integers(0, Sq)), None, int(rng.integers(1, 4)))
    else:
        rows = [int(x) for x in rng.integers(-Sq, Sq, int(rng.integers(1, 5)))]
    tangents.append(None)  # v's: attention_probs reads no v
    given.append(False)
    if bias is not None and rng.random() < 0.5:
        tangents.append(rng.standard_normal(bias.shape).astype(bias.dtype))
        given.append(True)
    yield _describe(lead=lead, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, bias=bias, rows=rows,
                    tangents="".join(n for n, g in zip("qkvb", given) if g), **kw)
    wrt = [i for i, g in enumerate(given) if g]
    mods = dict(kw, backend=args.backend)

    def f(*wrt_values):
        arrays = [None if x is None else jnp.asarray(x) for x in (q, k, None, bias)]
        for i, x in zip(wrt, wrt_values):
            arrays[i] = x
        q_, k_, _, b = arrays
        _, lse = fj.attention(q_, k_, k_, bias=b, return_lse=True, **mods)
        return fj.attention_probs(q_, k_, lse, rows=rows, bias=b, **mods)

    with jax.enable_x64(dtype == "float64"), contract.CONTEXTS[args.backend](args.path, args.order):
        P, P_t = jax.jit(lambda p, t: jax.jvp(f, p, t))(tuple(jnp.asarray((q, k, None, bias)[i]) for i in wrt),
                                                         tuple(jnp.asarray(tangents[i]) for i in wrt))
    ref = dict(kw) | ({} if bias is None else {"bias": bias})
    index = np.arange(Sq)[slice(None) if rows is None else rows]
    yield assert_probs_match_oracle(P, P_t, q, k, tangents, index,
                                    backend="numpy" if args.backend == "numpy" else None, **ref)


def torch_case(rng, args):
    """flashcupy.attention on torch tensors under autograd, through out and lse."""
    import torch

    dtype = str(rng.choice(["float16", "float32", "float64", "bfloat16"]))
    lead, Hq, Hkv, D, Sq, Sk, bias, kw = _leading_and_bias(rng, dtype)
    values = _values(dtype)
    arrays = [rng.standard_normal(lead + shape).astype(values)
              for shape in ((Sq, Hq, D), (Sk, Hkv, D), (Sk, Hkv, D), (Sq, Hq, D))]

    def tensor(x):  # bfloat16 by its bits, no rounding on the way
        t = torch.from_numpy(np.ascontiguousarray(x.view(np.int16) if x.dtype == BF16 else x))
        return t.view(torch.bfloat16) if x.dtype == BF16 else t

    def bits(t):
        t = t.detach()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    kw.update(_dropout(rng))
    yield _describe(lead=lead, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, bias=bias, **kw)
    inputs = [tensor(x).requires_grad_() for x in arrays[:3] + ([] if bias is None else [bias])]
    out, lse = flashcupy.attention(*inputs[:3], bias=inputs[3] if bias is not None else None, return_lse=True, **kw)
    dlse = rng.standard_normal(tuple(lse.shape)).astype(np.float64 if dtype == "float64" else np.float32)
    torch.autograd.backward([out, lse], [tensor(arrays[3]), torch.from_numpy(dlse)])
    ref = dict(kw, dtype="bfloat16" if dtype == "bfloat16" else None)
    if bias is not None:
        ref["bias"] = bits(tensor(bias))
    yield assert_matches_oracle([bits(x) for x in [out, lse] + [x.grad for x in inputs]],
                                *(bits(tensor(x)) for x in arrays), backend="numpy", dlse=dlse, **ref)


def dask_case(rng, args):
    """flashcupy.dask forward, backward (with dlse) and attention_probs over random chunkings of every axis."""
    import dask
    import dask.array as da

    import flashcupy.dask as fdask

    B, Hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    group = int(rng.integers(1, 3))
    Sq, Sk = (0 if rng.random() < 0.05 else int(rng.integers(1, 90)) for _ in range(2))  # empty ones too
    D = int(rng.choice([1, 8, 24]))
    Dv = int(rng.choice([1, 8, 24])) if rng.random() < 0.3 else D  # v's head_dim of its own in 30 %
    dtype = np.dtype(str(rng.choice(["float16", "float32", "float64"])))
    q, k, v = make_qkv(rng, B, Sq, Sk, Hkv * group, Hkv, D, dtype, head_dim_v=Dv)
    dout = rng.standard_normal(q.shape[:3] + (Dv,)).astype(dtype)
    kw = {"causal": bool(rng.random() < 0.5)}
    if rng.random() < 0.3:
        kw["window"] = (int(rng.integers(0, 30)), None if rng.random() < 0.5 else int(rng.integers(0, 30)))
    if rng.random() < 0.3:
        kw["softcap"] = float(rng.uniform(0.5, 3))
    if rng.random() < 0.4:
        shape = _broadcast_shape(rng, (B, Hkv * group, Sq, Sk))[int(rng.integers(0, 3)):]
        kw["bias"] = rng.standard_normal(shape).astype(np.float32 if rng.random() < 0.3 else dtype)
    if rng.random() < 0.3:
        kw["mask"] = rng.random(_broadcast_shape(rng, (B, Hkv * group, Sq, Sk))) < 0.7
    kw.update(_dropout(rng))
    rows, keys = (int(rng.integers(1, n + 1)) if n else 1 for n in (Sq, Sk))
    heads = int(rng.choice([h for h in range(1, Hkv + 1) if Hkv % h == 0]))
    yield _describe(B=B, Sq=Sq, Sk=Sk, Hq=Hkv * group, Hkv=Hkv, D=D, Dv=Dv, dtype=dtype.name,
                    chunks=(rows, keys, heads), **kw)
    Q = da.from_array(q, chunks=(1, rows, heads * group, D))
    K, V = (da.from_array(x, chunks=(1, keys, heads, -1)) for x in (k, v))
    ref = dict(kw)
    for name in ("bias", "mask"):  # half of them dask arrays in chunks of their own
        if name in kw and rng.random() < 0.5:
            chunks = tuple(int(rng.integers(1, max(n, 1) + 1)) for n in kw[name].shape)
            kw[name] = da.from_array(kw[name], chunks=chunks)
    dlse = rng.standard_normal((B, Hkv * group, Sq)).astype(np.float64 if dtype == np.float64 else np.float32)
    with dask.config.set(scheduler="synchronous"):
        out, lse = fdask.attention(Q, K, V, return_lse=True, **kw)
        grads = fdask.attention_backward(da.from_array(dout, chunks=out.chunks), Q, K, V, out, lse,
                                         dlse=da.from_array(dlse), **kw)
        no_dropout = {n: x for n, x in kw.items() if not n.startswith("dropout")}  # lse is of the undropped P
        P = fdask.attention_probs(Q, K, lse, **no_dropout)
        got = dask.compute(out, lse, *grads, P)
    ratios = assert_matches_oracle(got[:-1], q, k, v, dout, backend=None, dlse=dlse, **ref)
    want = expected(q, k, v, probs=True, **{n: x for n, x in ref.items() if not n.startswith("dropout")})
    ratios["P"] = error_ratio(got[-1], want, "P")
    assert ratios["P"] <= 1, f"P: error {ratios['P']:.3g} times the tolerance"
    yield ratios


SURFACES = {"attention": attention_case, "varlen": varlen_case, "cache": cache_case, "jax": jax_case,
            "jvp": jvp_case, "probs": probs_case, "torch": torch_case, "dask": dask_case}


def search(args) -> int:
    """Runs args.n cases of args.surface; prints a line each and returns the number that failed."""
    seeds = np.random.default_rng(args.seed).integers(1 << 30, size=args.n)
    failed = 0
    for i, seed in enumerate(seeds):
        case = SURFACES[args.surface](np.random.default_rng(seed), args)
        described = "?"
        try:
            described = next(case)
            ratios = next(case)
            shown = " ".join(f"{name} {x:.2f}" for name, x in (ratios or {}).items())
            print(f"ok   [{i} seed {seed}] {described} {shown}", flush=True)
        except Exception as e:  # noqa: BLE001 (every failure is a finding: reported, and the search goes on)
            failed += 1
            print(f"FAIL [{i} seed {seed}] {described}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if args.verbose:
                traceback.print_exc()
    print(f"{failed} of {args.n} failed")
    return failed


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("surface", choices=SURFACES)
    parser.add_argument("--backend", default="numpy", choices=sorted(contract.CONTEXTS))
    parser.add_argument("--path", default=None, help="contract.CONTEXTS' path (default: the backend's first)")
    parser.add_argument("--order", default="ascending", help="the emulator's thread order (cupy)")
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-seqlen", type=int, default=150)
    parser.add_argument("--max-batch", type=int, default=2, help="attention's batch, 1 to this")
    parser.add_argument("--head-dims", default="1,3,8,16,24,40,64,72,96,128")
    parser.add_argument("--dtypes", default="float16,bfloat16-bits,float32,float64")
    parser.add_argument("--no-modifiers", dest="modifiers", action="store_false")
    parser.add_argument("-v", "--verbose", action="store_true", help="a traceback for each failure")
    args = parser.parse_args(argv)
    args.head_dims = [int(x) for x in args.head_dims.split(",")]
    args.dtypes = args.dtypes.split(",")
    if args.path is None:
        args.path = next(iter(contract.BACKENDS[args.backend].paths))
    if args.backend != "cupy":
        args.order = None
    return args


if __name__ == "__main__":
    sys.exit(min(search(parse()), 100))
