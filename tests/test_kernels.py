"""The native kernels' build (kernels.py: its ISA, its cache name) and the decode-attention kernel
against the gather path it replaces, with the checks of its inputs."""

import os
import types
from pathlib import Path

import pytest
import torch

from nanocourse import tiny_config
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.kernels import native, native_status
from nanoserve.models import LlamaConfig

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


# --- every input checked, the window once a step ---------------------------------------------


def attention_inputs(seed=4):
    """Valid decode_attention arguments over the 301-slot pools of `pools` (9 heads over 3 K/V
    heads, head_dim 64): two rows of 8 slots, every slot below 200."""
    cfg, caches, g = pools(torch.float32, seed=seed)
    c = caches["native"]
    window = torch.stack([torch.randperm(200, generator=g)[:8] for _ in range(2)])
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=g)
    return dict(q=q, k=c.k[0], v=c.v[0], window=window, context_lens=torch.tensor([8, 8]), scale=0.125)


def _v_of(slots):
    return lambda a: a.update(v=torch.randn(slots, 3, 64))


def _slot_past_v(a):
    a["v"] = torch.randn(200, 3, 64)  # 101 slots fewer than K
    a["window"][1, 3] = 250  # in K, past V


BROKEN_ATTENTION = {
    "a V pool of another size": (_v_of(400), "K and V pools of a layer have one shape"),
    "a slot past the V pool": (_slot_past_v, "K and V pools of a layer have one shape"),
    "no K/V heads": (
        lambda a: a.update(k=torch.randn(301, 0, 64), v=torch.randn(301, 0, 64)),
        "no K/V heads",
    ),
    "a head_dim the pools lack": (
        lambda a: a.update(q=torch.randn(2, 9, 32)),
        "head_dim 32 is not the pools' 64",
    ),
    "pools on another device": (
        lambda a: a.update(k=a["k"].to("meta"), v=a["v"].to("meta")),
        "CPU kernel",
    ),
    "q of another dtype": (lambda a: a.update(q=a["q"].bfloat16()), "share one dtype"),
    "a window of another dtype": (lambda a: a.update(window=a["window"].int()), "int64"),
}


@needs_native
@pytest.mark.parametrize("case", BROKEN_ATTENTION)
def test_decode_attention_checks_every_input_before_it_reads(case):
    """Each case breaks one input of a call that works: the kernel must refuse it with a sentence,
    never divide by zero heads or read past a pool (the checks used to cover K's size only)."""
    args = attention_inputs()
    native().decode_attention(*args.values())  # the unbroken call runs
    breaks, message = BROKEN_ATTENTION[case]
    breaks(args)
    with pytest.raises(RuntimeError, match=message):
        native().decode_attention(*args.values())


@needs_native
def test_a_step_checks_its_window_once_and_reads_its_own_copy():
    """Through the cache, a step's window is checked once (a DecodeWindow kept in the step's
    memo) and every layer reads the checked copy: a slot written into the window after the check
    is not read, and the next step, which checks afresh, refuses it."""
    cfg, caches, g = pools(torch.float32, seed=5)
    cache = caches["native"]
    lens = torch.tensor([8, 5])
    window = torch.stack([torch.randperm(300, generator=g)[:8] for _ in lens])
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=g)
    memo, plan = {}, types.SimpleNamespace(slot_window=window, context_lens=lens)
    first = cache._decode_attention(0, q, plan, memo)
    checked = memo["native window"]
    assert checked.reach == max(window[0, :8].max().item(), window[1, :5].max().item()) + 1
    window[0, 0] = 10_000  # past the pools, written after the check
    again = cache._decode_attention(0, q, plan, memo)  # the next layer of the same step
    assert memo["native window"] is checked and torch.equal(first, again)
    with pytest.raises(RuntimeError, match="row 0 reads slot 10000, outside the pools' 301 slots"):
        cache._decode_attention(0, q, plan, {})  # a new step
    with pytest.raises(RuntimeError, match="row 0 reads slot 10000"):
        cache._one_query_rows(0, q, window, lens)  # called alone, after a step: checked afresh


# --- the build's ISA ---------------------------------------------------------------------------


def test_nanoserve_isa_names_its_choices_and_refuses_the_rest(monkeypatch):
    import nanoserve.kernels as kernels

    monkeypatch.setattr(kernels, "_status", None)  # restored after the test, with _ext
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setenv("NANOSERVE_ISA", "avx1024")
    with pytest.warns(RuntimeWarning, match="is not one of native, avx2, avx512, avx512_vnni"):
        assert kernels.native() is None  # refused before any build
    assert kernels.native_status().startswith("unavailable (NANOSERVE_ISA='avx1024' is not one of")
    v3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: v3)  # an AVX2 EPYC
    monkeypatch.setenv("NANOSERVE_ISA", "avx512_vnni")
    assert kernels.isa_refusal() == (
        "NANOSERVE_ISA=avx512_vnni needs avx512_vnni, avx512bw, avx512cd, avx512dq, avx512f, avx512vl, "
        "which this CPU lacks"
    )
    for fine in ("avx2", "native"):
        monkeypatch.setenv("NANOSERVE_ISA", fine)
        assert kernels.isa_refusal() is None


