"""Data-parallel training of ctxfast models: two processes (gloo, CPU) each train on one half
of every batch for a few steps, under DistributedDataParallel and under FSDP2
(``fully_shard``: each layer's parameters sharded over the two ranks, gathered for its
forward and backward, gradients reduce-scattered); the parameters must equal those of one
process training on the whole batches.

Adding a model is one entry in ``CASES``: a :class:`Case` with a builder, the batches, a
step function and the layers FSDP shards apart. One spawn of two processes trains every
case in both modes (see ``ddp_results``). The children get the parent's
``TRITON_INTERPRET`` (set before anything imports triton); the models run on
``backend="ctxfast"`` with ctxfast's default dispatch (on CPU tensors that is each op's
default CPU implementation, see ``ctxfast info``).
"""
import datetime
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = 3


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]        # same weights on every call (seeded)
    batches: Callable[[], List[Sequence[torch.Tensor]]]   # one whole batch per step
    batch_dim: int                              # the dimension the ranks split
    step: Callable[[torch.nn.Module, Sequence[torch.Tensor], Any], Any]
    # step(model, batch, state) -> (mean loss to backpropagate, new state); state starts None
    units: Callable[[torch.nn.Module], Iterable[torch.nn.Module]]   # FSDP's units, root aside


# --------------------------------------------------------------------------- Transformer-XL

def _xl_build():
    from ctxfast.models.transformer_xl import TransformerXL, TransformerXLConfig
    torch.manual_seed(0)
    return TransformerXL(TransformerXLConfig(n_token=29, n_layer=2, n_head=2, d_model=32,
                                             d_head=16, d_inner=48, dropout=0.0, tgt_len=8,
                                             mem_len=8))


def _xl_batches():
    g = torch.Generator().manual_seed(1)
    stream = torch.randint(0, 29, (STEPS * 8 + 1, 4), generator=g)     # [T, B], time-major
    return [(stream[s:s + 8], stream[s + 1:s + 9]) for s in range(0, STEPS * 8, 8)]


def _xl_step(model, batch, mems):
    """One segment; the memory of this rank's half is carried to the next step."""
    x, y = batch
    loss, mems = model(x, y, *(mems or ()))
    return loss.mean(), mems


# --------------------------------------------------------------------------- GPT

def _gpt_build():
    from ctxfast.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=37, n_positions=16, n_layer=2, n_head=2, n_embd=32))


def _gpt_batches():
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 37, (4, 13), generator=g)                 # [B, T + 1]
    return [(stream[:, :12], stream[:, 1:])] * STEPS


# the step: causal LM loss, as AWD-LSTM's (_awd_step); the weight-tied head (``lm_head``
# is ``wte``) stays in the root unit


# --------------------------------------------------------------------------- AWD-LSTM

def _awd_build():
    from ctxfast.models.awd_lstm import AWDLSTMConfig, AWDLSTMLM
    torch.manual_seed(0)
    return AWDLSTMLM(AWDLSTMConfig(vocab_size=31, emb_sz=8, n_hid=16, n_layers=3,
                                   embed_p=0.0, input_p=0.0, hidden_p=0.0, weight_p=0.0,
                                   output_p=0.0))        # dropout off: ranks draw other masks


def _awd_batches():
    g = torch.Generator().manual_seed(2)
    stream = torch.randint(0, 31, (4, STEPS * 6 + 1), generator=g)     # [B, T], batch-first
    return [(stream[:, s:s + 6], stream[:, s + 1:s + 7]) for s in range(0, STEPS * 6, 6)]


def _awd_step(model, batch, state):
    """One BPTT window (AWD-LSTM: the model carries its rows' hidden state, detached,
    itself); GPT's step too: ``(logits, loss) = model(x, y)``."""
    x, y = batch
    _, loss = model(x, y)
    return loss, state


# --------------------------------------------------------------------------- ELMo biLM

def _elmo_build():
    from ctxfast.models.elmo import ElmoBiLM, ElmoConfig
    torch.manual_seed(0)
    return ElmoBiLM(ElmoConfig(char_embed_dim=4, filters=((1, 4), (2, 6)), n_highway=1,
                               projection_dim=8, cell_size=16, max_characters_per_token=8,
                               vocab_size=19, cell_clip=0.1, proj_clip=0.02, dropout=0.0,
                               lm_dropout=0.0))


