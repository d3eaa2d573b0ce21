"""The capture list's arithmetic against the seed's numbers (Day 55), and the buckets under it."""

import pytest

from nanoserve.buckets import bucket_shape, bucket_up, row_buckets, width_buckets
from nanoserve.warmup import lazy_captures, stall_seconds, warm_shapes, warmup_seconds, width_ceiling

SERVING = dict(max_batch=256, max_model_len=8192, width_multiple=128)


def test_row_and_width_buckets():
    assert row_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert row_buckets(6) == (1, 2, 4, 6)
    assert width_buckets(8192, 128)[:3] == (128, 256, 384) and len(width_buckets(8192, 128)) == 64
    assert width_buckets(100, 32) == (32, 64, 96, 100)
    assert bucket_shape(3, 200, 256, 8192, 128) == (4, 256)
    assert bucket_up(128, (128, 256)) == 128
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        bucket_up(300, (128, 256))


def test_serving_size_shape_counts_and_startup_seconds():
    full = warm_shapes(**SERVING)
    assert len(full) == 576
    assert warmup_seconds(full, 0.05) == pytest.approx(28.80)
    assert len(warm_shapes(**SERVING, max_rows=8)) == 256
    assert warmup_seconds(warm_shapes(**SERVING, max_rows=8), 0.05) == pytest.approx(12.80)
    trimmed = warm_shapes(**SERVING, max_rows=8, max_width=2048)
    assert len(trimmed) == 64
    assert warmup_seconds(trimmed, 0.05) == pytest.approx(3.20)


def test_capture_list_is_biggest_first():
    shapes = warm_shapes(**SERVING)
    assert shapes[0] == (256, 8192)
    sizes = [r * w for r, w in shapes]
    assert sizes == sorted(sizes, reverse=True)
    assert shapes[-1] == (1, 128)


@pytest.mark.parametrize(
    "generated, graphs, stall", [(128, 1, 0.05), (512, 4, 0.20), (2048, 16, 0.80), (8192, 64, 3.20)]
)
def test_lazy_stall_at_serving_size(generated, graphs, stall):
    assert lazy_captures(generated, 128) == graphs
    assert stall_seconds(generated, 128, 0.05) == pytest.approx(stall)


@pytest.mark.parametrize("generated, graphs", [(8, 1), (32, 2), (64, 3), (128, 5)])
def test_lazy_captures_at_warmbench_size(generated, graphs):
    # 2 rows off a 16-token prompt at width multiple 32: the seed's cold column
    assert lazy_captures(generated, 32, prompt_len=16) == graphs


def test_lazy_captures_edges():
    assert lazy_captures(1, 32, prompt_len=16) == 0  # the only token comes from prefill
    assert lazy_captures(2, 32, prompt_len=16) == 1
    assert lazy_captures(18, 32, prompt_len=15) == 1  # contexts 16..32: 32 is still the first bucket
    assert lazy_captures(19, 32, prompt_len=15) == 2  # context 33 needs width 64


@pytest.mark.parametrize("budget_mb, widest, shapes", [(64, 1953, 135), (268, 8178, 567), (1000, 30517, 576)])
def test_budget_as_a_width_ceiling(budget_mb, widest, shapes):
    ceiling = width_ceiling(budget_mb * 1_000_000, rows=256, heads=32)
    assert ceiling == widest
    assert len(warm_shapes(**SERVING, max_width=ceiling)) == shapes


def test_pool_sharing_ratio_and_pool_budget():
    from nanoserve.capture import check_pool_budget, pool_sharing_ratio
    from nanoserve.errors import GateError

    sizes = [r * 32 * w * 4 for r, w in warm_shapes(**SERVING)]
    assert pool_sharing_ratio(sizes) == pytest.approx(sum(sizes) / max(sizes))
    assert pool_sharing_ratio([5]) == 1.0 and pool_sharing_ratio([]) == 1.0
    check_pool_budget(max(sizes), max(sizes))
    with pytest.raises(GateError, match="graph pool needs"):
        check_pool_budget(max(sizes), max(sizes) - 1)


def test_warm_budget_bytes_probes_free_memory():
    from nanoserve.warmup import warm_budget_bytes

    free = warm_budget_bytes("cpu")
    assert 0 < free and warm_budget_bytes("cpu", reserve_bytes=free * 2) == 0