def test_the_build_is_named_by_the_isa_it_is_built_for(monkeypatch):
    """-march=native compiles for this CPU, so a cache shared with another machine must not hand
    one CPU's build to the other: each named ISA has its own name, and native's is made of what
    the compiler detects (another CPU model or feature set, another name)."""
    import nanoserve.kernels as kernels

    names = {}
    for isa in kernels.ISAS:
        monkeypatch.setenv("NANOSERVE_ISA", isa)
        names[isa] = kernels.build_name()
    assert len(set(names.values())) == len(kernels.ISAS), names
    assert names["avx2"].startswith("nanoserve_avx2_")
    monkeypatch.setenv("NANOSERVE_ISA", "native")
    here = kernels._target(["-march=native"])
    monkeypatch.setattr(kernels, "_target", lambda flags: (here[0] + " -mno-avx512f", here[1]))
    assert kernels.build_name() != names["native"]  # the same model with other features
    monkeypatch.setattr(kernels, "_target", lambda flags: ('"-march=haswell" -mavx2', "haswell"))
    assert kernels.build_name().startswith("nanoserve_native_haswell_")


def isa_products() -> dict:
    """What the loaded build computes on fixed inputs, and which paths it took: the products over
    the split layout and over the layout `kernel_layout` picks, and decode attention at head_dim
    64 (the AVX2 loop where the build has it)."""
    from nanoserve.quant import QuantTensor, kernel_layout

    ext = native()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 256, generator=g)
    out = {"isa": ext.isa(), "has_tiles": ext.has_tiles()}
    for kind in ("q4_1", "q8_0"):
        w = QuantTensor.quantize(torch.randn(40, 256, generator=g), kind)
        out[f"{kind} dequantized"] = w.split().dequantize()
        for acts in ("fp32", "int8"):
            picked = kernel_layout(w.with_activations(acts))
            out[f"{kind} {acts} layout"] = picked.layout
            out[f"{kind} {acts} split"] = w.with_activations(acts).split().linear(x)
            out[f"{kind} {acts} picked"] = picked.linear(x)
    out["attention"] = native().decode_attention(*attention_inputs(seed=6).values())
    return out


@needs_native
@pytest.mark.slow
def test_an_avx2_build_takes_the_avx2_machines_paths(tmp_path):
    """NANOSERVE_ISA=avx2 builds (in a fresh interpreter: one build a process) the kernels an
    AVX2 EPYC compiles for itself: the AVX2 attention loop, no tiles, the split layout for int8
    activations. Where both builds run the same AVX2 code (split-layout products, dequantizing)
    the numbers are this machine's native build's bit for bit; where the native build took its
    AVX-512 paths (tiles, the compiler's wider loops) only the order of float sums differs."""
    import subprocess
    import sys

    from nanoserve.kernels import isa_refusal

    env = dict(os.environ, NANOSERVE_ISA="avx2", ATEN_CPU_CAPABILITY="avx2")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("NANOSERVE_ISA", "avx2")
        if isa_refusal() is not None:
            pytest.skip(isa_refusal())
    code = (
        "import torch; from nanoserve.kernels import build_name, native_status; "
        "from tests.test_kernels import isa_products; "
        "assert native_status() == 'built', native_status(); "
        f"torch.save(isa_products(), {str(tmp_path / 'p')!r}); print(build_name())"
    )
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("nanoserve_avx2_")
    avx2, here = torch.load(tmp_path / "p"), isa_products()
    assert avx2["isa"] == "avx2" and avx2["has_tiles"] is False
    for kind in ("q4_1", "q8_0"):
        assert avx2[f"{kind} fp32 layout"] == avx2[f"{kind} int8 layout"] == "split"
        assert torch.equal(avx2[f"{kind} dequantized"], here[f"{kind} dequantized"])
        for acts in ("fp32", "int8"):
            assert torch.equal(avx2[f"{kind} {acts} split"], here[f"{kind} {acts} split"]), (kind, acts)
            assert torch.allclose(
                avx2[f"{kind} {acts} picked"], here[f"{kind} {acts} picked"], rtol=1e-5, atol=1e-4
            )
    assert here["q4_1 int8 layout"] == ("tiles" if here["has_tiles"] else "split")
    assert (avx2["attention"] - here["attention"]).abs().max().item() < 1e-5