def _elmo_batches():
    """Sentences of one length: each half's mean loss then weighs its tokens as the whole
    batch's does (padding would give the halves other token counts)."""
    from ctxfast.models.elmo import batch_to_ids
    g = torch.Generator().manual_seed(4)
    words = ["ab", "c", "def", "g", "hij", "kl"]
    out = []
    for _ in range(STEPS):
        pick = torch.randint(0, len(words), (4, 3), generator=g).tolist()
        char_ids = batch_to_ids([[words[i] for i in row] for row in pick], 8)   # [4, 3, 8]
        out.append((char_ids, torch.randint(0, 19, (4, 3), generator=g)))
    return out


def _elmo_step(model, batch, state):
    """Both LM losses through the projected biLSTM with both clips active."""
    char_ids, word_ids = batch
    return model(char_ids, word_ids).loss, state


CASES = {
    "transformer_xl": Case(_xl_build, _xl_batches, batch_dim=1, step=_xl_step,
                           units=lambda m: m.layers),
    "gpt": Case(_gpt_build, _gpt_batches, batch_dim=0, step=_awd_step,
                units=lambda m: m.transformer.h),
    "awd_lstm": Case(_awd_build, _awd_batches, batch_dim=0, step=_awd_step,
                     units=lambda m: m.encoder.rnns),
    "elmo_bilm": Case(_elmo_build, _elmo_batches, batch_dim=0, step=_elmo_step,
                      units=lambda m: [*m.lstm.forward_layers, *m.lstm.backward_layers]),
}
MODES = ("ddp", "fsdp")


# --------------------------------------------------------------------------- training

def _train(case: Case, model: torch.nn.Module, rank: int, world: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state = None
    for batch in case.batches():
        part = [t.chunk(world, case.batch_dim)[rank] for t in batch]
        opt.zero_grad()
        loss, state = case.step(model, part, state)
        loss.backward()
        opt.step()


def _wrap(mode: str, case: Case, model: torch.nn.Module, world: int) -> torch.nn.Module:
    """The model under DDP, or sharded by FSDP2: each of ``case.units`` a unit of its own,
    the rest (embeddings, tied heads, shared biases) the root's."""
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for unit in case.units(model):
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full_state(mode: str, model: torch.nn.Module) -> dict:
    """Every parameter and buffer whole (FSDP's shards gathered: a collective, each rank in
    the same order)."""
    if mode == "ddp":
        model = model.module
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, init_file: str, out_dir: str, triton_interpret: str) -> None:
    """Train every case in each mode; save each one's parameters, or the error it raised."""
    if triton_interpret:
        os.environ["TRITON_INTERPRET"] = triton_interpret
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for mode in MODES:
            for name, case in CASES.items():
                path = os.path.join(out_dir, f"{mode}-{name}-rank{rank}.pt")
                try:
                    model = _wrap(mode, case, case.build(), world)
                    _train(case, model, rank, world)
                    torch.save(_full_state(mode, model), path)
                except Exception:  # reported by that case's test; the other cases still run
                    torch.save({"error": traceback.format_exc()}, path)
    finally:
        dist.destroy_process_group()
    # Every result is saved: leave without the interpreter's teardown. In about 5 % of runs
    # (torch 2.13, gloo, CPU; 3 of 40 before any change of 2026-11-25) a child aborted
    # there, after its last Python frame ("terminate called without an active exception",
    # faulthandler: no Python frame), and mp.spawn failed the fixture with SIGABRT.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    """One spawn of two processes trains every case in each mode (the start-up, mostly
    importing torch and torch._dynamo for DDP, is paid once). -> the folder of their
    results."""
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(WORLD, str(out / "store"), str(out),
                            os.environ.get("TRITON_INTERPRET", "")),
             nprocs=WORLD, join=True)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_equal_one_process(name, mode, ddp_results):
    case = CASES[name]
    ranks = [torch.load(ddp_results / f"{mode}-{name}-rank{r}.pt") for r in range(WORLD)]
    for r, sd in enumerate(ranks):
        assert "error" not in sd, f"rank {r} failed:\n{sd.get('error')}"
    single = case.build()
    before = {k: v.detach().clone() for k, v in single.named_parameters()}
    _train(case, single, rank=0, world=1)
    for k, v in single.state_dict().items():
        for r, sd in enumerate(ranks):
            torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, r=r: f"rank {r}, {k}: {m}")
    still = [k for k, p in single.named_parameters() if torch.equal(p, before[k])]
    assert not still, f"training did not change {still}"
