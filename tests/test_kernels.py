"""The native decode-attention kernel against the gather path it replaces (kernels.py)."""

from pathlib import Path

import pytest
import torch

from nanoserve.cache import BatchedPagedKVCache
from nanoserve.course import tiny_config
from nanoserve.kernels import native, native_status
from nanoserve.model import LlamaConfig

needs_native = pytest.mark.skipif(native() is None, reason=f"the native kernel is {native_status()}")


def pools(dtype, slots=300, heads=9, kv=3, hd=64, seed=0):
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=heads * hd,
        intermediate_size=8,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hd,
        max_position_embeddings=512,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
    )
    g = torch.Generator().manual_seed(seed)
    caches = {}
    for kind in ("gather", "native"):
        c = BatchedPagedKVCache(cfg, slots, dtype=dtype, attention=kind)
        c.ensure_pools()
        caches[kind] = c
    k = torch.randn(slots + 1, kv, hd, generator=g).to(dtype)
    v = torch.randn(slots + 1, kv, hd, generator=g).to(dtype)
    for c in caches.values():
        c.k[0].copy_(k)
        c.v[0].copy_(v)
    return cfg, caches, g


@needs_native
@pytest.mark.parametrize("hd", [64, 16])  # 64: the AVX2 path on a CPU that has it; 16: the portable one
@pytest.mark.parametrize("spread", [1.0, 30.0])  # 30: peaked softmax, scores far below their max
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_decode_attention_equals_the_gather_path(dtype, tol, spread, hd):
    cfg, caches, g = pools(dtype, hd=hd)
    lens = torch.tensor([1, 17, 0, 130, 64, 5])  # a 0: a padded row of a bucket; 17, 130, 5: not x8
    window = torch.stack([torch.randperm(300, generator=g)[:160] for _ in lens])
    q = (spread * torch.randn(len(lens), cfg.num_heads, cfg.head_dim, generator=g)).to(dtype)
    ref = caches["gather"]._one_query_rows(0, q, window, lens)
    got = caches["native"]._one_query_rows(0, q, window, lens)
    assert got.dtype == dtype and got.shape == ref.shape
    assert (got[2] == 0).all(), "a row of context 0 reads nothing and gives zeros"
    assert (got.float() - ref.float()).abs().max().item() < tol


@needs_native
def test_the_kernel_check_fails_on_a_kernel_reading_one_slot_too_many():
    """The comparison above, shown failing: context lengths one longer (an off-by-one a kernel
    could make) give a different answer."""
    cfg, caches, g = pools(torch.float32, seed=1)
    lens = torch.tensor([9, 40])
    window = torch.stack([torch.randperm(300, generator=g)[:64] for _ in lens])
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=g)
    ref = caches["gather"]._one_query_rows(0, q, window, lens)
    wrong = caches["native"]._one_query_rows(0, q, window, lens + 1)
    assert (wrong - ref).abs().max().item() > 1e-3


def test_asking_for_native_where_it_cannot_build_is_a_sentence(monkeypatch):
    import nanoserve.kernels as kernels

    monkeypatch.setattr(kernels, "_status", "unavailable (no compiler)")
    monkeypatch.setattr(kernels, "_ext", None)
    cfg = tiny_config()
    with pytest.raises(ValueError, match="native attention kernel is unavailable"):
        BatchedPagedKVCache(cfg, 16, attention="native")
    assert BatchedPagedKVCache(cfg, 16, attention="auto").attention == "gather"


@needs_native
def test_a_window_outside_the_pools_is_an_error_not_a_stray_read():
    cfg, caches, g = pools(torch.float32, seed=2)
    window = torch.zeros(2, 8, dtype=torch.long)
    window[1, 3] = 10_000  # past the 301 slots of the pools
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=g)
    with pytest.raises(RuntimeError, match="outside the pools"):
        caches["native"]._one_query_rows(0, q, window, torch.tensor([8, 8]))
    caches["native"]._one_query_rows(0, q, window, torch.tensor([8, 3]))  # slot 3 of row 1 is unread


@needs_native
def test_the_kernel_is_built_for_the_instructions_this_cpu_has():
    """-march=native: on a CPU with AVX2 and FMA the fp32 head_dim-64 path is the vector one."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    want = "avx2" if {"avx2", "fma"} <= set(flags) else "portable"
    assert native().isa() == want


@needs_native
def test_a_stale_build_lock_does_not_hang_the_next_start():
    """A process killed mid-build leaves torch's `lock` file behind, and torch waits for it to go
    away forever; the next start (here a fresh interpreter) holds an flock, knows the file is
    stale, removes it and loads. Before the flock, this hung until the timeout."""
    import subprocess
    import sys

    from nanoserve.kernels import build_location

    _, build_dir = build_location()
    (build_dir / "lock").touch()
    code = "from nanoserve.kernels import native_status; print(native_status())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "built", r.stderr[-500:]
    assert not (build_dir / "lock").exists()
