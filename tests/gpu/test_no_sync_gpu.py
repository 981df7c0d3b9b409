"""No host-device synchronisation in a training step on a GPU: every model's forward + loss
and backward, its evaluation forward, and the Triton LSTM and varlen attention calls run
under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising CUDA
call (a value read to the host, a blocking copy from host memory). On the CPU,
``benchmarks/count_dispatches.py --as-on-gpu`` counts the value reads of the same steps
(``tests/test_bench.py``); this test also sees the copies that count cannot. Skipped
without CUDA."""
import contextlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import ctxfast  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
import bench_models as BM  # noqa: E402


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("model", ["gpt", "bert", "xlnet", "transformer_xl", "awd_lstm", "elmo"])
def test_train_step_and_evaluation_do_not_synchronise(model):
    case = next(c for c in BM.QUICK_CASES if c.model == model and c.label == "tiny")
    wl = BM.WORKLOADS[model]
    device = torch.device("cuda")
    net, _ = BM._models(case, "ctxfast", device)
    net.train()
    torch.manual_seed(1)
    batch = wl.batch(case, device, torch.float32)

    def step():
        loss, _ = wl.run(net, batch)
        loss.backward()

    def evaluate():
        net.eval()
        with torch.no_grad():
            wl.run(net, batch)
        net.train()

    for fn in (step, evaluate):
        fn()                                      # compiles, and makes what is kept
        with no_sync():
            fn()


def test_triton_lstm_and_varlen_attention_do_not_synchronise():
    g = torch.Generator(device="cpu").manual_seed(0)
    T, B, I, H = 9, 3, 16, 32
    x = torch.randn(T, B, I, generator=g).cuda().requires_grad_()
    w = [(torch.randn(*s, generator=g) * 0.2).cuda().requires_grad_()
         for s in ((4 * H, I), (4 * H, H), (4 * H,), (4 * H,))]
    mask = (torch.rand(4 * H, H, generator=g) > 0.3).cuda()

    def lstm():
        out, _ = ctxfast.lstm(x, None, *w, weight_mask=mask, weight_dropout=0.3,
                              cell_clip=3.0, backend="triton")
        out.sum().backward()

    lens = [5, 11, 3]
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int32).cuda()
    q, k, v = (torch.randn(19, 2, 32, generator=g).cuda().requires_grad_() for _ in range(3))

    def varlen():
        out = ctxfast.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                       backend="triton")
        out.sum().backward()

    for fn in (lstm, varlen):
        fn()
        with no_sync():
            fn()
