"""Every Triton op on a GPU other than the current one: each op runs on the last GPU while
cuda:0 is current, and its output and gradients must equal the same call on cuda:0 bit
for bit (Triton launches on the current device; the ops switch to their tensors' device,
``ctxfast.ops._common.on_tensor_device``). Skipped with fewer than two GPUs. (The switch
itself without a GPU: tests/test_dispatch.py.)"""
import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from .test_launch_gpu import OPS, _inputs  # noqa: E402


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_on_a_device_that_is_not_current(op):
    other = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(0)
    want = OPS[op](*_inputs(torch.bfloat16, 0))
    got = OPS[op](*(t.to(other) for t in _inputs(torch.bfloat16, 0)))
    torch.cuda.synchronize(other)
    assert torch.cuda.current_device() == 0
    for j, (a, b) in enumerate(zip(got, want)):
        assert a.device == other, f"{op} output {j} on {a.device}"
        assert torch.equal(a.cpu(), b.cpu()), f"{op} output {j}: {other} != cuda:0"
