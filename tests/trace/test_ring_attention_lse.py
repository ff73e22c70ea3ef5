"""The teaching ring attention keeps its log-sum-exp in fp32 whatever the compute dtype, as torch's ring attention
does (its flash kernels return the log-sum-exp in fp32 and _SDPAMerger merges blocks in fp32,
torch/distributed/tensor/experimental/_context_parallel/_attention.py), so the core's fp32 log-sum-exp per row and
head (core.rank_share.Sizes.lse) is what a bf16-mixed cp run saves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shardscope.ring_attention import ring_attention  # noqa: E402


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _saved_by_ring(dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(tensors the ring saves for backward, its output, causal SDPA's output) for 2 x 4 heads x 8 rows x 16."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=generator, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = ring_attention(q, k, v, torch.empty(0), "sdpa", group=dist.group.WORLD)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    return saved, out, expected


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(("dtype", "lse_dtype"), [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_the_saved_log_sum_exp_is_fp32_or_wider(dtype: torch.dtype, lse_dtype: torch.dtype) -> None:
    saved, out, expected = _saved_by_ring(dtype)
    # q, k, v and the output in the compute dtype, then one log-sum-exp per batch, head and row
    assert [tuple(t.shape) for t in saved] == [(2, 4, 8, 16)] * 4 + [(2, 4, 8)]
    assert [t.dtype for t in saved] == [dtype] * 4 + [lse_dtype]
    assert saved[-1].nbytes == 2 * 4 * 8 * (4 if dtype == torch.bfloat16 else 8)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-12
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
