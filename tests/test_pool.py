"""The KV pool plan: bytes per block, blocks per budget, the sink slot (pool.py)."""

import dataclasses

import pytest
import torch

from nanoserve.models import LlamaConfig
from nanoserve.pool import DEFAULT_CPU_BUDGET, KVPoolPlan, parse_bytes, plan_pool

# SmolLM2-135M's shape
SMOL = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
)
MiB = 2**20


def test_smollm2_fp32_arithmetic():
    plan = plan_pool(SMOL, torch.float32, block_size=16, budget_bytes=96 * MiB)
    assert plan.bytes_per_slot == 46_080 == SMOL.kv_bytes_per_token(torch.float32)  # 2 x 30 x 3 x 64 x 4
    assert plan.bytes_per_block == 737_280
    # (100,663,296 - 46,080) // 737,280 = 136 blocks
    assert plan.num_blocks == 136
    assert plan.num_slots == plan.max_tokens == 136 * 16 == 2176
    assert plan.sink_slot == plan.num_slots
    assert plan.total_bytes == 136 * 737_280
    assert plan.pool_bytes == plan.total_bytes + 46_080 <= plan.budget_bytes
    assert plan.pool_bytes + plan.bytes_per_block > plan.budget_bytes  # one more block would not fit
    assert (plan.num_layers, plan.num_kv_heads, plan.head_dim, plan.dtype) == (30, 3, 64, "fp32")
    assert plan.describe() == (
        "KV pool: 136 blocks x 16 tokens = 2,176 tokens, 100.3 MB "
        "(budget 100.7 MB, fp32, 30 layers x 3 KV heads x 64)"
    )


def test_smollm2_bf16_halves_the_block():
    plan = plan_pool(SMOL, torch.bfloat16, budget_bytes=96 * MiB)
    assert (plan.bytes_per_slot, plan.bytes_per_block, plan.dtype) == (23_040, 368_640, "bf16")
    assert plan.num_blocks == (96 * MiB - 23_040) // 368_640 == 273
    assert plan_pool(SMOL, "bf16", budget_bytes=96 * MiB) == plan


def test_block_size_scales_the_block():
    plan = plan_pool(SMOL, torch.float32, block_size=32, budget_bytes=96 * MiB)
    assert plan.bytes_per_block == 2 * 737_280 and plan.num_blocks == 68


def test_the_sink_slot_is_paid_for():
    exact = 10 * 737_280 + 46_080
    assert plan_pool(SMOL, torch.float32, budget_bytes=exact).num_blocks == 10
    assert plan_pool(SMOL, torch.float32, budget_bytes=exact - 1).num_blocks == 9


def test_default_budgets():
    cpu = plan_pool(SMOL, torch.float32)
    assert cpu.budget_bytes == DEFAULT_CPU_BUDGET == 512 * MiB
    assert cpu.num_blocks == (512 * MiB - 46_080) // 737_280 == 728


def test_cuda_default_is_a_fraction_of_free_memory(monkeypatch):
    # the arithmetic, checked on any machine with a stand-in for the driver's answer
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    plan = plan_pool(SMOL, torch.bfloat16, device="cuda", gpu_fraction=0.5)
    assert plan.budget_bytes == 5 * 2**30
    assert plan.num_blocks == (5 * 2**30 - 23_040) // 368_640
    assert plan_pool(SMOL, torch.bfloat16, device="cuda:0", budget_bytes=96 * MiB).num_blocks == 273
    with pytest.raises(ValueError, match="gpu_fraction"):
        plan_pool(SMOL, torch.bfloat16, device="cuda", gpu_fraction=1.5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_default_fits_in_free_memory():
    free, _ = torch.cuda.mem_get_info()
    plan = plan_pool(SMOL, torch.bfloat16, device="cuda")
    assert 0 < plan.pool_bytes <= free


@pytest.mark.parametrize(
    "budget, min_blocks", [(737_280, 1), (46_080, 1), (0, 1), (9 * 737_280 + 46_080, 10)]
)
def test_too_small_a_budget_says_what_a_block_needs(budget, min_blocks):
    with pytest.raises(ValueError, match="one block of 16 tokens needs 737,280 bytes"):
        plan_pool(SMOL, torch.float32, budget_bytes=budget, min_blocks=min_blocks)


def test_bad_dtype_and_block_size_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        plan_pool(SMOL, torch.int8)
    with pytest.raises(ValueError, match="dtype"):
        plan_pool(SMOL, "fp8")
    with pytest.raises(ValueError, match="block_size"):
        plan_pool(SMOL, torch.float32, block_size=0)


def test_budget_as_a_string():
    assert plan_pool(SMOL, torch.float32, budget_bytes="96MiB") == plan_pool(
        SMOL, torch.float32, budget_bytes=96 * MiB
    )


def test_plan_is_frozen():
    plan = plan_pool(SMOL, torch.float32, budget_bytes=96 * MiB)
    assert isinstance(plan, KVPoolPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_blocks = 1


# --- parse_bytes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [
        (123, 123),
        (0, 0),
        ("123", 123),
        ("1e9", 10**9),
        ("2GB", 2 * 10**9),
        ("2gb", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1.1MB", 1_100_000),
        ("64KiB", 65536),
        ("64kb", 64000),
        ("  7B ", 7),
        ("2.5e3KB", 2_500_000),
    ],
)
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize(
    "text",
    ["", "abc", "MiB", "12 XB", "12M", "-5", "1.5", "0.3KiB", "1e99", "5 5", "1,000", True, 3.5, None, -1],
)
def test_parse_bytes_refuses_garbage_with_a_sentence(text):
    with pytest.raises(ValueError, match=r"size|bytes"):
        parse_bytes(text)
